"""What a view of the page shows, as a file to download: the ``heatmap``, ``findings`` and
``series`` documents as CSV (one table, as the view lays it out), or as the JSON the route gives.

Values in CSV are as in the documents (:mod:`.documents`): each float written so that it reads
back as the same number (``repr``), NaN and infinities as ``NaN``, ``Infinity`` and ``-Infinity``,
an empty cell where there is no value.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Callable, Iterable
from typing import Any

from ..diagnostics.findings import MEASURES, FindingKind
from ..stats.tags import escape

#: The formats a download is given in.
FORMATS = ("csv", "json")
#: Characters kept as they are in a download's file name (the others become ``_``).
_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def _cell(value: object) -> object:
    return "" if value is None else repr(value) if isinstance(value, float) else value


def _heatmap(doc: dict[str, Any]) -> Iterable[list[object]]:
    """A row per module, a column per step, as the heatmap draws them."""
    yield ["module", *doc["steps"]]
    for module, row in zip(doc["modules"], doc["values"], strict=True):
        yield [module, *map(_cell, row)]


def _findings(doc: list[dict[str, Any]]) -> Iterable[list[object]]:
    """A row per finding, with what its value is (its kind's :data:`MEASURES` label)."""
    yield ["kind", "step", "module", "value", "value_is", "message"]
    for f in doc:
        yield [
            f["kind"],
            f["step"],
            f["module"],
            _cell(f["value"]),
            MEASURES[FindingKind(f["kind"])].label,
            f["message"],
        ]


def _series(doc: dict[str, Any]) -> Iterable[list[object]]:
    """A row per logged step, a column per statistic of the module and its parameters, named as
    its tag (without the logger's prefix): ``gradient/norm/{module}``, ``param_grad/norm/{module}.weight``."""
    yield ["step", *(f"{s['stat']}/{escape(s['name'])}" for s in doc["series"])]
    for i, step in enumerate(doc["steps"]):
        yield [step, *(_cell(s["values"][i]) for s in doc["series"])]


#: The CSV table of each route's document that can be downloaded.
TABLES: dict[str, Callable[[Any], Iterable[list[object]]]] = {
    "heatmap": _heatmap,
    "findings": _findings,
    "series": _series,
}


def file_name(route: str, run: str, prefix: str, detail: str, fmt: str) -> str:
    """``{run}[_{prefix}]_{route}[_{detail}].{fmt}``, with only safe characters (``detail``: the
    statistic of a heatmap, the module of a series)."""
    parts = [run, prefix, route, detail]
    return "_".join(_NAME.sub("_", p).strip("_") or "_" for p in parts if p) + f".{fmt}"


def csv_table(route: str, doc: Any) -> str:
    """The document ``doc`` of ``route`` (one of :data:`TABLES`) as CSV."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(TABLES[route](doc))
    return out.getvalue()
