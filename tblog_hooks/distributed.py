"""Several processes (DDP, FSDP2): who writes, and the collectives of a logged step.

Rank 0 writes (other ranks only when given their own ``writer=``). Every rank packs its
logged step as usual; then, on all ranks together, at most two collectives per logged step:

- FSDP2 parameters are sharded: each rank has the norm of its local shard, so the squares
  are summed with one ``all_reduce`` (the norm of the whole gradient, as unsharded);
- with ``reduce_ranks=True`` one ``all_gather`` of the packed tensor lets the writer pool the
  per-call records (activations, inputs, output gradients; ``Kind.per_call``) over every
  rank's calls, exactly as it pools several calls of a module in one process. Parameter
  gradients (already averaged by DDP) and histograms are rank 0's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from .records import PARAM_GRAD, Layout

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


def local_shard(t: Tensor) -> Tensor:
    """This rank's shard of an FSDP2 parameter or gradient; other tensors as they are.
    Norms of shards are combined across ranks with one all-reduce per logged step."""
    return t.to_local() if is_sharded(t) else t


class Ranks:
    """The collectives of a logged step, made identically on every rank."""

    def __init__(self, *, reduce: bool, sharded: set[str]) -> None:
        self.rank, self.world = rank_and_world()
        self.reduce = reduce and self.world > 1
        self.sharded = sharded if self.world > 1 else set()

    @property
    def needed(self) -> bool:
        """Whether every rank must take part in logged steps, writing or not."""
        return self.reduce or bool(self.sharded)

    def combine(self, packed: Tensor, layout: Layout) -> Tensor:
        """Sum sharded parameter norms, then gather every rank's packed tensor if reducing
        (rows: ranks). Every rank must call this with the same layout."""
        sharded = [e.spans[0][0] for e in layout.of(PARAM_GRAD) if e.name in self.sharded]
        if sharded:
            index = torch.tensor(sharded, device=packed.device)
            squares = packed[index].square()
            dist.all_reduce(squares)
            packed = packed.index_copy(0, index, squares.sqrt())
        if not self.reduce:
            return packed
        gathered = [torch.empty_like(packed) for _ in range(self.world)]
        dist.all_gather(gathered, packed)
        return torch.stack(gathered)


def merge_ranks(values: np.ndarray, layout: Layout) -> tuple[np.ndarray, Layout]:
    """One packed array from a ``(ranks, n)`` gather: every rank's per-call records, as if they
    were further calls on one rank; the other records (parameters, histograms) of rank 0."""
    size = values.shape[1]
    entries = list(layout.entries)
    for rank in range(1, values.shape[0]):
        shift = rank * size
        entries += [
            dataclasses.replace(e, spans=tuple((a + shift, n) for a, n in e.spans))
            for e in layout.entries
            if e.kind.per_call
        ]
    return values.reshape(-1), dataclasses.replace(layout, entries=entries)
