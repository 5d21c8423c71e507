"""Several processes (DDP, FSDP2, tensor parallelism, pipeline stages): who writes, and the
collectives of a logged step.

Rank 0 writes (other ranks only when given their own ``writer=``). Every rank records its
logged step as usual; then, on all ranks together, at the end of each logged step:

- one ``all_gather_object`` of a small host-side description of what each rank recorded (a
  hash of its records and their element counts). Ranks that recorded different calls, or a rank
  that stopped logging, would otherwise make collectives of different sizes, which gloo
  aborts on and NCCL hangs or misreads; instead every rank learns it and logging stops. Two
  more where records are made after it: of whether packing failed, where split histogram
  samples are gathered (binned after the exchange), and, once gradients placed ``Partial`` are
  reduced, of what their records became (one to three in all, each a host sync under NCCL);
- for the pieces of tensors split over ranks (``sharding.Split``: ``DTensor`` parameters of
  FSDP2 and tensor parallelism, tensor-parallel module outputs), over exactly the mesh dims
  they are split on, never over replicas: norms' squares are summed (one ``all_reduce`` per
  group of such dims, for every tensor split alike); the per-call statistics and histogram
  samples of the other pieces are gathered (one ``all_gather`` per group each), so that the
  writer pools them as the pieces of one tensor;
- with ``reduce_ranks=True`` one ``all_gather`` of the per-call values (activations, inputs,
  output gradients; ``Kind.per_call``) lets the writer pool them over every rank's calls,
  exactly as it pools several calls of a module in one process; of the ranks holding the same
  values, one rank's count: of a tensor-parallel group, the first's unsplit values; of a piece
  split over some mesh dims (a ``full_dtensor`` batch's, over the data-parallel ranks), the
  first's over the mesh's other dims, where it is ``Replicate`` (``Split.first_of_replicas``).
  Parameter gradients (averaged over the data-parallel ranks) and histograms are the writing
  rank's own;
- with ``reduce_ranks=True`` over the stages of a pipeline schedule, whose ranks record
  different modules, the description carries each rank's packed step whole (:class:`Held`), and
  one ``all_gather`` of every rank's packed values (padded to the largest) gives the writer the
  other stages' records, added to its own as records of modules it does not hold: their
  statistics, parameter gradients and histograms as their stage's first rank has them, the
  per-call values of each of a stage's ranks (``stages.merged``). What the writer reads is then
  one model's, ``param_grad/global_norm`` over every stage's parameters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import weakref
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._compat import fsdp_gradient_divisor
from ..errors import HookLoggerError
from ..stats.binning import Sample
from ..stats.packing import Entry, Record, StepLayout
from ..topology.parallel import TensorParallel
from ..topology.sharding import Pending, Split
from . import stages as pipeline
from .told import Told

Item = TypeVar("Item")
#: A pipeline stage's packed step (its layout) and the indices of the stages it is of.
Stage = tuple[StepLayout, tuple[int, ...]]
Packed = tuple[Tensor, StepLayout]
Pack = Callable[[list[Record], list[Sample]], Packed | None]
Resolve = Callable[[list[Pending], list[Tensor]], tuple[list[Record], list[Sample]]]
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without an initialized process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def collective_device() -> torch.device:
    """Where a tensor for the default process group's collectives lives: the current CUDA device
    under NCCL, else the CPU (gloo)."""
    backend = str(dist.get_backend())
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")


def gradient_divisor(given: nn.Module, model: nn.Module) -> Callable[[], float]:
    """What the data-parallel reduction divides the ranks' summed parameter gradients by, read
    at each logged step from the module the logger was ``given`` or the ``model`` it watches in
    it: ``DistributedDataParallel``'s average (its group's
    size), FSDP2's divide factor (``_compat.fsdp_gradient_divisor``: the data-parallel size, or
    what ``set_gradient_divide_factor`` set, 1 under torchtitan), else 1. Each rank's output
    gradients are of its own loss; divided by this, they are those of the loss whose gradients
    the optimizer applies (those of one process with the whole batch, for a mean loss)."""
    if isinstance(given, nn.parallel.DistributedDataParallel):
        size = float(dist.get_world_size(given.process_group))
        return lambda: size
    sharded = next((m for m in model.modules() if fsdp_gradient_divisor(m) is not None), None)
    if sharded is None:
        return lambda: 1.0
    root = weakref.ref(sharded)  # (the outermost: its factor is the whole model's unless set apart)

    def divisor() -> float:
        module = root()
        return 1.0 if module is None else fsdp_gradient_divisor(module) or 1.0

    return divisor


class Ranks:
    """The collectives of a logged step, made identically on every rank."""

    def __init__(self, *, reduce: bool, split: bool, first: int | None = None) -> None:
        """``split``: the model holds tensors split over ranks (``DTensor`` parameters or
        tensor-parallel modules); ``first``: the global rank of the first of this rank's
        tensor-parallel group (``None``, without one: this rank)."""
        self.rank, self.world = rank_and_world()
        self.reduce = reduce and self.world > 1
        self.split = split and self.world > 1
        self.first = self.rank if first is None else first
        self.lead = self.first == self.rank

    @property
    def needed(self) -> bool:
        """Whether every rank must take part in logged steps, writing or not."""
        return self.reduce or self.split

    def sharded_late(self, parallel: TensorParallel) -> HookLoggerError | None:
        """The error to stop logging with (on every rank alike) when the model was sharded after
        the logger was created: what it recorded would be this rank's pieces only."""
        if self.world == 1 or self.split:
            return None
        parallel.look_up()  # (styles given since the logged step began count too)
        if not parallel.holds_split():
            return None
        return HookLoggerError(
            "the model was sharded (fully_shard, parallelize_module) after the HookLogger was created, so its "
            "statistics would be this rank's pieces only; create the HookLogger after sharding the model"
        )

    def stop(self) -> None:
        """No collectives from now on (all ranks stop together, see :meth:`agree`)."""
        self.reduce = self.split = False

    def packs_together(self, drained: tuple[list[Record], list[Sample], list[Pending]]) -> bool:
        """Whether a step's records are packed in :meth:`finish`, with the other ranks: when
        gradients placed ``Partial`` must first be reduced, or split samples joined by their
        other pieces (binned over one range)."""
        _, samples, waiting = drained
        return self.needed and (bool(waiting) or any(h.split is not None for h in samples))

    def finish(
        self,
        drained: tuple[list[Record], list[Sample], list[Pending]] | None,
        packed: Packed | None,
        pack: Pack,
        resolve: Resolve,
        *,
        stages: tuple[int, ...] = (),
    ) -> Packed | None:
        """The end of a logged step, on every rank together. ``drained``: what this rank recorded
        (``None``: it stopped logging); ``packed``: that packed, unless gradients placed
        ``Partial`` must first be reduced over ranks (``resolve`` makes their records) or split
        samples joined by their other pieces, in which case ``pack`` packs them here;
        ``stages``: the pipeline stages this rank's model ran as (its step is told of whole, so
        that the writing rank can add it to its own stage's). Returns the
        step combined over ranks; raises ``RuntimeError`` on every rank alike when it cannot be."""
        records, samples, waiting = ([], [], []) if drained is None else drained
        stage = (packed[1], stages) if stages and packed is not None and self.reduce else None
        told = self.agree(None if drained is None else records, samples, waiting, stage)
        if packed is not None or drained is None or not self.packs_together(drained):
            return None if packed is None else self.combine(*packed, told)
        if waiting:
            reduced, failure = self._reduced(waiting), None
            try:
                more, rows = resolve(waiting, reduced)
                records, samples = records + more, samples + rows
            except Exception as error:
                failure = error
            try:  # (again, with the records of the reduced gradients)
                told = self.agree(None if failure else records, samples, [])
            except RuntimeError as error:
                raise error if failure is None else RuntimeError(f"{type(failure).__name__}: {failure}") from failure
        failure = None
        try:
            packed = pack(records, self.gather_samples(samples, told))
        except Exception as error:  # e.g. histc under deterministic CUDA
            failure = error
        failed: list[str | None] = [None] * self.world
        dist.all_gather_object(failed, None if failure is None else f"{type(failure).__name__}: {failure}")
        if any(failed):
            raise RuntimeError(f"packing failed: {[f for f in failed if f]}") from failure
        return None if packed is None else self.combine(*packed, told)

    def _reduced(self, waiting: list[Pending]) -> list[Tensor]:
        """The terms of gradients placed ``Partial`` reduced as their placements say (one
        ``all_reduce`` per mesh dim for all the gradients placed alike)."""
        out: list[Tensor | None] = [None] * len(waiting)
        for numbered in _alike(list(enumerate(waiting)), lambda item: item[1].alike):
            first = numbered[0][1]
            flat = torch.cat([p.terms.reshape(-1) for _, p in numbered])
            for dim, placement in enumerate(first.placements):
                if placement.is_partial():
                    op = placement.reduce_op  # type: ignore[attr-defined]
                    group = first.mesh.get_group(dim)
                    dist.all_reduce(flat, op=_REDUCE_OPS[op], group=group)
                    if op == "avg":  # (gloo has no AVG)
                        flat /= dist.get_world_size(group)
            for (i, p), part in zip(numbered, flat.split([p.terms.numel() for _, p in numbered])):
                out[i] = part.view_as(p.terms)
        return out  # type: ignore[return-value]

    def agree(
        self,
        records: list[Record] | None,
        samples: list[Sample],
        waiting: list[Pending],
        stage: Stage | None = None,
    ) -> list[Told]:
        """Exchange what each rank recorded (``records`` ``None``: this rank stopped logging;
        ``stage``: its packed step's layout and its stages' indices, where its model ran as
        stages of a pipeline schedule: ranks of other stages differ even where their modules'
        names and shapes are alike, and are not taken for replicas of one stage). Raises
        ``RuntimeError`` on every rank alike if a rank stopped or the ranks recorded different
        calls, other than as the stages of a pipeline (``stages.combinable``): the collectives that
        follow would not match."""
        mine = None if records is None else self._told(records, samples, waiting, stage)
        told: list[Told | None] = [None] * self.world
        dist.all_gather_object(told, mine)
        stopped = [rank for rank, theirs in enumerate(told) if theirs is None]
        if stopped:
            raise RuntimeError(f"rank(s) {stopped} stopped logging (the warning on that rank says why)")
        if len({theirs.fingerprint for theirs in told if theirs is not None}) > 1 and not pipeline.combinable(told):  # type: ignore[arg-type]
            counts = [len(theirs.numels) for theirs in told if theirs is not None]
            raise RuntimeError(
                "the ranks recorded different calls of the watched modules or different pieces of split tensors "
                f"(records to combine, by rank: {counts}); every rank must call the same watched modules in a "
                "logged step (the stages of a pipeline schedule are combined where their ranks record modules "
                "of different names, none split over ranks)"
            )
        return told  # type: ignore[return-value]  # (none is None)

    def gather_samples(self, samples: list[Sample], told: list[Told]) -> list[Sample]:
        """``samples`` and, for each split one, the other pieces' samples (one ``all_gather`` per
        group of mesh dims): rows of one histogram, binned over one range (``binning.bin_rows``)."""
        split = [h for h in samples if h.split is not None]
        if not split:
            return samples
        width = [max(theirs.sampled[i][0] for theirs in told) for i in range(len(split))]
        extra: list[Sample] = []
        for numbered in _alike(list(enumerate(split)), lambda item: item[1].split):
            rows = []
            for i, h in numbered:
                nan = h.sample.new_full((), math.nan)
                ends = [nan if t is None else t.to(h.sample.dtype).reshape(()) for t in h.ends()]
                rows += [torch.stack(ends), h.sample.reshape(-1), nan.expand(width[i] - h.sample.numel())]
            along: Split = numbered[0][1].split  # type: ignore[assignment]
            gathered = _gather(torch.cat(rows).double(), along)
            for part, rank in enumerate(along.peers()):
                if rank == self.rank:
                    continue
                offset = 0
                for i, h in numbered:
                    length, numel = told[rank].sampled[i]
                    row = gathered[part, offset : offset + 2 + width[i]]
                    offset += 2 + width[i]
                    extra.append(Sample(h.kind, h.name, row[2 : 2 + length].to(h.sample.dtype), numel, row[0], row[1]))
        return samples + extra

    def combine(self, packed: Tensor, layout: StepLayout, told: list[Told]) -> tuple[Tensor, StepLayout]:
        """Sum the squares of split norms over their pieces; add the other pieces' per-call
        values (and with ``reduce_ranks`` every rank's) as further records."""
        for entries in _alike([e for e in layout.entries if e.kind.norms and e.split is not None], lambda e: e.split):
            index = _index(_positions(entries), packed.device)
            squares = packed[index].square()
            for group in entries[0].split.groups:  # type: ignore[union-attr]
                dist.all_reduce(squares, group=group)
            packed = packed.index_copy(0, index, squares.sqrt())
        if self.reduce and len({theirs.fingerprint for theirs in told}) > 1:  # (stages, see agree)
            return pipeline.merged(packed, layout, told, self.rank)
        if self.reduce:  # (told of: every per-call record, then the pieces)
            first = sum(e.kind.per_call for e in layout.entries)
            packed, layout = self._everyone(packed, layout, told)
            return self._pieces(packed, layout, told, [e for e in layout.entries if _pieced(e)], first)
        pieces = [e for e in layout.entries if e.split is not None and e.kind.per_call]
        return self._pieces(packed, layout, told, pieces + [e for e in layout.entries if _pieced(e)])

    def _pieces(
        self, packed: Tensor, layout: StepLayout, told: list[Told], pieces: list[Entry], first: int = 0
    ) -> tuple[Tensor, StepLayout]:
        """The other pieces' records of split tensors like ``pieces``, gathered over their groups
        (``first``: the place of the first of them among the records each rank told of)."""
        if not pieces:
            return packed, layout
        numbered = {id(e): first + i for i, e in enumerate(pieces)}
        entries = [_own_part(e) for e in layout.entries]
        stacked, offset = [packed], layout.size
        for alike in _alike(pieces, lambda e: e.split):
            split: Split = alike[0].split  # type: ignore[assignment]
            mine = packed.index_select(0, _index(_positions(alike), packed.device))
            gathered = _gather(mine, split)
            for part, rank in enumerate(split.peers()):
                if rank == self.rank:
                    continue
                stacked.append(gathered[part])
                at = [numbered[id(e)] for e in alike]
                theirs = told[rank]
                entries += _laid_out(alike, offset, [theirs.numels[i] for i in at], [theirs.parts[i] for i in at])
                offset += mine.numel()
        return torch.cat(stacked), dataclasses.replace(layout, entries=entries, size=offset)

    def _everyone(self, packed: Tensor, layout: StepLayout, told: list[Told]) -> tuple[Tensor, StepLayout]:
        """Every rank's per-call records, gathered over all ranks; of the ranks of a
        tensor-parallel group, which hold the same unsplit values, the first's count."""
        per_call = [e for e in layout.entries if e.kind.per_call]
        if not per_call:
            return packed, layout
        mine_counted = {id(e) for e, counts in zip(per_call, told[self.rank].counted) if counts}
        entries = [_own_part(e) for e in layout.entries if not e.kind.per_call or id(e) in mine_counted]
        mine = packed.index_select(0, _index(_positions(per_call), packed.device))
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        offset = layout.size
        for rank, theirs in enumerate(told):
            if rank == self.rank:
                continue
            copies = _laid_out(per_call, offset, theirs.numels, theirs.parts)
            entries += [e for e, counts in zip(copies, theirs.counted) if counts]
            offset += mine.numel()
        others = [t for rank, t in enumerate(gathered) if rank != self.rank]
        return torch.cat([packed, *others]), dataclasses.replace(layout, entries=entries, size=offset)

    def _told(self, records: list[Record], samples: list[Sample], waiting: list[Pending], stage: Stage | None) -> Told:
        """This rank's description: what must match across ranks (the gathered and combined
        records' kinds, modules, lengths and splits, hashed), and its element counts; with
        ``stage`` (see :meth:`agree`) and no split record, that stage's step whole."""
        gathered = [r for r in records if r.kind.per_call and (self.reduce or r.split is not None)]
        gathered += [r for r in records if _pieced(r)]
        combined = [r for r in records if r.kind.norms and r.split is not None]
        split_samples = [h for h in samples if h.split is not None]
        described = repr(
            (
                [(r.kind.name, r.name, tuple(t.numel() for t in r.values), _key(r.split)) for r in gathered],
                [(r.kind.name, r.name, _key(r.split)) for r in combined],
                [(h.kind, h.name, _key(h.split)) for h in split_samples],
                [(p.key, tuple(p.terms.shape), p.alike) for p in waiting],
                None if stage is None else stage[1],
            )
        ).encode()
        fingerprint = hashlib.blake2b(described, digest_size=16).hexdigest()
        sampled = [(h.sample.numel(), h.numel) for h in split_samples]
        parts = [_part(r.split) for r in gathered]
        counted = [_counts(r.split, self.lead) for r in gathered]
        held = None if stage is None or any(e.split is not None for e in stage[0].entries) else pipeline.held(stage[0])
        return Told(fingerprint, [r.numel for r in gathered], parts, sampled, counted, held)


