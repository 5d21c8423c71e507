"""The stages of a pipeline schedule under ``reduce_ranks=True``: each rank's packed step told of
whole (``told.Held``) to the others, and merged by the writing rank as one model's: the stages'
ranks record modules of different names, which are added to each other, not pooled."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from ..stats.packing import Entry, StepLayout
from ..stats.recipe import Source
from .told import Held, Told


def held(layout: StepLayout) -> Held:
    """A pipeline stage's packed step described for the other stages' ranks (``told.Held``)."""
    kinds = {id(kind): k for k, kind in enumerate(layout.recipe.all)}
    plain = (layout.recipe[Source.BINNED], layout.recipe[Source.SCALAR])
    names = frozenset(e.name for e in layout.entries if e.kind not in plain)
    entries = [(kinds[id(e.kind)], e.name, e.numel, e.spans, e.shape) for e in layout.entries]
    return Held(names, entries, list(layout.rows), layout.size)


def combinable(told: list[Told]) -> bool:
    """Whether ranks that recorded different calls are the stages of a pipeline schedule whose
    steps can be combined as one model's: every rank's step told of whole (:class:`Held`), and
    the ranks of different fingerprints (stages; those of one stage: its data-parallel replicas)
    recording modules and parameters of different names, so that none of a stage is pooled
    with another stage's."""
    if any(theirs.held is None for theirs in told):
        return False
    stages = {theirs.fingerprint: theirs.held.names for theirs in told}  # type: ignore[union-attr]
    return sum(map(len, stages.values())) == len(frozenset().union(*stages.values()))


def merged(packed: Tensor, layout: StepLayout, told: list[Told], rank: int) -> tuple[Tensor, StepLayout]:
    """The steps of every pipeline stage as one model's (one ``all_gather`` of each rank's
    packed array, padded to the largest): of each stage, the first of its ranks' records
    (modules this rank does not hold: their statistics, parameter gradients and histograms
    as that rank has them, for the writer to read as its own, ``param_grad/global_norm``
    over them all), and the per-call records of its every rank (pooled, as ``Ranks._everyone``
    pools a stage's data-parallel replicas); ``rank``: this one's."""
    largest = max(theirs.held.size for theirs in told)  # type: ignore[union-attr]  # (none is None: combinable)
    mine = torch.cat([packed, packed.new_zeros(largest - packed.numel())])
    gathered = [torch.empty_like(mine) for _ in told]
    dist.all_gather(gathered, mine)
    own = told[rank]
    counted = {id(e) for e, counts in zip([e for e in layout.entries if e.kind.per_call], own.counted) if counts}
    entries = [e for e in layout.entries if not e.kind.per_call or id(e) in counted]
    rows, stacked, offset = list(layout.rows), [packed], layout.size
    first = {theirs.fingerprint: r for r, theirs in reversed(list(enumerate(told)))}
    kinds = layout.recipe.all
    for other, theirs in enumerate(told):
        step: Held = theirs.held  # type: ignore[assignment]
        if other == rank:
            continue
        whole = theirs.fingerprint != own.fingerprint and first[theirs.fingerprint] == other
        copies = [
            Entry(kinds[k], name, numel, tuple((offset + a, n) for a, n in spans), shape)
            for k, name, numel, spans, shape in step.entries
        ]
        calls = [e for e in copies if e.kind.per_call]
        entries += [e for e, counts in zip(calls, theirs.counted) if counts]
        if whole:  # (the loss scale, amp/*, is the writing rank's)
            entries += [e for e in copies if not e.kind.per_call and e.kind is not layout.recipe[Source.SCALAR]]
            rows += step.rows
        stacked.append(gathered[other][: step.size])
        offset += step.size
    return torch.cat(stacked), dataclasses.replace(layout, entries=entries, size=offset, rows=rows)
