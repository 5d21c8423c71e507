"""tblog_hooks: activation, gradient and parameter statistics of a PyTorch model in TensorBoard,
computed on the device and written every N optimizer steps.

The public names are imported when first used (PEP 562), so that what only reads runs back
(``tblog-hooks report``, the TensorBoard plugin) never imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .capture.selection import Selector
    from .diagnostics.findings import Finding, Thresholds
    from .diagnostics.spikes import Spikes
    from .errors import HookLoggerError
    from .logger import HookLogger
    from .stats.schedule import Histograms

__version__ = "0.1.0"
__all__ = ["Finding", "Histograms", "HookLogger", "HookLoggerError", "Selector", "Spikes", "Thresholds", "__version__"]

#: Where each public name lives.
_HOMES = {
    "Finding": ".diagnostics.findings",
    "Histograms": ".stats.schedule",
    "HookLogger": ".logger",
    "HookLoggerError": ".errors",
    "Selector": ".capture.selection",
    "Spikes": ".diagnostics.spikes",
    "Thresholds": ".diagnostics.findings",
}


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 'tblog_hooks' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
