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
  gradient but not its activations again;
- under a ``torch.distributed.pipelining`` schedule, a stage's shape inference (a forward of
  its first microbatch on later stages' made-up inputs, before its first step) is no pass at
  all: skipped.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import NamedTuple

import torch

from .._compat import pipeline_pass

#: Said once by a logger whose model runs as a stage of a pipeline schedule, without reduce_ranks=True.
PIPELINED = (
    "tblog_hooks: the model runs as a stage of a torch.distributed.pipelining schedule, so this logger sees its "
    "stage's modules only: what it writes is theirs, as one process with the whole batch has them (the microbatches "
    "pooled, the stage's shape inference left out), but param_grad/global_norm and step/grad_norm are of this "
    "stage's parameters alone; the other stages' modules are written by their ranks' loggers given a writer= of "
    "their own (rank 0 writes by default), or all by rank 0's with reduce_ranks=True"
)
#: Said instead with reduce_ranks=True, where the writing rank combines the stages' steps
#: (``transport.stages.merged``); the per-step series of ``spikes=`` are not combined.
PIPELINED_MERGED = (
    "tblog_hooks: the model runs as a stage of a torch.distributed.pipelining schedule; with reduce_ranks=True the "
    "writing rank writes every stage's modules as one process with the whole model and batch has them (the "
    "microbatches pooled, the stages' shape inference left out, param_grad/global_norm over every stage's "
    "parameters), where the stages' ranks watch modules of different names; step/grad_norm (spikes=) is of this "
    "stage's parameters alone"
)


class Counted(NamedTuple):
    """What to record for one forward call."""

    activations: bool
    gradients: bool


_SKIP = Counted(False, False)
_TRAINING = Counted(True, True)


class PassFilter:
    """Classifies forward calls of one logged step; :meth:`reset` at the end of the step."""

    def __init__(self, *, eval_passes: bool, merged: bool = False) -> None:
        """``merged``: the ranks' steps are combined (``reduce_ranks=True`` over several ranks), a
        pipeline stage's with the writing rank's (which the warning a schedule gets says)."""
        self.eval_passes = eval_passes
        self._said = PIPELINED_MERGED if merged else PIPELINED
        self._unmatched: Counter[str] = Counter()  # training-mode no_grad calls, per module
        #: What the pipeline schedule the latest training pass ran under divides the stage's
        #: gradients by (its microbatch count; 1 without one): the output gradients, of each
        #: microbatch's loss, are divided by it too, as one process's of the whole batch's mean.
        self.microbatches = 1
        #: The indices of the pipeline stages this rank runs, once a schedule was seen (said
        #: once); empty: none seen.
        self.stages: tuple[int, ...] = ()

    def classify(self, name: str, training: bool, in_backward: bool) -> Counted:
        """What to record of a call of module ``name`` (``in_backward``: it runs inside backward)."""
        if in_backward:
            if self._unmatched[name] == 0 or not torch.is_grad_enabled():
                return _SKIP
            self._unmatched[name] -= 1
            return Counted(not self.eval_passes, True)
        if training and torch.is_grad_enabled():
            return _SKIP if self._inferring() else _TRAINING
        if training:
            self._unmatched[name] += 1
        return Counted(self.eval_passes, False)

    def records_inputs(self, name: str, training: bool, in_backward: bool) -> bool:
        """Whether a call's inputs are recorded (forward pre-hooks, before :meth:`classify`
        sees the call): exactly when its activations will be."""
        if in_backward:
            return self._unmatched[name] > 0 and not self.eval_passes and torch.is_grad_enabled()
        return self.eval_passes or (training and torch.is_grad_enabled() and not self._inferring())

    def _inferring(self) -> bool:
        """Whether a training call runs in a pipeline stage's shape inference (and the schedule's
        gradient divisor noted, :attr:`microbatches`)."""
        found = pipeline_pass()
        if found is None:
            return False
        self.microbatches = found.microbatches
        if not self.stages:
            warnings.warn(self._said, RuntimeWarning, stacklevel=4)
        self.stages = found.stages
        return found.inference

    def reset(self) -> None:
        self._unmatched.clear()
