"""Callbacks that attach a ``HookLogger`` inside a training framework.

``tblog_hooks.integrations.lightning`` (Lightning) and ``tblog_hooks.integrations.transformers``
(Hugging Face ``Trainer``) each import their framework; this package imports neither, so
``import tblog_hooks`` works without them.
"""
