"""This package's runs as TensorBoard's data provider serves them: which runs (and prefixes) hold
its tags, and the values of their tags (what a run means is :mod:`~tblog_hooks.diagnostics.replay`'s).

TensorBoard keeps a reservoir of each scalar tag (1,000 values unless ``--samples_per_plugin
scalars=N`` says otherwise, ``0`` for every value); every value it kept is read, never fewer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensorboard.data import provider

from .._tensorboard_compat import Column, read_scalar_columns
from ..diagnostics.replay import forward_key, is_logged_step
from ..stats.tags import (
    GRAD_NORM_TAG,
    HISTOGRAM_KINDS,
    NAMED_ROOTS,
    ORDER_TAG,
    TABLE_PLUGIN,
    read_order,
    rows_tag,
    split_prefix,
    tensor_names,
    unescape,
)

_SCALARS, _TEXT, _HISTOGRAMS = "scalars", "text", "histograms"
#: More values than any reservoir keeps: every kept value of a tag is read.
ALL_VALUES = 1 << 30
#: How many values of a scalar tag TensorBoard keeps without ``--samples_per_plugin scalars=N``.
DEFAULT_SCALARS_KEPT = 1000


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
    #: The modules and parameters it holds histograms of (``activation/{name}``, ``param/{name}``, ...).
    histograms: frozenset[str] = frozenset()

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


class Source:
    """Reads through one TensorBoard data provider, which keeps ``scalars_kept`` values of each
    scalar tag (``0``: every one)."""

    def __init__(self, data_provider: provider.DataProvider, scalars_kept: int = DEFAULT_SCALARS_KEPT) -> None:
        self._provider = data_provider
        self.scalars_kept = scalars_kept

    def models(self, ctx: Any, experiment_id: str, run: str | None = None) -> list[Model]:
        """The loggers whose tags the runs (or the one ``run``) hold, by run then prefix."""
        filter_ = None if run is None else provider.RunTagFilter(runs=[run])
        listing = self._provider.list_scalars(
            ctx, experiment_id=experiment_id, plugin_name=_SCALARS, run_tag_filter=filter_
        )
        tensors = self._provider.list_tensors(
            ctx, experiment_id=experiment_id, plugin_name=TABLE_PLUGIN, run_tag_filter=filter_
        )
        histograms = self._provider.list_tensors(
            ctx, experiment_id=experiment_id, plugin_name=_HISTOGRAMS, run_tag_filter=filter_
        )
        found = []
        for name, series in sorted(listing.items()):
            tables = [split for full in tensors.get(name, {}) if (split := split_prefix(full))]
            binned = [split for full in histograms.get(name, {}) if (split := _histogram_name(full))]
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
                    of = frozenset(n for p, n in binned if p == prefix)
                    found.append(Model(name, prefix, full_tags, version, with_rows, of))
        return found

    def read(self, ctx: Any, experiment_id: str, model: Model, tags: list[str]) -> dict[str, dict[int, float]]:
        """``{tag: {step: value}}`` of the model's ``tags`` (as TensorBoard names them)."""
        return {t: dict(zip(*column)) for t, column in self.columns(ctx, experiment_id, model, tags).items()}

    def columns(self, ctx: Any, experiment_id: str, model: Model, tags: list[str]) -> dict[str, Column]:
        """``{tag: (steps, values)}`` of the model's ``tags`` (as TensorBoard names them).

        TensorBoard's data server answers in columns, which its Python client turns into an object
        per value (seconds for the millions of a deep model's run): the columns are read as they
        come where the provider is that client (see :func:`~tblog_hooks._tensorboard_compat.read_scalar_columns`)."""
        columns = read_scalar_columns(self._provider, experiment_id, model.run, tags, _SCALARS, ALL_VALUES)
        if columns is not None:
            return columns
        run_tag_filter = provider.RunTagFilter(runs=[model.run], tags=tags)
        data = self._provider.read_scalars(
            ctx, experiment_id=experiment_id, plugin_name=_SCALARS, downsample=ALL_VALUES, run_tag_filter=run_tag_filter
        )
        points = data.get(model.run, {})
        return {t: ([d.step for d in series], [d.value for d in series]) for t, series in points.items()}

    def order(self, ctx: Any, experiment_id: str, model: Model) -> list[str]:
        """The forward order the logger wrote last (``health/forward_order``), or of a run written
        before it was a tensor, its text summary's; empty without one."""
        tag = model.full(ORDER_TAG)
        points = self._tensors(ctx, experiment_id, model, TABLE_PLUGIN, [tag]).get(tag)
        if points:
            return tensor_names(_latest(points).numpy)
        text_tag = f"{tag}/text_summary"
        points = self._tensors(ctx, experiment_id, model, _TEXT, [text_tag]).get(text_tag)
        if not points:
            return []
        text = _latest(points).numpy.ravel()
        return read_order(text[0].decode("utf-8", "replace")) if text.size else []

    def table(self, ctx: Any, experiment_id: str, model: Model, table: str) -> dict[int, tuple[list[str], np.ndarray]]:
        """``{step: (module names, values)}`` of a value table (``health/attention_heads``): every
        step TensorBoard kept of both the table and its rows' names (the latest write of a step)."""
        tags = [model.full(table), model.full(rows_tag(table))]
        data = self._tensors(ctx, experiment_id, model, TABLE_PLUGIN, tags)
        values = {d.step: d.numpy for d in data.get(tags[0], [])}
        names = {d.step: tensor_names(d.numpy) for d in data.get(tags[1], [])}
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


def _latest(points: list[provider.TensorDatum]) -> provider.TensorDatum:
    """The point of the latest step, of the latest write of that step."""
    return max(points, key=lambda d: (d.step, d.wall_time))


def _histogram_name(full: str) -> tuple[str, str] | None:
    """``(prefix, name)`` of a histogram tag ``[{prefix}/]{root}/{name}`` this package writes
    (:data:`~tblog_hooks.stats.tags.HISTOGRAM_KINDS`; names are escaped, so hold no ``/``), else ``None``."""
    head, slash, name = full.rpartition("/")
    prefix, _, root = head.rpartition("/")
    return (prefix, unescape(name)) if slash and root in HISTOGRAM_KINDS else None


def in_forward_order(names: Iterable[str], order: list[str]) -> list[str]:
    """``names`` (of modules or parameters) in forward order (see
    :func:`~tblog_hooks.diagnostics.replay.forward_key`)."""
    return sorted(names, key=forward_key(order))


def names_of(model: Model, root: str) -> dict[str, str]:
    """``{tag: name}`` of the model's tags ``root/{name}`` (tags as TensorBoard names them)."""
    start = f"{model.full(root)}/"
    return {t: unescape(t[len(start) :]) for t in model.tags if t.startswith(start) and "/" not in t[len(start) :]}
