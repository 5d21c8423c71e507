"""Where a logger computes its statistics: the fused Triton kernels (``fused.py``) or the torch
reductions (``stats/``), as the ``TBLOG_HOOKS_KERNELS`` environment variable says.

``auto`` (the default): the kernels take CUDA tensors where Triton is importable, torch the rest.
``triton``: the kernels take CUDA tensors, and CPU tensors too under ``TRITON_INTERPRET=1``
(Triton's interpreter; Triton has no CPU backend, so without it CPU tensors stay on torch); an
error at construction where Triton is not importable. ``torch``: the torch reductions only.
The variable is read once per logger, when it is made. ``fused.py`` is imported only when a
tensor is first sent to the kernels (or at construction, with ``triton``); what it gives is named
in ``outputs.py``, which imports without Triton.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..errors import HookLoggerError
from . import outputs

if TYPE_CHECKING:
    from ..stats.kinds import Computed, Kind

#: The environment variable, and its values.
VARIABLE = "TBLOG_HOOKS_KERNELS"
CHOICES = ("auto", "triton", "torch")


class Kernels:
    """One logger's choice of path, from ``TBLOG_HOOKS_KERNELS`` when it was made."""

    def __init__(self, choice: str) -> None:
        if choice not in CHOICES:
            raise HookLoggerError(
                f"{VARIABLE}={choice!r} is not a kernel path: set it to one of {', '.join(map(repr, CHOICES))} "
                "(auto, the default: the Triton kernels for CUDA tensors where Triton is importable)"
            )
        self.choice = choice
        self._fused: ModuleType | None = None
        self._off = choice == "torch" or (choice == "auto" and importlib.util.find_spec("triton") is None)
        if not self._off and choice == "auto" and torch.cuda.is_available():
            try:  # now, not in a hook that torch.compile traces
                self._fused = _import_fused()
            except ImportError as error:
                self.fail(error)
        if choice == "triton":
            try:
                self._fused = _import_fused()
            except ImportError as error:
                raise HookLoggerError(
                    f"{VARIABLE}=triton, but Triton is not importable ({error}); install it (it ships with "
                    "the CUDA builds of torch) or set auto or torch"
                ) from error

    @classmethod
    def from_environment(cls) -> Kernels:
        return cls(os.environ.get(VARIABLE, "auto"))

    def takes(self, t: Tensor) -> bool:
        """Whether ``t``'s statistics go through the kernels."""
        if self._off:
            return False
        if t.is_cuda:
            return True
        return self.choice == "triton" and t.device.type == "cpu" and self.fused.INTERPRETED

    @property
    def fused(self) -> ModuleType:
        """``fused.py``, imported on first use."""
        if self._fused is None:
            self._fused = _import_fused()
        return self._fused

    def compute(self, kinds: Sequence[Kind], t: Tensor, units: int, sample: bool = False) -> Computed:
        """Every measure's device values of ``t`` for ``kinds`` (of one tensor: its own and its
        ``numerics=`` kind), by name: where the kernels take ``t``, those of the measures they
        fuse from one kernel call, in its one buffer (``outputs.Fused``, with its extremes, for
        the histogram's range, and with ``sample`` its histogram sample), the others' by their
        own ``compute``; else every measure's ``compute`` (call under ``no_grad``)."""
        fused = {n for kind in kinds for m in kind.measures if m.fused for f in m.fields for n in f.names}
        out: Computed | None = None
        if fused and self.takes(t):
            try:
                out = self.fused.statistics(
                    t,
                    units,
                    per_unit=bool(fused & set(outputs.PER_UNIT)),
                    numerics=outputs.FORMAT_COUNTS in fused,
                    sample=sample,
                )
            except Exception as error:  # (Triton unusable here: a driver, a compiler)
                self.fail(error)
        unfused = out is not None
        for kind in kinds:
            out = kind.compute(t, units, unfused=unfused, given=out)
        assert out is not None  # (kinds: one at least)
        return out

    def samples(self, tensors: list[Tensor], sample: Callable[[Tensor], Tensor]) -> list[Tensor]:
        """The histogram samples of ``tensors`` (``sampling.sample``'s elements): those the kernels
        take (contiguous, not empty) copied by ``fused.histogram_samples``, one launch per device
        and element size; the others, or all where the kernels failed, by ``sample``."""
        taken: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            if t.numel() and t.is_contiguous() and self.takes(t):
                taken.setdefault(t.device, []).append(i)
        out: list[Tensor | None] = [None] * len(tensors)
        try:
            for at in taken.values():
                for i, copied in zip(at, self.fused.histogram_samples([tensors[i] for i in at])):
                    out[i] = copied
        except Exception as error:  # (Triton unusable here: a driver, a compiler)
            self.fail(error)
            out = [None] * len(tensors)
        return [sample(t) if s is None else s for t, s in zip(tensors, out)]

    def bucket_counts(
        self, values: Tensor, rows: Tensor, half_start: Tensor, scale: Tensor, bins: int
    ) -> Tensor | None:
        """``fused.bucket_counts`` of the step's histogram values (``binning.bin_rows``), or
        ``None`` where the kernels do not take them (or failed: torch counts them then)."""
        if not self.takes(values):
            return None
        try:
            counts: Tensor = self.fused.bucket_counts(values, rows, half_start, scale, bins)
        except Exception as error:  # (Triton unusable here: a driver, a compiler)
            self.fail(error)
            return None
        return counts

    def fail(self, error: BaseException) -> None:
        """The kernels failed (Triton unusable on this machine): said once, torch from now on."""
        if not self._off:
            self._off = True
            warnings.warn(
                f"tblog_hooks: the Triton kernels failed ({type(error).__name__}: {error}); the statistics are "
                f"computed with torch from now on (set {VARIABLE}=torch to choose that from the start)",
                RuntimeWarning,
                stacklevel=3,
            )


def _import_fused() -> ModuleType:
    from . import fused

    return fused
