"""What both framework callbacks share: option checks, the missing-framework error, step counting."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import HookLoggerError
from ..logger import HookLogger
from ..options import NAMES, unknown_options

#: HookLogger options a framework callback takes from the framework itself.
FROM_FRAMEWORK = ("writer", "log_dir", "optimizer", "scaler", "start_step")


def missing_framework(extra: str, error: ImportError) -> HookLoggerError:
    """The error for a callback whose framework cannot be imported: which extra installs it."""
    return HookLoggerError(
        f"tblog_hooks.integrations.{extra} needs the {extra!r} package, which cannot be imported ({error}); "
        f"install it with: pip install 'tblog-hooks[{extra}]'"
    )


def check_options(options: Mapping[str, object], framework: str) -> None:
    """Reject options the framework supplies and names that are no ``HookLogger`` option."""
    supplied = [key for key in options if key in FROM_FRAMEWORK]
    if supplied:
        raise HookLoggerError(
            f"{framework} supplies {', '.join(map(repr, supplied))} to the HookLogger (the writer of its TensorBoard "
            f"run, its optimizer, AMP scaler and step count); leave {'it' if len(supplied) == 1 else 'them'} out"
        )
    unknown = [key for key in options if key not in NAMES]
    if unknown:
        raise HookLoggerError(unknown_options(unknown))


def grad_scaler(owner: object) -> torch.amp.GradScaler | None:
    """``owner.scaler`` (a precision plugin's, an accelerate optimizer's) when it is a ``GradScaler``."""
    scaler = getattr(owner, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def advance(hooks: HookLogger, step: int, loss: object = None) -> None:
    """Call ``hooks.step()`` until its step index is ``step`` (the framework's count of optimizer
    steps); the last call gets ``loss``, the loss of the step that ended (for ``spikes=``)."""
    while hooks.global_step < step:
        hooks.step(loss if hooks.global_step + 1 == step else None)  # type: ignore[arg-type]  # (checked there)
