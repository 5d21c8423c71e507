"""The one exception type the library raises for bad input."""

from __future__ import annotations


class HookLoggerError(ValueError):
    """Raised at construction (or on misuse) with what was wrong and what is valid."""