def _counts(split: Split | None, lead: bool) -> bool:
    """Whether this rank's values of a tensor split as ``split`` count when every rank's are
    pooled: of ranks holding the same values, one's (``lead``: the first of each tensor-parallel
    group, for an unsplit tensor; for a piece, the first of the ranks its mesh replicates it over)."""
    return lead if split is None else split.first_of_replicas()


def _pieced(item: Record | Entry) -> bool:
    """Whether ``item`` is a piece of a split tensor whose records are gathered over its pieces
    only, whether or not the ranks' records are pooled (``reduce_ranks``): a kind of one record a
    tensor, neither per call nor of norms (a sharded parameter's gradient under ``numerics=``:
    the pieces' counts, extremes and sums pooled as one tensor's)."""
    return item.split is not None and not item.kind.per_call and not item.kind.norms


def _key(split: Split | None) -> tuple[object, ...] | None:
    return None if split is None else split.key


def _alike(items: Iterable[Item], how: Callable[[Item], Split | tuple[object, ...] | None]) -> list[list[Item]]:
    """``items`` grouped by how they are split or placed (in first-seen order, the same on every rank)."""
    groups: dict[object, list[Item]] = {}
    for item in items:
        placed = how(item)
        groups.setdefault(_key(placed) if isinstance(placed, Split) else placed, []).append(item)
    return list(groups.values())


