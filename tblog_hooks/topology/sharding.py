"""Tensors split over ranks: the ``DTensor`` parameters of FSDP2 and tensor parallelism, and module
outputs that are one rank's piece of a tensor-parallel output.

A :class:`Split` says which ranks hold the other pieces of a tensor: the dims of a device mesh it
is sharded on (its ``Shard`` placements). Over the mesh's other dims (``Replicate``) every rank
holds the same values, so those are never summed over. The hooks record statistics of the local
piece with its ``Split``; at the end of a logged step ``Ranks`` combines the pieces
(``distributed.py``), so what is written describes the whole tensor, as one process would see it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch.distributed as dist
from torch import Tensor

from .._compat import dtensor_api

if TYPE_CHECKING:
    from typing import TypeGuard

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True, eq=False)
class Split:
    """A tensor split over the mesh dims ``dims`` of ``mesh``, along its own dim ``axis``
    (``None`` where pieces split several dims, or where it is not known). ``axes``: the dim of
    the tensor each of ``dims`` splits, where known; where they differ (a batch over the
    data-parallel ranks, features over the tensor-parallel ones) and ``axis`` is one of them,
    the pieces over the other dims hold other rows of the same units (:meth:`part`)."""

    mesh: DeviceMesh
    dims: tuple[int, ...]
    axis: int | None
    axes: tuple[int, ...] = ()

    @property
    def groups(self) -> tuple[dist.ProcessGroup, ...]:
        """The process groups of :attr:`dims`, in mesh order."""
        return tuple(self.mesh.get_group(d) for d in self.dims)

    @property
    def key(self) -> tuple[object, ...]:
        """What splits alike share on every rank (not the groups' names, which differ between
        the tensor-parallel groups of a 2-D mesh)."""
        return (tuple(self.mesh.shape), self.mesh.mesh_dim_names, self.dims)

    def peers(self) -> list[int]:
        """The global ranks holding the pieces, in the order gathering over :attr:`groups` one
        after the other stacks them (the last group outermost; each group in rank order)."""
        ranks = self.mesh.mesh.numpy()

        def line(member: int, dim: int) -> list[int]:
            coordinate: list[int | slice] = [int(c) for c in np.argwhere(ranks == member)[0]]
            coordinate[dim] = slice(None)
            return sorted(int(r) for r in ranks[tuple(coordinate)])

        def gathered(member: int, upto: int) -> list[int]:
            if upto == 0:
                return [member]
            return [q for other in line(member, self.dims[upto - 1]) for q in gathered(other, upto - 1)]

        return gathered(dist.get_rank(), len(self.dims))

    def first_of_replicas(self) -> bool:
        """Whether this rank is the first of those holding the same piece: the first along each
        mesh dim the tensor is not split on (``Replicate`` there)."""
        return all(self.mesh.get_local_rank(d) == 0 for d in range(self.mesh.ndim) if d not in self.dims)

    def part(self) -> int:
        """This rank's position among its :meth:`peers` along :attr:`axis`: among those of the
        same coordinates on the mesh dims that split another dim of the tensor, whose pieces
        are other rows of the same units (numbered alike, so pooled as calls of one piece)."""
        peers, me = self.peers(), dist.get_rank()
        across = [d for d, a in zip(self.dims, self.axes) if a != self.axis]
        if self.axis is None or not across:
            return peers.index(me)
        ranks = self.mesh.mesh.numpy()

        def coordinates(rank: int) -> list[int]:
            at = np.argwhere(ranks == rank)[0]
            return [int(at[d]) for d in across]

        mine = coordinates(me)
        return [r for r in peers if coordinates(r) == mine].index(me)


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``DTensor``; never in a torch built without distributed support."""
    if not dist.is_available():
        return False
    return isinstance(t, dtensor_api().DTensor)


def placed(mesh: DeviceMesh, placements: tuple[Placement, ...], ndim: int) -> Split | None:
    """The :class:`Split` of a tensor of ``ndim`` dims placed so on ``mesh`` (``None``: every rank
    holds all of it). A mesh dim of one rank splits nothing: its one piece, or its one term, is
    the whole (FSDP2 over a data-parallel mesh of one, as torchtitan applies it to every model).
    Raises ``ValueError`` for a ``Partial`` placement over ranks: its values are terms of a sum
    over them, of which no piece's statistics tell the whole."""
    spread = [mesh.size(d) > 1 for d in range(len(placements))]
    if any(p.is_partial() and over for p, over in zip(placements, spread)):
        raise ValueError(f"a tensor placed {placements} holds partial values; only a collective could make them whole")
    # Every placement but these two shards (Shard, and the _StridedShard of FSDP2 over tensor parallelism).
    dims = tuple(d for d, p in enumerate(placements) if not p.is_replicate() and spread[d])
    if not dims:
        return None
    axes = tuple(placements[d].dim % max(ndim, 1) for d in dims)  # type: ignore[attr-defined]
    return Split(mesh, dims, axes[0] if len(set(axes)) == 1 else None, axes)


class TermsOf(enum.Enum):
    """What a :class:`Pending` tensor is, and so which recorder records it once whole."""

    PARAMETER_GRADIENT = enum.auto()
    OUTPUT_GRADIENT = enum.auto()
    OUTPUT = enum.auto()


class Pending(NamedTuple):
    """A tensor placed ``Partial`` on some mesh dims (a gradient; the output of torchtitan's routed
    experts): its local terms, copied, summed (or reduced as the placement says) over those dims'
    ranks at the end of the step, when every rank takes part (``Ranks.finish``); no hook enters
    a collective."""

    key: str
    terms: Tensor
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    of: TermsOf

    @property
    def alike(self) -> tuple[object, ...]:
        """What pending gradients reduced in one collective share on every rank."""
        ops = tuple(getattr(p, "reduce_op", None) for p in self.placements)
        return (tuple(self.mesh.shape), self.mesh.mesh_dim_names, ops, self.terms.dtype)

    def whole(self, reduced: Tensor) -> tuple[Tensor, Split | None]:
        """The reduced terms, a piece split as the placements' other dims say."""
        replicate = dtensor_api().Replicate
        placements = tuple(replicate() if p.is_partial() else p for p in self.placements)
        return reduced, placed(self.mesh, placements, reduced.dim())


def is_partial(t: object) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``DTensor`` placed ``Partial`` on some mesh dim (a sequence-parallel norm's gradient)."""
    return is_dtensor(t) and any(p.is_partial() for p in t.placements)


def pending(key: str, t: Tensor, of: TermsOf) -> Pending | None:
    """A ``Pending`` copy of ``t`` if it is placed ``Partial`` (:func:`is_partial`), else ``None``."""
    if not is_partial(t):
        return None
    return Pending(key, t.to_local().detach().clone(), t.device_mesh, tuple(t.placements), of)


def terms(key: str, t: Tensor, mesh: DeviceMesh, of: TermsOf) -> Pending:
    """A ``Pending`` copy of a plain tensor that holds this rank's term of a sum over ``mesh``
    (torchtitan's ``spmd_types`` backend: the gradient of an output ``Replicate`` there; its
    routed experts' output under tensor parallelism)."""
    return Pending(key, t.detach().clone(), mesh, (dtensor_api().Partial(),), of)


def local(t: Tensor) -> tuple[Tensor, Split | None]:
    """This rank's piece of ``t`` and how it is split: the local tensor of a ``DTensor``; any other
    tensor as it is, whole."""
    if not is_dtensor(t):
        return t, None
    return t.to_local(), placed(t.device_mesh, tuple(t.placements), t.dim())
