"""Tensor parallelism: which tensors a logged step's hooks see are one rank's piece of a tensor
split over ranks, so that its statistics are combined with the other pieces' (``sharding.Split``).

A ``DTensor`` says so itself. A module that ``parallelize_module`` gave a style returns, by
default, a plain local tensor (``use_local_output=True``): its placements are the style's
(``_compat.parallel_output``), and ``PrepareModuleInput`` says how the input it hands a forward
is placed (``_compat.prepared_input``). Between two of those boundaries no collective runs, so
the data flowing through a module that has no style is placed as the latest boundary left it: a
module's output as the latest style that returned within or before its call (the block's last
``RowwiseParallel`` projection, the head's ``ColwiseParallel`` output of whole logits), its input
as the latest boundary before its call. Which modules are watched changes nothing: the
boundaries are followed on every logged step by hooks of their own (:meth:`TensorParallel.boundaries`).
A tensor of another shape and size than the latest boundary's data (a table of rotary angles,
a mask) is whole.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._compat import context_parallel, parallel_output, prepared_input, tree_flatten
from .sharding import Split, is_dtensor, local, placed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

#: Why module statistics are not recorded under context parallelism.
CONTEXT_PARALLEL = (
    "context parallelism is active (scaled_dot_product_attention is replaced), so every rank holds a shard of the "
    "sequence as a plain tensor and its statistics would describe that shard only; activation, input and "
    "output-gradient statistics are not recorded while it is (parameter statistics are)"
)
#: Where a tensor-parallel style's output placements are not known here.
UNKNOWN_STYLE = (
    "its tensor-parallel style is not one whose output this library knows (ColwiseParallel, RowwiseParallel, "
    "SequenceParallel, PrepareModuleOutput of one output); pass use_local_output=False so that its output is a "
    "DTensor, or leave the module out of modules="
)


class TensorParallel:
    """The tensor-parallel styles of a model's modules, and how the data of a logged step is placed."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._styles: dict[int, tuple[DeviceMesh, tuple[Placement, ...] | None]] = {}  # id(module) -> its style
        self._prepared: dict[int, tuple[DeviceMesh, Placement]] = {}  # id(module) -> its prepared input
        #: How the data the latest boundary left is placed, and its local shape; an error where
        #: that cannot be told; ``None``: whole (no boundary yet in this forward).
        self._flow: tuple[Split | None, torch.Size] | ValueError | None = None
        self._following = False

    def look_up(self) -> None:
        """Look the styles up (modules parallelized after attaching count)."""
        model = self._model()
        modules = [] if model is None else list(model.modules())
        self._styles = {id(m): style for m in modules if (style := parallel_output(m)) is not None}
        self._prepared = {id(m): prepared for m in modules if (prepared := prepared_input(m)) is not None}

    def begin(self) -> None:
        """A logged step begins: look the styles up, follow the data from the model's input on."""
        self.look_up()
        self._flow, self._following = None, True

    def end(self) -> None:
        """A logged step ended: stop following the data."""
        self._flow, self._following = None, False

    def boundaries(self, model: nn.Module) -> list[tuple[nn.Module, bool, Callable[..., None]]]:
        """The hooks that follow how the data is placed during logged steps, as ``(module,
        whether a forward pre-hook, hook)``: on ``model`` (its input is whole), on each module
        that ``PrepareModuleInput`` prepares (what its forward is handed) and on each with a style
        (what it returns); none for a model without styles. Register them before the recording
        hooks, so that a module's own boundary is followed before it is recorded."""
        self.look_up()
        if not self.styled:
            return []
        hooks: list[tuple[nn.Module, bool, Callable[..., None]]] = [(model, True, self._enter_model)]
        for module in model.modules():
            if id(module) in self._prepared:
                hooks.append((module, True, self._enter_prepared))
            if id(module) in self._styles:
                hooks.append((module, False, self._leave_styled))
        return hooks

    @property
    def styled(self) -> bool:
        """Whether a module has a tensor-parallel style (as of the latest :meth:`look_up`)."""
        return bool(self._styles or self._prepared)

    def holds_split(self) -> bool:
        """Whether the model holds tensors split over ranks: ``DTensor`` parameters (FSDP2, tensor
        parallelism) or modules with a tensor-parallel style (as of the latest :meth:`look_up`)."""
        model = self._model()
        return bool(self._styles) or (model is not None and any(is_dtensor(p) for p in model.parameters()))

    def first_of_groups(self) -> bool:
        """Whether this rank is the first of each tensor-parallel group of the styles found at the
        latest :meth:`look_up`: of the ranks of one group, which hold the same unsplit values, its
        values count once."""
        return all(mesh.get_local_rank(d) == 0 for mesh, _ in self._styles.values() for d in range(mesh.ndim))

    @staticmethod
    def sequence_split() -> bool:
        """Whether every rank holds a shard of the sequence that no tensor says it is a shard of
        (``CONTEXT_PARALLEL``)."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and context_parallel()

    def outputs(self, module: nn.Module, tensors: Sequence[Tensor]) -> list[tuple[Tensor, Split | None]]:
        """Each output tensor of ``module`` as this rank's piece and its split. Raises
        ``ValueError`` for an output no piece can tell about (``Partial``, an unknown style)."""
        style = self._styles.get(id(module))
        out = []
        for t in tensors:
            if is_dtensor(t):
                out.append(local(t))
            elif style is not None:
                mesh, placements = style
                if placements is None:
                    raise ValueError(UNKNOWN_STYLE)
                out.append((t, placed(mesh, placements, t.dim())))
            else:
                out.append((t, self._placed_as_flow(t)))
        return out

    def inputs(self, tensors: Sequence[Tensor]) -> list[tuple[Tensor, Split | None]]:
        """Each input tensor (of the module whose forward is about to run) as this rank's piece and its split."""
        return [local(t) if is_dtensor(t) else (t, self._placed_as_flow(t)) for t in tensors]

    def heads(self, module: nn.Module) -> Split | None:
        """How the attention heads of ``module`` are split over ranks: by its children whose
        style splits their outputs' last dim (``ColwiseParallel`` query, key and value
        projections), so that each rank computes attention over its own heads."""
        for child in module.children():
            style = self._styles.get(id(child))
            if style is not None and style[1] is not None:
                split = placed(style[0], style[1], 2)  # (a projection's output: ..., features)
                if split is not None and split.axis == 1:
                    return split
        return None

    def _placed_as_flow(self, t: Tensor) -> Split | None:
        """The split of a plain tensor where the latest boundary left the data: that of the
        data if ``t`` has its shape; along no known axis if only its size (a view of it, its
        heads laid out otherwise); else whole."""
        flow = self._flow
        if isinstance(flow, ValueError):
            raise flow
        if flow is None or flow[0] is None or t.numel() != flow[1].numel():
            return None
        return flow[0] if t.shape == flow[1] else dataclasses.replace(flow[0], axis=None)

    def _enter_model(self, module: nn.Module, args: object) -> None:
        if not torch.compiler.is_compiling() and self._following:
            self._flow = None

    def _enter_prepared(self, module: nn.Module, args: object) -> None:
        """After ``PrepareModuleInput`` (registered before this hook): the first input as prepared."""
        if torch.compiler.is_compiling() or not self._following:  # (compiled hooks record whole tensors)
            return
        first = next((t for t in tree_flatten(args)[0] if isinstance(t, Tensor)), None)
        if first is not None:
            mesh, placement = self._prepared[id(module)]
            self._flow = self._boundary(first, lambda t: placed(mesh, (placement,), t.dim()))

    def _leave_styled(self, module: nn.Module, args: object, output: object) -> None:
        if torch.compiler.is_compiling() or not self._following:  # (compiled hooks record whole tensors)
            return
        first = next((t for t in tree_flatten(output)[0] if isinstance(t, Tensor)), None)
        if first is not None:
            mesh, placements = self._styles[id(module)]
            self._flow = self._boundary(first, lambda t: placed(mesh, _known(placements), t.dim()))

    @staticmethod
    def _boundary(t: Tensor, split: Callable[[Tensor], Split | None]) -> tuple[Split | None, torch.Size] | ValueError:
        """How ``t`` at a boundary is placed (a ``DTensor`` says itself), with its local shape."""
        try:
            piece, of = local(t) if is_dtensor(t) else (t, split(t))
        except ValueError as error:  # (Partial, an unknown style: said by the modules that follow)
            return ValueError(f"the data it takes follows a module whose output cannot be told about: {error}")
        return of, piece.shape


def _known(placements: tuple[Placement, ...] | None) -> tuple[Placement, ...]:
    if placements is None:
        raise ValueError(UNKNOWN_STYLE)
    return placements


def along_units(split: Split | None, units: int, ndim: int) -> Split | None:
    """``split`` as recorded for a module whose units are dim ``units``: its axis kept only where
    the pieces lie along the units (their per-unit values then go side by side)."""
    if split is None or split.axis is None or split.axis == units % max(ndim, 1):
        return split
    return dataclasses.replace(split, axis=None)
