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
from torch import Tensor, nn

from .._compat import parallel_output, prepared_input, tree_flatten
from . import titan
from .sharding import Split, is_dtensor, local, placed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

#: Where a watched module of a tensor-parallel model runs in code ``torch.compile`` compiled.
COMPILED = (
    "a logged step ran it in code torch.compile compiled, in a tensor-parallel model: its hooks traced there see "
    "this rank's pieces as plain tensors that say nothing of how they are split over the ranks, so their statistics "
    "would be one rank's piece taken for the whole; its activation, input and output-gradient statistics are left "
    "out (parameter statistics are logged). Run the logged steps' forward eagerly, the other steps compiled: "
    "with torch.compiler.set_stance('force_eager' if hooks.recording else 'default') around it (torch 2.6 and "
    "later; docs: sharded.md#compiled-tensor-parallelism)"
)
#: Where a tensor-parallel style's output placements are not known here.
UNKNOWN_STYLE = (
    "its tensor-parallel style is not one whose output this library knows (ColwiseParallel, RowwiseParallel, "
    "SequenceParallel, PrepareModuleOutput of one output); pass use_local_output=False so that its output is a "
    "DTensor, or leave the module out of modules="
)

#: Where a plain tensor past a torchtitan layout has another size than the data that layout placed.
UNKNOWN_PIECE = (
    "it takes or returns a tensor of another size than the data the latest torchtitan sharding layout placed (the "
    "fused query, key and value split apart, its rotary embedding), and how that tensor is placed over the "
    "tensor-parallel ranks is said nowhere, so its statistics would be this rank's piece only; leave the module out "
    "of modules="
)


#: How many of the latest boundaries' data a plain tensor past a torchtitan layout is matched against.
_KEPT = 4


