"""tblog_hooks: activation, gradient and parameter statistics of a PyTorch model in TensorBoard,
computed on the device and written every N optimizer steps."""

from __future__ import annotations

from .capture.selection import Selector
from .diagnostics.health import Finding, Thresholds
from .diagnostics.spikes import Spikes
from .errors import HookLoggerError
from .logger import HookLogger
from .stats.schedule import Histograms

__version__ = "0.1.0"
__all__ = ["Finding", "Histograms", "HookLogger", "HookLoggerError", "Selector", "Spikes", "Thresholds", "__version__"]
