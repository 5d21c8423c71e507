"""Tensor parallelism: which tensors a logged step's hooks see are one rank's piece of a tensor
split over ranks, so that its statistics are combined with the other pieces' (``sharding.Split``).

A ``DTensor`` says so itself. A module that ``parallelize_module`` gave a style returns, by
default, a plain local tensor (``use_local_output=True``): its placements are the style's
(``_compat.parallel_output``). Modules called on such a piece (an activation after a
``ColwiseParallel`` layer) return pieces too: no collective ran in between. Pieces are known by
identity, for the logged step only.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import Tensor, nn

from .._compat import context_parallel, parallel_output, tree_flatten
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
    """The tensor-parallel styles of a model's modules, and the pieces seen in a logged step."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._styles: dict[int, tuple[DeviceMesh, tuple[Placement, ...] | None]] = {}  # id(module) -> its style
        self._pieces: dict[int, tuple[weakref.ref[Tensor], Split]] = {}

    def begin(self) -> None:
        """A logged step begins: look the styles up (modules parallelized after attaching count)."""
        model = self._model()
        modules = [] if model is None else model.modules()
        self._styles = {id(m): style for m in modules if (style := parallel_output(m)) is not None}

    def end(self) -> None:
        """A logged step ended: forget its pieces."""
        self._pieces.clear()

    def holds_split(self) -> bool:
        """Whether the model holds tensors split over ranks: ``DTensor`` parameters (FSDP2, tensor
        parallelism) or modules with a tensor-parallel style (as of the latest :meth:`begin`)."""
        model = self._model()
        return bool(self._styles) or (model is not None and any(is_dtensor(p) for p in model.parameters()))

    def first_of_groups(self) -> bool:
        """Whether this rank is the first of each tensor-parallel group of the styles found at the
        latest :meth:`begin`: of the ranks of one group, which hold the same unsplit values, its
        values count once."""
        return all(mesh.get_local_rank(d) == 0 for mesh, _ in self._styles.values() for d in range(mesh.ndim))

    @staticmethod
    def sequence_split() -> bool:
        """Whether every rank holds a shard of the sequence that no tensor says it is a shard of
        (``CONTEXT_PARALLEL``)."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and context_parallel()

    def outputs(self, module: nn.Module, args: object, tensors: Sequence[Tensor]) -> list[tuple[Tensor, Split | None]]:
        """Each output tensor of ``module`` (called on ``args``) as this rank's piece and its split.
        Raises ``ValueError`` for an output no piece can tell about (``Partial``, an unknown style)."""
        style = self._styles.get(id(module))
        source = None if style is not None else self._piece_among(args)
        out = []
        for t in tensors:
            if is_dtensor(t):
                out.append(local(t))
                continue
            split = None
            if style is not None:
                mesh, placements = style
                if placements is None:
                    raise ValueError(UNKNOWN_STYLE)
                split = placed(mesh, placements, t.dim())
            elif source is not None:  # computed from a piece alone: a piece of the same split
                same = source[0].shape == t.shape
                split = source[1] if same else dataclasses.replace(source[1], axis=None)
            if split is not None:
                self._pieces[id(t)] = (weakref.ref(t), split)
            out.append((t, split))
        return out

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

    def inputs(self, tensors: Sequence[Tensor]) -> list[tuple[Tensor, Split | None]]:
        """Each input tensor as this rank's piece and its split."""
        return [local(t) if is_dtensor(t) else (t, self._split_of(t)) for t in tensors]

    def _split_of(self, t: Tensor) -> Split | None:
        known = self._pieces.get(id(t))
        return known[1] if known is not None and known[0]() is t else None

    def _piece_among(self, args: object) -> tuple[Tensor, Split] | None:
        if not self._pieces:
            return None
        for t in tree_flatten(args)[0]:
            if isinstance(t, Tensor) and (split := self._split_of(t)) is not None:
                return t, split
        return None


def along_units(split: Split | None, units: int, ndim: int) -> Split | None:
    """``split`` as recorded for a module whose units are dim ``units``: its axis kept only where
    the pieces lie along the units (their per-unit values then go side by side)."""
    if split is None or split.axis is None or split.axis == units % max(ndim, 1):
        return split
    return dataclasses.replace(split, axis=None)
