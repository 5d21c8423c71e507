"""Which forward calls of a logged step count: training passes, once each.

A forward hook also fires for evaluation passes (``model.eval()`` or ``torch.no_grad()``)
and again when activation checkpointing recomputes a region inside backward. The rule,
per call of a watched module:

- a call in training mode with gradients enabled, outside backward, is a training pass:
  its activations are recorded and its output gradient is watched;
- a call inside backward with gradients enabled is a checkpoint recompute. It stands in for
  an earlier call of the same module that ran in training mode without gradients
  (``use_reentrant=True`` runs the first pass under ``no_grad``), so it is counted if such a
  call is still unmatched, and skipped otherwise (``use_reentrant=False`` already counted the
  first pass);
- a call inside backward without gradients is the first pass of a reentrant checkpoint
  nested in a region being recomputed: a repeat of a first pass already seen, skipped (its
  own recompute with gradients follows and is the one matched);
- any other call (eval mode, or ``no_grad`` that no recompute matches) is an evaluation
  pass, recorded only with ``eval_passes=True`` — then a matching recompute adds its output
  gradient but not its activations again.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import torch


class Counted(NamedTuple):
    """What to record for one forward call."""

    activations: bool
    gradients: bool


_SKIP = Counted(False, False)
_TRAINING = Counted(True, True)


class PassFilter:
    """Classifies forward calls of one logged step; :meth:`reset` at the end of the step."""

    def __init__(self, *, eval_passes: bool) -> None:
        self.eval_passes = eval_passes
        self._unmatched: Counter[str] = Counter()  # training-mode no_grad calls, per module

    def classify(self, name: str, training: bool, in_backward: bool) -> Counted:
        """What to record of a call of module ``name`` (``in_backward``: it runs inside backward)."""
        if in_backward:
            if self._unmatched[name] == 0 or not torch.is_grad_enabled():
                return _SKIP
            self._unmatched[name] -= 1
            return Counted(not self.eval_passes, True)
        if training and torch.is_grad_enabled():
            return _TRAINING
        if training:
            self._unmatched[name] += 1
        return Counted(self.eval_passes, False)

    def records_inputs(self, name: str, training: bool, in_backward: bool) -> bool:
        """Whether a call's inputs are recorded (forward pre-hooks, before :meth:`classify`
        sees the call): exactly when its activations will be."""
        if in_backward:
            return self._unmatched[name] > 0 and not self.eval_passes and torch.is_grad_enabled()
        return self.eval_passes or (training and torch.is_grad_enabled())

    def reset(self) -> None:
        self._unmatched.clear()
