"""Forward and forward pre-hook bodies: statistics of each watched module's outputs and inputs,
feature maps, and the order in which the modules first run."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .._compat import tree_flatten, version
from ..stats.binning import Sample
from ..stats.feature_maps import feature_grid
from ..stats.kinds import Computed
from ..stats.numerics import Written
from ..stats.packing import Record
from ..stats.recipe import Source
from ..stats.reductions import loggable
from ..topology.parallel import TensorParallel, along_units
from ..topology.sharding import Pending, Split, TermsOf, terms
from .output_gradients import OutputGradientRecorder
from .passes import Counted, PassFilter
from .step import Mode, Part, StepBuffer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Why ``logits=`` measures nothing of an output split over ranks.
VOCABULARY_SPLIT = (
    "split over tensor-parallel ranks (a vocabulary-parallel output layer): each rank holds part of every "
    "token's logits, whose log-partition no piece tells"
)


class ActivationRecorder:
    """Records what watched modules return (``activation/*``) and take (``input/*``)."""

    def __init__(
        self,
        buffer: StepBuffer,
        gradients: OutputGradientRecorder | None,
        *,
        activations: bool,
        inputs: bool,
        eval_passes: bool,
        feature_maps: frozenset[str],
        parallel: TensorParallel,
        numerics: Written | None = None,
        logits: frozenset[str] = frozenset(),
        merged: bool = False,
    ) -> None:
        """``numerics``: with ``numerics=``, the formats written, told each logged forward's autocast
        state; ``logits``: the modules whose output logits' log-partition is recorded; ``merged``:
        the ranks' steps are combined (``PassFilter``)."""
        self.buffer, self.gradients, self.parallel = buffer, gradients, parallel
        self.numerics = numerics
        recipe = buffer.recipe
        self._output, self._image = recipe[Source.OUTPUT], recipe[Source.IMAGE]
        self._input = recipe[Source.INPUT if inputs else Source.NONFINITE_INPUT]
        # With a float8 format named: each Linear's input and weight, as fp8 training casts them.
        fp8 = numerics is not None and numerics.fp8
        self._casts = (recipe.numerics[Source.FP8_INPUT], recipe.numerics[Source.FP8_WEIGHT]) if fp8 else None
        self.activations, self.inputs, self.feature_maps = activations, inputs, feature_maps
        self.logits, self._log_partition = logits, recipe[Source.LOGITS]
        self.passes = PassFilter(eval_passes=eval_passes, merged=merged)
        #: Per watched module, the dim of its outputs that holds its units (``reductions.units_dim``).
        self.units: dict[str, int] = {}
        self.forward_order: list[str] = []  # watched modules in the order their forward hooks first fired
        self._fired: set[str] = set()
        #: Watched modules whose forward hook ran in this logged step (eager calls; cleared as it begins).
        self.called: set[str] = set()
        self._mapped: set[str] = set()  # feature maps taken this step
        # The latest activation recorded: (weakref to it, its version, its finite count).
        self._last_output: tuple[weakref.ref[Tensor], int, Computed] | None = None
        # Whether this step's forward calls included one in training mode, or in eval mode with
        # gradients enabled (a model left in eval mode while it trains).
        self._trained = self._evaluated = False
        self._pending: list[Pending] = []  # this step's outputs that are terms of a sum over ranks, one per call

    def on_output(self, name: str, module: nn.Module, args: object, output: object) -> object | None:
        """Forward hook body: statistics of the output now, its gradient watched for later (of
        training passes only, see ``passes.py``). Returns a replacement output when the gradient
        is watched through a probe (under ``torch.compile``), else ``None``. Of an output split
        over tensor-parallel ranks, this rank's piece, combined with the others' at the end of
        the step (``topology/parallel.py``)."""
        training = module.training
        mode = self.buffer.now()
        if mode is None or not mode.compiled:
            # Not while compiling: a set that grows would be one more guard and one more graph.
            self.called.add(name)
        if name in self.buffer.disabled_names or mode is None:
            return None
        if not mode.compiled:
            if name not in self._fired:
                self._fired.add(name)
                self.forward_order.append(name)
            self._trained |= training
            self._evaluated |= not training and torch.is_grad_enabled()
        try:
            counted = self.passes.classify(name, training, mode.in_backward())
            if not any(counted):
                return None
            units = self.units.get(name, -1)
            tensors = loggable_leaves(output)
            if not tensors:
                return None
            summed_over = self.parallel.output_terms(module)
            if summed_over is not None:
                return self._terms(mode, name, output, tensors, summed_over, counted)
            pieces = self._pieces(module, tensors, units)
            if self.numerics is not None and not mode.compiled:  # (outputs recorded or not)
                self.numerics.see(pieces[0][0].device.type)
            with torch.no_grad():
                if name in self.feature_maps and name not in self._mapped:
                    self._add_feature_map(mode, name, [t for t, _ in pieces])
                if self.activations and counted.activations:
                    for t, split in pieces:
                        self._remember(mode, t, mode.record(self._output, name, t, units, split))
                    if self._casts is not None and isinstance(module, nn.Linear):
                        self._fp8_casts(mode, name, module, args)
                if name in self.logits and counted.activations:
                    self._logits(mode, name, pieces)
            if counted.gradients and self.gradients is not None:
                splits = [split for _, split in pieces]
                return self.gradients.watch(mode, name, output, tensors, splits, self.parallel.gradient_terms(module))
        except Exception as error:  # the logger must never stop training
            self.buffer.fail(name, error)
        return None

    def _terms(
        self, mode: Mode, name: str, output: object, tensors: list[Tensor], mesh: DeviceMesh, counted: Counted
    ) -> object | None:
        """Outputs that are this rank's terms of a sum over ``mesh`` (torchtitan's inner routed
        experts, ``TensorParallel.output_terms``): copied, and recorded once reduced over the
        ranks at the end of the step (:meth:`resolve`). Their gradient is the whole sum's, on
        every rank."""
        if self.activations and counted.activations:
            self._pending += [terms(name, t, mesh, TermsOf.OUTPUT) for t in tensors]
        if counted.gradients and self.gradients is not None:
            return self.gradients.watch(mode, name, output, tensors, [None] * len(tensors))
        return None

    def take_terms(self) -> list[Pending]:
        """This step's outputs still to be reduced over ranks (:meth:`_terms`); none held after."""
        waiting, self._pending = self._pending, []
        return waiting

    def resolve(self, waiting: list[Pending], reduced: list[Tensor]) -> tuple[list[Record], list[Sample]]:
        """Records and histogram samples of outputs that were terms of a sum, from those terms
        ``reduced`` over ranks (``Ranks.finish``)."""
        with torch.no_grad():
            for p, t in zip(waiting, reduced):
                self.buffer.eager.record(self._output, p.key, t, self.units.get(p.key, -1))
        return self.buffer.drain()

    def _fp8_casts(self, mode: Mode, name: str, module: nn.Linear, args: object) -> None:
        """What fp8 training casts of a Linear at this call: its input and its weight (whole
        tensors; not of a tensor-parallel piece or a sharded weight)."""
        assert self._casts is not None
        x = args[0] if isinstance(args, tuple) and args else None
        (inputs, weights) = self._casts
        for kind, key, t in ((inputs, name, x), (weights, f"{name}.weight", module.weight)):
            if type(t) in (Tensor, nn.Parameter) and loggable(t):
                mode.measure(kind, key, t.detach())  # type: ignore[union-attr]

    def _logits(self, mode: Mode, name: str, pieces: list[tuple[Tensor, Split | None]]) -> None:
        """The log-partition of the output logits: the first output of at least one dim (a
        model's output holding the loss first gives its logits); not of a piece split over
        tensor-parallel ranks (its vocabulary is one rank's: said once, and not measured)."""
        t, split = next(((t, split) for t, split in pieces if t.dim() >= 1), (None, None))
        if t is None or Part.LOGITS in self.buffer.disabled_parts:
            return
        if split is not None:
            self.buffer.fail(Part.LOGITS, RuntimeError(f"{name!r}'s output is {VOCABULARY_SPLIT}"))
        else:
            mode.measure(self._log_partition, name, t)

    def on_input(self, name: str, module: nn.Module, inputs: object) -> None:
        """Forward pre-hook body: the inputs' non-finite count (to tell where NaN/Inf start),
        or with ``inputs=True`` the same statistics as for outputs."""
        if name in self.buffer.disabled_names or not (self.activations or self.inputs):
            return  # without output counts the input count tells nothing
        training = module.training
        mode = self.buffer.now()
        if mode is None or not self.passes.records_inputs(name, training, mode.in_backward()):
            return
        try:
            units = self.units.get(name, -1)
            leaves = loggable_leaves(inputs)
            pieces = self.parallel.inputs(module, leaves)
            with torch.no_grad():
                for t, split in pieces:
                    if self.inputs:
                        mode.record(self._input, name, t, units, along_units(split, units, t.dim()))
                    else:
                        finite = self._finite_input(mode, t)
                        mode.add(Record.of(self._input, name, t.numel(), finite, split=split))
        except Exception as error:
            self.buffer.fail(name, error)

    @property
    def only_evaluated(self) -> bool:
        """Whether every forward call of this logged step so far ran in eval mode with gradients
        enabled (and none was recorded for it, without ``eval_passes=True``)."""
        return self._evaluated and not self._trained and not self.passes.eval_passes

    def mark(self) -> tuple[frozenset[str], int]:
        """The feature maps taken so far this step, and how many outputs are held as terms, for :meth:`rewind`."""
        return frozenset(self._mapped), len(self._pending)

    def rewind(self, mark: tuple[frozenset[str], int]) -> None:
        """The records made after ``mark`` were dropped: the feature maps they held are to be
        taken again, the terms held since dropped too."""
        self._mapped = set(mark[0])
        del self._pending[mark[1] :]

    def end_step(self) -> None:
        """A logged step ended: forget its passes, its feature maps and the last output."""
        self.passes.reset()
        self._mapped, self._last_output = set(), None
        self._trained = self._evaluated = False
        self.parallel.end()

    def _pieces(self, module: nn.Module, tensors: list[Tensor], units: int) -> list[tuple[Tensor, Split | None]]:
        """The outputs as this rank's pieces, each with how it is split over ranks (``None``: whole)."""
        return [(t, along_units(split, units, t.dim())) for t, split in self.parallel.outputs(module, tensors)]

    def _remember(self, mode: Mode, t: Tensor, values: Computed) -> None:
        """Keep the values (the finite count) of an output for the next module's pre-hook, should its input
        be this very tensor (conv -> bn in a ResNet), saving a pass over it. Not while compiling
        (no weak reference or version there), nor of inference tensors (they have neither)."""
        if not mode.compiled and not t.is_inference():
            self._last_output = (weakref.ref(t), version(t), values)

    def _finite_input(self, mode: Mode, t: Tensor) -> Computed:
        """Values of an input holding its finite count: the output's remembered if the input is
        the unchanged output of the watched module that ran just before (where the kernels gave
        them, their buffer: the input's record shares it)."""
        last = None if mode.compiled else self._last_output  # is_inference() breaks a graph
        if last is not None and last[0]() is t and not t.is_inference() and version(t) == last[1]:
            return last[2]
        return self.buffer.kernels.compute((self._input,), t, -1)

    def _add_feature_map(self, mode: Mode, name: str, tensors: list[Tensor]) -> None:
        """Channels of the first sample of the first 3-D-or-more output, first call only."""
        maps = [t for t in tensors if t.dim() >= 3]
        if maps:
            self._mapped.add(name)
            grid = feature_grid(maps[0][0])
            mode.add(Record(self._image, name, grid.numel(), (grid,), tuple(grid.shape)))


def loggable_leaves(tree: object) -> list[Tensor]:
    """The tensors of a (nested) input or output that statistics are taken of."""
    if isinstance(tree, Tensor):
        leaves = [tree]
    elif _flat_inputs(tree):  # the usual forward pre-hook input, without pytree's walk
        leaves = list(tree[0])  # type: ignore[index]  # (_flat_inputs: a pair holding a tuple)
    else:
        leaves = tree_flatten(tree)[0]
    return [t for t in leaves if loggable(t)]


def _flat_inputs(tree: object) -> bool:
    """Whether ``tree`` is a pre-hook's ``(args, kwargs)`` with no keyword arguments and only
    tensors among the arguments."""
    return (
        type(tree) is tuple
        and len(tree) == 2
        and type(tree[0]) is tuple
        and not tree[1]
        and all(isinstance(a, Tensor) for a in tree[0])
    )
