"""This package's runs as TensorBoard's data provider serves them: which runs (and prefixes) hold
its tags, the values of a tag root, and a whole run as a :class:`~tblog_hooks.diagnostics.replay.Run`
for the rules ``tblog-hooks report`` replays.

TensorBoard keeps a reservoir of each scalar tag (1,000 values unless ``--samples_per_plugin
scalars=N`` says otherwise); every value it kept is read, never fewer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensorboard.data import provider

from ..cli.report import as_json
from ..diagnostics.replay import Run, forward_key, forward_order, is_logged_step
from ..stats.tags import (
    GRAD_NORM_TAG,
    NAMED_ROOTS,
    ORDER_TAG,
    TABLE_PLUGIN,
    Root,
    parse_order,
    rows_tag,
    split_prefix,
    unescape,
)

_SCALARS, _TEXT = "scalars", "text"
#: More values than any reservoir keeps: every kept value of a tag is read.
ALL_VALUES = 1 << 30
#: Tags of the every-step series (``spikes=``), which :attr:`Run.series` holds.
_SERIES = (f"{Root.STEP}/", f"{Root.SPIKE}/")


@dataclass(frozen=True)
class Model:
    """One logger's tags in one TensorBoard run: ``run`` is the run's name, ``prefix`` the logger's
    ``prefix=`` (``""`` for none), ``tags`` its scalar tags as TensorBoard names them (with the prefix)."""

    run: str
    prefix: str
    tags: tuple[str, ...]
    #: ``(max step, max wall time)`` over its tags: changes whenever TensorBoard loads more of it.
    version: tuple[int, float]
    #: The value tables it holds with their rows' names (``health/attention_heads``,
    #: ``health/numerics``), without the prefix.
    tables: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        """The run's name, then the prefix in brackets (as ``tblog-hooks report`` names it)."""
        return f"{self.run} [{self.prefix}]" if self.prefix else self.run

    def full(self, tag: str) -> str:
        """The tag as TensorBoard names it: under the prefix."""
        return f"{self.prefix}/{tag}" if self.prefix else tag

    def roots(self) -> list[str]:
        """The ``root/stat`` of each of its per-module (or per-parameter) scalar tags, sorted."""
        found = {t.rsplit("/", 1)[0] for t in map(self.own, self.tags) if t.startswith(_NAMED) and t.count("/") == 2}
        return sorted(found)

    def own(self, full: str) -> str:
        """A tag of this model without its prefix."""
        return full[len(self.prefix) + 1 :] if self.prefix else full


_NAMED = tuple(f"{root}/" for root in NAMED_ROOTS)


@dataclass(frozen=True)
class Analysis:
    """A model's whole run and its findings, as ``tblog-hooks report --json`` gives them
    (``kind``, ``module``, ``step``, ``value``, ``message``; NaN/Inf values are ``None``)."""

    run: Run
    findings: list[dict[str, Any]]


