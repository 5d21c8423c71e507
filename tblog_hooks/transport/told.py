"""What each rank tells the others of its logged step, in the one ``all_gather_object`` a logged
step makes (``distributed.Ranks.agree``)."""

from __future__ import annotations

from typing import NamedTuple

from ..stats.binning import RowInfo


class Held(NamedTuple):
    """One pipeline stage's packed step as the writing rank of another stage reads it: what its
    rank's records are of, and where each one's values lie in its packed array (see ``stages.merged``)."""

    names: frozenset[str]  # the modules and parameters its records are of
    #: Per entry: its kind's place in the recipe's (``Recipe.all``, alike on every rank), name,
    #: element count, spans (in its own packed array) and shape.
    entries: list[tuple[int, str, int, tuple[tuple[int, int], ...], tuple[int, ...]]]
    rows: list[RowInfo]  # its histogram rows (``StepLayout.rows``)
    size: int  # of its packed array


class Told(NamedTuple):
    """What one rank told the others about its logged step (see ``distributed.Ranks.agree``)."""

    fingerprint: str
    numels: list[int]  # per record that is gathered: the elements it describes
    parts: list[int | None]  # per record that is gathered: its place among pieces split along the units
    sampled: list[tuple[int, int]]  # per split histogram sample: its length, the elements it stands for
    counted: list[bool]  # per record that is gathered: whether it counts with reduce_ranks (``distributed._counts``)
    held: Held | None = None  # under a pipeline schedule, with no split records: its stage's step
