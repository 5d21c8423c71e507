"""What both framework callbacks share: option checks, the missing-framework error, step counting."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch

from ..errors import HookLoggerError
from ..logger import HookLogger
from ..options import NAMES, WatchOptions, check_names

#: The options a framework callback takes: those of HookLogger but what the framework supplies.
TAKEN = tuple(f.name for f in fields(WatchOptions))
#: HookLogger options a framework callback takes from the framework itself.
FROM_FRAMEWORK = tuple(name for name in NAMES if name not in TAKEN)


def missing_framework(extra: str, error: ImportError) -> HookLoggerError:
    """The error for a callback whose framework cannot be imported: which extra installs it."""
    return HookLoggerError(
        f"tblog_hooks.integrations.{extra} needs the {extra!r} package, which cannot be imported ({error}); "
        f"install it with: pip install 'tblog-hooks[{extra}]'"
    )


def check_options(options: Mapping[str, Any], framework: str) -> None:
    """Reject options the framework supplies, names that are no ``HookLogger`` option and bad
    values (at construction, not when training starts)."""
    supplied = [key for key in options if key in FROM_FRAMEWORK]
    if supplied:
        raise HookLoggerError(
            f"{framework} supplies {', '.join(map(repr, supplied))} to the HookLogger (the writer of its TensorBoard "
            f"run, its optimizer, AMP scaler and step count); leave {'it' if len(supplied) == 1 else 'them'} out"
        )
    check_names(options, TAKEN, owner="HookLoggerCallback")
    WatchOptions(**options)


def grad_scaler(owner: object) -> torch.amp.GradScaler | None:
    """``owner.scaler`` (a precision plugin's, an accelerate optimizer's) when it is a ``GradScaler``."""
    scaler = getattr(owner, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def advance(hooks: HookLogger, step: int, loss: object = None) -> None:
    """Call ``hooks.step()`` until its step index is ``step`` (the framework's count of optimizer
    steps); the last call gets ``loss``, the loss of the step that ended (for ``spikes=``)."""
    while hooks.global_step < step:
        hooks.step(loss if hooks.global_step + 1 == step else None)  # type: ignore[arg-type]  # (checked there)