class Source:
    """Reads through one TensorBoard data provider. Whole runs are cached until TensorBoard
    loads more of them."""

    def __init__(self, data_provider: provider.DataProvider) -> None:
        self._provider = data_provider
        self._runs: dict[tuple[str, str], tuple[tuple[int, float], Analysis]] = {}
        self._lock = threading.Lock()  # TensorBoard serves requests from several threads

    def models(self, ctx: Any, experiment_id: str, run: str | None = None) -> list[Model]:
        """The loggers whose tags the runs (or the one ``run``) hold, by run then prefix."""
        filter_ = None if run is None else provider.RunTagFilter(runs=[run])
        listing = self._provider.list_scalars(
            ctx, experiment_id=experiment_id, plugin_name=_SCALARS, run_tag_filter=filter_
        )
        tensors = self._provider.list_tensors(
            ctx, experiment_id=experiment_id, plugin_name=TABLE_PLUGIN, run_tag_filter=filter_
        )
        found = []
        for name, series in sorted(listing.items()):
            tables = [split for full in tensors.get(name, {}) if (split := split_prefix(full))]
            by_prefix: dict[str, dict[str, provider.ScalarTimeSeries]] = {}
            for full, meta in series.items():
                if split := split_prefix(full):
                    by_prefix.setdefault(split[0], {})[split[1]] = meta
            for prefix, own in sorted(by_prefix.items()):
                if is_logged_step(own) or GRAD_NORM_TAG in own:
                    full_tags = tuple(f"{prefix}/{t}" if prefix else t for t in own)
                    version = (max(m.max_step for m in own.values()), max(m.max_wall_time for m in own.values()))
                    held = {t for p, t in tables if p == prefix}
                    with_rows = frozenset(t for t in held if rows_tag(t) in held)
                    found.append(Model(name, prefix, full_tags, version, with_rows))
        return found

    def read(self, ctx: Any, experiment_id: str, model: Model, tags: list[str]) -> dict[str, dict[int, float]]:
        """``{tag: {step: value}}`` of the model's ``tags`` (as TensorBoard names them)."""
        return {tag: {d.step: d.value for d in points} for tag, points in self._points(ctx, experiment_id, model, tags)}

    def _points(
        self, ctx: Any, experiment_id: str, model: Model, tags: list[str]
    ) -> Iterable[tuple[str, list[provider.ScalarDatum]]]:
        data = self._provider.read_scalars(
            ctx,
            experiment_id=experiment_id,
            plugin_name=_SCALARS,
            downsample=ALL_VALUES,
            run_tag_filter=provider.RunTagFilter(runs=[model.run], tags=tags),
        )
        return data.get(model.run, {}).items()  # type: ignore[no-any-return]

    def order(self, ctx: Any, experiment_id: str, model: Model) -> list[str]:
        """The forward order the logger wrote last (``health/forward_order``); empty without one."""
        text_tag = f"{model.full(ORDER_TAG)}/text_summary"
        points = self._tensors(ctx, experiment_id, model, _TEXT, [text_tag]).get(text_tag, [])
        if not points:
            return []
        value = max(points, key=lambda d: (d.step, d.wall_time)).numpy.ravel()
        return parse_order(value[0].decode("utf-8", "replace")) if value.size else []

    def table(self, ctx: Any, experiment_id: str, model: Model, table: str) -> dict[int, tuple[list[str], np.ndarray]]:
        """``{step: (module names, values)}`` of a value table (``health/attention_heads``): every
        step TensorBoard kept of both the table and its rows' names (the latest write of a step)."""
        tags = [model.full(table), model.full(rows_tag(table))]
        data = self._tensors(ctx, experiment_id, model, TABLE_PLUGIN, tags)
        values = {d.step: d.numpy for d in data.get(tags[0], [])}
        names = {d.step: [unescape(n.decode("utf-8")) for n in d.numpy.ravel()] for d in data.get(tags[1], [])}
        return {s: (names[s], values[s]) for s in sorted(values) if s in names}

    def _tensors(
        self, ctx: Any, experiment_id: str, model: Model, plugin: str, tags: list[str]
    ) -> dict[str, list[provider.TensorDatum]]:
        """Every kept point of the model's tensor ``tags`` of ``plugin``."""
        data = self._provider.read_tensors(
            ctx,
            experiment_id=experiment_id,
            plugin_name=plugin,
            downsample=ALL_VALUES,
            run_tag_filter=provider.RunTagFilter(runs=[model.run], tags=tags),
        )
        return data.get(model.run, {})  # type: ignore[no-any-return]

    def analysis(self, ctx: Any, experiment_id: str, model: Model) -> Analysis:
        """The model's whole run (its logged steps, every-step series and forward order) and its findings."""
        key = (model.run, model.prefix)
        with self._lock:
            cached = self._runs.get(key)
        if cached is not None and cached[0] == model.version:
            return cached[1]
        by_step: dict[int, dict[str, float]] = {}
        series: dict[int, dict[str, float]] = {}
        for full, points in self._points(ctx, experiment_id, model, list(model.tags)):
            own = model.own(full)
            into = series if own.startswith(_SERIES) else by_step
            for d in points:
                into.setdefault(d.step, {})[own] = d.value
        scalars = {step: by_step[step] for step in sorted(by_step) if is_logged_step(by_step[step])}
        run = Run(model.run, model.prefix, scalars, [], series={s: series[s] for s in sorted(series)})
        run.order = forward_order(self.order(ctx, experiment_id, model), scalars)
        analysis = Analysis(run, as_json(run)["findings"])  # type: ignore[index]
        with self._lock:
            self._runs[key] = (model.version, analysis)
        return analysis


def in_forward_order(names: Iterable[str], order: list[str]) -> list[str]:
    """``names`` (of modules or parameters) in forward order (see
    :func:`~tblog_hooks.diagnostics.replay.forward_key`)."""
    return sorted(names, key=forward_key(order))


def names_of(model: Model, root: str) -> dict[str, str]:
    """``{tag: name}`` of the model's tags ``root/{name}`` (tags as TensorBoard names them)."""
    start = f"{model.full(root)}/"
    return {t: unescape(t[len(start) :]) for t in model.tags if t.startswith(start) and "/" not in t[len(start) :]}