def _gather(mine: Tensor, split: Split) -> Tensor:
    """``mine`` from every rank holding a piece, stacked in ``split.peers()`` order."""
    stacked = mine.unsqueeze(0)
    for group in split.groups:
        parts = [torch.empty_like(stacked) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, stacked.contiguous(), group=group)
        stacked = torch.cat(parts)
    return stacked


def _positions(entries: list[Entry]) -> np.ndarray:
    return np.concatenate([np.arange(a, a + n) for e in entries for a, n in e.spans])


def _laid_out(entries: list[Entry], offset: int, numels: list[int], parts: list[int | None]) -> list[Entry]:
    """Another rank's records like ``entries``, with its element counts and parts, their values
    one after the other in the packed array from ``offset`` (as it gathered them)."""
    out = []
    for entry, numel, part in zip(entries, numels, parts):
        spans = []
        for _, length in entry.spans:
            spans.append((offset, length))
            offset += length
        out.append(dataclasses.replace(entry, numel=numel, spans=tuple(spans), part=part))
    return out


def _part(split: Split | None) -> int | None:
    """This rank's place among the pieces of a tensor split along its units, else ``None``."""
    return None if split is None or split.axis is None else split.part()


def _own_part(entry: Entry) -> Entry:
    """This rank's entry, numbered among its pieces where those lie side by side along its units."""
    part = _part(entry.split)
    return entry if part is None else dataclasses.replace(entry, part=part)


def _index(positions: np.ndarray, device: torch.device) -> Tensor:
    """Host positions as an index tensor on ``device``; copied from pageable memory with
    ``non_blocking``, which does not wait for the device's queued work (a blocking copy would)."""
    return torch.from_numpy(positions.astype(np.int64)).to(device, non_blocking=True)
