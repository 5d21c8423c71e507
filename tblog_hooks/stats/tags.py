"""TensorBoard tags, ``{root}/{stat}/{name}``: every root and statistic name, declared once here,
and the escaping of user-data names, so tags stay valid and unambiguous."""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from urllib.parse import unquote


class Root(enum.StrEnum):
    """The first part of a tag: what a value describes."""

    ACTIVATION = "activation"  #: a watched module's output
    INPUT = "input"  #: a watched module's input
    GRADIENT = "gradient"  #: the gradient w.r.t. a watched module's output
    GRADIENT_LOG10 = "gradient_log10"  #: log10 of that gradient's magnitudes (histograms)
    PARAM_GRAD = "param_grad"  #: a watched parameter's gradient
    PARAM = "param"  #: a watched parameter (weights)
    AMP = "amp"  #: the ``GradScaler``
    HEALTH = "health"  #: findings and the pictures that go with them
    FEATURE_MAP = "feature_map"  #: a watched module's output channels as an image
    ATTENTION = "attention"  #: the attention calls made inside a module (``attention=``)
    STEP = "step"  #: every optimizer step (``spikes=``), not only logged ones
    SPIKE = "spike"  #: the steps around a spike (``spikes=``)


class Stat(enum.StrEnum):
    """The second part of a scalar's tag: which statistic."""

    MEAN = "mean"
    STD = "std"
    MIN = "min"
    MAX = "max"
    ZERO_FRAC = "zero_frac"
    NONFINITE = "nonfinite"
    DEAD_FRAC = "dead_frac"
    NORM = "norm"
    GLOBAL_NORM = "global_norm"
    UPDATE_RATIO = "update_ratio"
    LOSS_SCALE = "loss_scale"
    SKIPPED_STEP = "skipped_step"
    MAX_LOGIT = "max_logit"
    ENTROPY = "entropy"
    GRAD_NORM = "grad_norm"
    LOSS = "loss"
    SAMPLES = "samples"


@functools.lru_cache(maxsize=1 << 16)  # the same tags recur every logged step
def tag(root: str, *parts: str) -> str:
    """``root/part/...``; module and parameter names are user data, so each part is escaped
    (see :func:`escape`) and ``/`` only ever separates the parts."""
    return "/".join((str(root), *map(escape, parts)))


def by_name(scalars: Mapping[str, float], root: str, stat: str) -> dict[str, float]:
    """``{name: value}`` of the scalars tagged ``root/stat/{name}``."""
    prefix = tag(root, stat, "")
    return {unescape(t[len(prefix) :]): v for t, v in scalars.items() if t.startswith(prefix)}


def escape(name: str) -> str:
    """Percent-encode ``%``, ``/`` and unprintable characters (as UTF-8 bytes, as in URLs);
    other characters, unicode and spaces included, stay as they are.
    :func:`unescape` gives the name back.

    >>> escape("blocks.a/b 50%")
    'blocks.a%2Fb 50%25'
    """
    if name.isprintable() and "/" not in name and "%" not in name:
        return name
    return "".join(c if c.isprintable() and c not in "%/" else _percent(c) for c in name)


def _percent(char: str) -> str:
    return "".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))


def unescape(part: str) -> str:
    """The name :func:`escape` was given."""
    return unquote(part, errors="surrogatepass")
