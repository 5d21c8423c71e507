"""Several processes (DDP, FSDP2): who writes, and the collectives of a logged step.

Rank 0 writes (other ranks only when given their own ``writer=``). Every rank packs its
logged step as usual; then, on all ranks together, at the end of each logged step:

- one ``all_gather_object`` of a small host-side description of what each rank recorded (a
  hash of its layout and its element counts). Ranks that recorded different calls, or a rank
  that stopped logging, would otherwise make collectives of different sizes, which gloo
  aborts on and NCCL hangs or misreads; instead every rank learns it and logging stops;
- FSDP2 parameters are sharded ``DTensor`` objects: each rank has the norm of its local shard,
  so the squares are summed over exactly the mesh dimensions the parameter is sharded on (its
  ``Shard`` placements), never over replicas (HSDP's ``Replicate`` dimension): one ``all_reduce``
  per group of such dimensions, for all the parameters sharded alike;
- with ``reduce_ranks=True`` one ``all_gather`` of the per-call values (activations, inputs,
  output gradients; ``Kind.per_call``) lets the writer pool them over every rank's calls,
  exactly as it pools several calls of a module in one process. Parameter gradients (already
  averaged by DDP) and histograms are the writing rank's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ..stats.kinds import PARAM_GRAD
from ..stats.packing import Entry, StepLayout

if TYPE_CHECKING:
    from typing import TypeGuard

    from torch.distributed.tensor import DTensor


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without an initialized process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_sharded(t: object) -> TypeGuard[DTensor]:
    """Whether ``t`` is a ``DTensor`` (an FSDP2 parameter or gradient); never in a torch built
    without distributed support."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def shard_groups(t: DTensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups of the mesh dimensions ``t`` is sharded on (a ``Shard`` placement), in
    mesh order: summing over them gives the whole tensor's sums; over the others (``Replicate``)
    every rank holds the same values."""
    from torch.distributed.tensor import Shard

    mesh = t.device_mesh
    return tuple(mesh.get_group(dim) for dim, placement in enumerate(t.placements) if isinstance(placement, Shard))


def local_shard(t: Tensor) -> Tensor:
    """This rank's shard of an FSDP2 parameter or gradient; other tensors as they are.
    Norms of shards are combined over their shard dimensions (:func:`shard_groups`, ``Ranks.combine``)."""
    return t.to_local() if is_sharded(t) else t


class Ranks:
    """The collectives of a logged step, made identically on every rank."""

    def __init__(self, *, reduce: bool, sharded: dict[str, tuple[dist.ProcessGroup, ...]]) -> None:
        self.rank, self.world = rank_and_world()
        self.reduce = reduce and self.world > 1
        #: Sharded parameters and the groups their gradients' squares are summed over.
        self.sharded = {key: groups for key, groups in sharded.items() if groups} if self.world > 1 else {}

    @property
    def needed(self) -> bool:
        """Whether every rank must take part in logged steps, writing or not."""
        return self.reduce or bool(self.sharded)

    def stop(self) -> None:
        """No collectives from now on (all ranks stop together, see :meth:`agree`)."""
        self.reduce, self.sharded = False, {}

    def agree(self, layout: StepLayout | None) -> list[list[int]]:
        """Exchange what each rank recorded (``None``: this rank stopped logging); every
        rank's per-call element counts if all recorded the same calls. Raises ``RuntimeError``
        on every rank alike otherwise: the collectives that follow would not match."""
        mine = None if layout is None else (self._fingerprint(layout), [e.numel for e in self._per_call(layout)])
        told: list[tuple[str, list[int]] | None] = [None] * self.world
        dist.all_gather_object(told, mine)
        stopped = [rank for rank, theirs in enumerate(told) if theirs is None]
        if stopped:
            raise RuntimeError(f"rank(s) {stopped} stopped logging (the warning on that rank says why)")
        if len({theirs[0] for theirs in told if theirs is not None}) > 1:
            counts = [len(theirs[1]) for theirs in told if theirs is not None]
            raise RuntimeError(
                f"the ranks recorded different calls of the watched modules (per-call records by rank: {counts}); "
                "with reduce_ranks=True every rank must call the same watched modules in a logged step"
            )
        return [theirs[1] for theirs in told if theirs is not None]

    def combine(self, packed: Tensor, layout: StepLayout, numels: list[list[int]]) -> tuple[Tensor, StepLayout]:
        """Sum sharded parameter norms; if reducing, append every other rank's per-call values
        (``numels``: their element counts, from :meth:`agree`) as further calls."""
        alike: dict[tuple[dist.ProcessGroup, ...], list[int]] = {}  # in layout order: the same on every rank
        for e in self._sharded(layout):
            alike.setdefault(self.sharded[e.name], []).append(e.spans[0][0])
        for groups, offsets in alike.items():
            index = _index(np.array(offsets), packed.device)
            squares = packed[index].square()
            for group in groups:
                dist.all_reduce(squares, group=group)
            packed = packed.index_copy(0, index, squares.sqrt())
        per_call = self._per_call(layout)
        if not (self.reduce and per_call):
            return packed, layout
        lengths = [n for e in per_call for _, n in e.spans]
        positions = np.concatenate([np.arange(a, a + n) for e in per_call for a, n in e.spans])
        mine = packed.index_select(0, _index(positions, packed.device))
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        entries, offset = list(layout.entries), layout.size
        for rank in range(self.world):
            if rank == self.rank:
                continue
            starts = iter((offset + np.cumsum([0, *lengths[:-1]])).tolist())
            for entry, numel in zip(per_call, numels[rank]):
                spans = tuple((next(starts), n) for _, n in entry.spans)
                entries.append(dataclasses.replace(entry, numel=numel, spans=spans))
            offset += positions.size
        others = [t for rank, t in enumerate(gathered) if rank != self.rank]
        return torch.cat([packed, *others]), dataclasses.replace(layout, entries=entries, size=offset)

    def _fingerprint(self, layout: StepLayout) -> str:
        """What must match across ranks for the collectives: the per-call records (kind,
        module, lengths) and the sharded parameters recorded, hashed; element counts may differ."""
        shape = [(e.kind.name, e.name, tuple(n for _, n in e.spans)) for e in self._per_call(layout)]
        described = repr((shape, [e.name for e in self._sharded(layout)])).encode()
        return hashlib.blake2b(described, digest_size=16).hexdigest()

    def _per_call(self, layout: StepLayout) -> list[Entry]:
        return [e for e in layout.entries if e.kind.per_call] if self.reduce else []

    def _sharded(self, layout: StepLayout) -> list[Entry]:
        return [e for e in layout.of(PARAM_GRAD) if e.name in self.sharded]


def _index(positions: np.ndarray, device: torch.device) -> Tensor:
    """Host positions as an index tensor on ``device``; copied from pageable memory with
    ``non_blocking``, which does not wait for the device's queued work (a blocking copy would)."""
    return torch.from_numpy(positions.astype(np.int64)).to(device, non_blocking=True)
