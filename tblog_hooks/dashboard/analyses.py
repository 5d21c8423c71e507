"""Each model's whole run, replayed through the rules once per change and shared by the routes that
need it (``findings``, ``modules``, ``series``, ``spikes``): the first request reads and judges the
run, those that come meanwhile wait for its answer rather than judging it again."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..diagnostics.findings import Finding
from ..diagnostics.replay import Run, findings, from_columns
from .source import Model, Source


@dataclass(frozen=True)
class Analysis:
    """A model's whole run (its logged steps, every-step series and forward order) and its
    findings, as ``tblog-hooks report`` replays them; ``sampled`` when TensorBoard kept a sample
    of the logged steps (as many as its reservoir holds), not every one written."""

    run: Run
    findings: list[Finding]
    sampled: bool


class Analyses:
    """The :class:`Analysis` of each model, kept until TensorBoard loads more of its run."""

    def __init__(self, source: Source) -> None:
        self._source = source
        self._held: dict[tuple[str, str], tuple[tuple[int, float], Future[Analysis]]] = {}
        self._lock = threading.Lock()  # TensorBoard serves requests from several threads

    def of(self, ctx: Any, experiment_id: str, model: Model) -> Analysis:
        """The model's analysis at its current version: judged now by the first request to ask,
        waited for by the others."""
        key = (model.run, model.prefix)
        with self._lock:
            held = self._held.get(key)
            first = held is None or held[0] != model.version
            if first:
                held = self._held[key] = (model.version, Future())
        assert held is not None
        answer = held[1]
        if first:
            try:
                answer.set_result(self._judge(ctx, experiment_id, model))
            except BaseException as error:
                answer.set_exception(error)
                with self._lock:  # not kept: the next request tries again
                    if self._held.get(key) is held:
                        del self._held[key]
        return answer.result()

    def _judge(self, ctx: Any, experiment_id: str, model: Model) -> Analysis:
        columns = self._source.columns(ctx, experiment_id, model, list(model.tags))
        own = {model.own(t): column for t, column in columns.items()}
        run = from_columns(model.run, model.prefix, own, self._source.order(ctx, experiment_id, model))
        kept = self._source.scalars_kept
        return Analysis(run, findings(run), sampled=0 < kept <= len(run.scalars))