class TensorParallel:
    """The tensor-parallel styles of a model's modules, and how the data of a logged step is placed."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._styles: dict[int, tuple[DeviceMesh, tuple[Placement, ...] | None]] = {}  # id(module) -> its style
        self._prepared: dict[int, tuple[DeviceMesh, Placement]] = {}  # id(module) -> its prepared input
        self._titan: dict[int, titan.Layouts] = {}  # id(module) -> its torchtitan sharding layouts
        self._partial: dict[int, titan.Region] = {}  # id(module) -> the local-tensor region of partial sums it runs in
        self._summed_over: DeviceMesh | None = None  # the mesh the terms in those regions are summed over
        self._heads: dict[int, Split] = {}  # id(module) -> how the heads of the attention it calls are split
        #: How the data the latest boundaries left is placed, and its local shape (the latest
        #: first); an error where that cannot be told; ``None``: whole (no boundary yet in this forward).
        self._flow: list[tuple[Split | None, torch.Size]] | ValueError | None = None
        self._strict = False  # whether a tensor of no such size is unknown (past a torchtitan layout), not whole
        self._following = False
        #: Whether the model is tensor-parallel (:attr:`tensor_parallel`), as of the logged step's
        #: beginning: read by hooks traced by ``torch.compile`` (one attribute, one guard).
        self.split_data = False

    def look_up(self) -> None:
        """Look the styles up (modules parallelized after attaching count)."""
        model = self._model()
        modules = [] if model is None else list(model.modules())
        self._styles = {id(m): style for m in modules if (style := parallel_output(m)) is not None}
        self._prepared = {id(m): prepared for m in modules if (prepared := prepared_input(m)) is not None}
        self._partial = {} if model is None else titan.partial_regions(model)
        parallelized = self._summed_over = None if model is None else titan.parallelized_mesh(model)
        self._heads = {}
        for m in modules if parallelized is not None else []:
            if (heads := titan.local_heads(m, parallelized)) is not None:  # type: ignore[arg-type]
                self._heads[id(m)] = heads
        mesh = None if model is None else titan.tensor_parallel_mesh(model)
        self._titan = {}
        for m in modules if mesh is not None else []:
            layouts = titan.layouts(m)
            if layouts is None:
                continue
            self._titan[id(m)] = layouts
            if layouts.declared:
                self._styles[id(m)] = (mesh, None if layouts.output is None else (layouts.output,))  # type: ignore[assignment]
            if layouts.handed is not None:
                self._prepared[id(m)] = (mesh, layouts.handed)  # type: ignore[assignment]

    def begin(self) -> None:
        """A logged step begins: look the styles up, follow the data from the model's input on."""
        self.look_up()
        self._flow, self._strict, self._following = None, False, True
        self.split_data = self.tensor_parallel

    def end(self) -> None:
        """A logged step ended: stop following the data."""
        self._flow, self._strict, self._following = None, False, False

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

    @property
    def tensor_parallel(self) -> bool:
        """Whether the model is tensor-parallel: modules with a tensor-parallel style (as of the
        latest :meth:`look_up`), or torchtitan's tensor parallelism under any of its backends
        (``partial_dtensor`` and ``full_dtensor`` leave no style: their outputs are ``DTensor`` s)."""
        model = self._model()
        return self.styled or (model is not None and titan.parallelized_mesh(model) is not None)

    def holds_split(self) -> bool:
        """Whether the model holds tensors split over ranks: ``DTensor`` parameters (FSDP2, tensor
        parallelism) or modules with a tensor-parallel style (as of the latest :meth:`look_up`)."""
        model = self._model()
        return bool(self._styles) or (model is not None and any(is_dtensor(p) for p in model.parameters()))

    def first_of_group(self) -> int | None:
        """The global rank of the first of this rank's tensor-parallel group (of the styles found
        at the latest :meth:`look_up`, or torchtitan's tensor-parallel mesh under any backend:
        under ``partial_dtensor`` no module has a style); ``None`` without one. The ranks of one
        group hold the same unsplit values: counted once, the first's."""
        model = self._model()
        meshes = [mesh for mesh, _ in self._styles.values()]
        titans = None if model is None else titan.parallelized_mesh(model)
        meshes += [] if titans is None else [titans]
        return min((int(mesh.mesh.reshape(-1)[0]) for mesh in meshes), default=None)

    def outputs(self, module: nn.Module, tensors: Sequence[Tensor]) -> list[tuple[Tensor, Split | None]]:
        """Each output tensor of ``module`` as this rank's piece and its split. Raises
        ``ValueError`` for an output no piece can tell about (``Partial``, an unknown style,
        compiled code of a tensor-parallel model)."""
        if torch.compiler.is_compiling():
            return self._compiled(tensors)
        self._check_region(module)
        style = self._styles.get(id(module))
        out = []
        for t in tensors:
            if is_dtensor(t):
                out.append(local(t))
            elif style is not None:
                mesh, placements = style
                if placements is None:
                    raise ValueError(titan.UNKNOWN_LAYOUT if id(module) in self._titan else UNKNOWN_STYLE)
                out.append((t, placed(mesh, placements, t.dim())))
            else:
                out.append((t, self._placed_as_flow(t)))
        return out

    def output_terms(self, module: nn.Module) -> DeviceMesh | None:
        """The mesh over which the outputs of ``module`` are this rank's terms of a sum, from inputs
        every rank holds whole (torchtitan's inner routed experts, ``titan.Region.summed``); ``None``
        for any other module, and in compiled code, which :meth:`outputs` refuses."""
        region = self._partial.get(id(module))
        summed = region is not None and region.summed and not torch.compiler.is_compiling()
        return self._summed_over if summed else None

    def gradient_terms(self, module: nn.Module) -> DeviceMesh | None:
        """The mesh over which ``module``'s output gradient will be a partial sum that no hook
        sees as such (a plain tensor ``Replicate`` under ``spmd_types``: each rank holds a term);
        ``None`` where it will not."""
        layouts = self._titan.get(id(module))
        return self._styles[id(module)][0] if layouts is not None and layouts.partial_gradient else None

    def inputs(self, module: nn.Module, tensors: Sequence[Tensor]) -> list[tuple[Tensor, Split | None]]:
        """Each input tensor of ``module`` (whose forward is about to run) as this rank's piece
        and its split. Raises ``ValueError`` as :meth:`outputs` for a module that returns terms
        of a sum over ranks (its statistics are left out whole: its inputs too)."""
        if torch.compiler.is_compiling():
            return self._compiled(tensors)
        if self.output_terms(module) is not None:  # (its inputs are the region's, handed whole)
            return [(t, None) for t in tensors]
        self._check_region(module)
        return [local(t) if is_dtensor(t) else (t, self._placed_as_flow(t)) for t in tensors]

    def _compiled(self, tensors: Sequence[Tensor]) -> list[tuple[Tensor, Split | None]]:
        """Tensors a hook traced by ``torch.compile`` sees: whole, but in a tensor-parallel model,
        where no boundary is followed in compiled code and a piece looks whole, ``ValueError``."""
        if self.split_data:
            raise ValueError(COMPILED)
        return [(t, None) for t in tensors]

    def _check_region(self, module: nn.Module) -> None:
        """Raises ``ValueError`` for a module inside a torchtitan local-tensor region whose
        result is ``Partial`` (``titan.PARTIAL_REGION``; its terms of that sum are
        :meth:`output_terms`, whose callers take them apart)."""
        region = self._partial.get(id(module))
        if region is not None:
            raise ValueError(titan.PARTIAL_REGION.format(region=region.name))

    def heads(self, module: nn.Module) -> Split | None:
        """How the attention heads of ``module`` are split over ranks: by its children whose
        style splits their outputs' last dim (``ColwiseParallel`` query, key and value
        projections), or where it is a torchtitan local-tensor region (its inner attention),
        by the layout its query is handed; so that each rank computes attention over its own heads."""
        if id(module) in self._heads:
            return self._heads[id(module)]
        for child in module.children():
            style = self._styles.get(id(child))
            if style is not None and style[1] is not None:
                split = placed(style[0], style[1], 2)  # (a projection's output: ..., features)
                if split is not None and split.axis == 1:
                    return split
        return None

    def _placed_as_flow(self, t: Tensor) -> Split | None:
        """The split of a plain tensor where the latest boundary left the data: that of the
        data if ``t`` has its shape, or is a view of it that keeps the dims before the split
        axis and folds or unfolds the dims from it on (heads flattened into features); along
        no known axis if only its size (its heads laid out otherwise); else whole, but past a
        torchtitan layout, where a tensor of another size (its fused query, key and value split
        apart) is unknown: ``ValueError``."""
        flow = self._flow
        if isinstance(flow, ValueError):
            raise flow
        if not flow or (flow[0][0] is None and not self._strict):
            return None
        for split, shape in flow if self._strict else flow[:1]:
            if t.numel() == shape.numel():
                if split is None:
                    return None
                if _same_axis(t.shape, shape, split.axis):
                    return split
                return dataclasses.replace(split, axis=None, axes=())
        if self._strict:
            raise ValueError(UNKNOWN_PIECE)
        return None

    def _enter_model(self, module: nn.Module, args: object) -> None:
        if not torch.compiler.is_compiling() and self._following:
            self._flow, self._strict = None, False

    def _enter_prepared(self, module: nn.Module, args: object) -> None:
        """After ``PrepareModuleInput`` (registered before this hook): the first input as prepared.
        A torchtitan module redistributes its input inside its forward: the data as handed
        (of the shape redistributing gives), and as given, for the module's own input."""
        if torch.compiler.is_compiling() or not self._following:  # (compiled hooks record whole tensors)
            return
        first = next((t for t in tree_flatten(args)[0] if isinstance(t, Tensor)), None)
        if first is None:
            return
        mesh, placement = self._prepared[id(module)]
        layouts = self._titan.get(id(module))
        if layouts is None or is_dtensor(first):
            self._follow(self._boundary(first, lambda t: placed(mesh, (placement,), t.dim())), module)
            return
        shape = titan.handed_shape(first.shape, layouts.given, placement, mesh.size())
        handed = self._boundary(first, lambda t: placed(mesh, (placement,), len(shape)))
        self._follow(handed if isinstance(handed, ValueError) else (handed[0], shape), module)

    def _leave_styled(self, module: nn.Module, args: object, output: object) -> None:
        if torch.compiler.is_compiling() or not self._following:  # (compiled hooks record whole tensors)
            return
        first = next((t for t in tree_flatten(output)[0] if isinstance(t, Tensor)), None)
        if first is not None:
            mesh, placements = self._styles[id(module)]
            self._follow(self._boundary(first, lambda t: placed(mesh, _known(placements), t.dim())), module)

    def _follow(self, boundary: tuple[Split | None, torch.Size] | ValueError, module: nn.Module) -> None:
        """The data is placed as ``boundary`` left it from here on. Past torchtitan layouts,
        a tensor of another size may still be data an earlier boundary placed (the input of a
        feed-forward's second projection, beside its first's output): the latest few are kept."""
        previous = self._flow if isinstance(self._flow, list) else []
        self._flow = boundary if isinstance(boundary, ValueError) else [boundary, *previous][:_KEPT]
        self._strict = self._strict or id(module) in self._titan

    @staticmethod
    def _boundary(t: Tensor, split: Callable[[Tensor], Split | None]) -> tuple[Split | None, torch.Size] | ValueError:
        """How ``t`` at a boundary is placed (a ``DTensor`` says itself), with its local shape."""
        try:
            piece, of = local(t) if is_dtensor(t) else (t, split(t))
        except ValueError as error:  # (Partial, an unknown style: said by the modules that follow)
            return ValueError(f"the data it takes follows a module whose output cannot be told about: {error}")
        return of, piece.shape


def _same_axis(shape: torch.Size, flow: torch.Size, axis: int | None) -> bool:
    """Whether a tensor of ``shape``, a view of data of shape ``flow`` split along ``axis``, is
    split along that axis too: the dims before it alike, those from it on folded or unfolded."""
    if shape == flow:
        return True
    if axis is None or len(shape) <= axis or len(flow) <= axis:
        return False
    return shape[:axis] == flow[:axis] and shape[axis:].numel() == flow[axis:].numel()


def _known(placements: tuple[Placement, ...] | None) -> tuple[Placement, ...]:
    if placements is None:
        raise ValueError(UNKNOWN_STYLE)
    return placements


def along_units(split: Split | None, units: int, ndim: int) -> Split | None:
    """``split`` as recorded for a module whose units are dim ``units``: its axis that of the
    units where pieces lie along them (their per-unit values then go side by side; where pieces
    also split another dim, those are other rows of the same units), else none."""
    if split is None:
        return None
    units %= max(ndim, 1)
    if split.axis == units or (split.axis is None and units in split.axes):
        return dataclasses.replace(split, axis=units)
    return split if split.axis is None else dataclasses.replace(split, axis=None)
