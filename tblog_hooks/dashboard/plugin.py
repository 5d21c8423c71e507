"""The "Model health" plugin: TensorBoard finds it through the ``tensorboard_plugins`` entry point
of this package and serves its routes under ``/data/plugin/tblog_hooks/``.

Routes (JSON, documented in ``docs/dashboard.md``): ``runs``, ``overview``, ``scales``, ``kinds``,
``heatmap?run=&tag=``, ``findings?run=``, ``modules?run=``, ``series?run=&module=``,
``spikes?run=``, ``heads?run=&step=``, ``numerics?run=&step=``, ``compare?run=&other=``; each
route of one run also takes ``prefix=`` (needed only when the run holds several loggers'
prefixes), and ``heatmap``, ``findings`` and ``series`` take ``format=csv`` or ``format=json`` for
a download. The page itself is the ES modules and the style sheet of ``static/`` (``index.js``
the one TensorBoard loads; docs/architecture.md lists them), each served under its own name.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from importlib import resources
from pathlib import PurePosixPath
from typing import Any

from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.context import RequestContext
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from ..diagnostics import compare
from ..diagnostics.compare import Tolerance
from ..stats.tags import HEADS_TABLE_TAG, NUMERICS_TABLE_TAG, TABLE_PLUGIN, split_prefix
from . import documents, downloads
from .analyses import Analyses, Analysis
from .source import DEFAULT_SCALARS_KEPT, Model, Source, names_of

PLUGIN_NAME = TABLE_PLUGIN
#: A step number as a query gives it: ASCII digits, optionally negative (``int()`` takes more).
_STEP = re.compile(r"-?[0-9]+")
#: The content type of each kind of file in ``static/`` that is served (no other file is).
_CONTENT_TYPES = {".js": "application/javascript", ".css": "text/css"}
#: The page's files, by route: every file of ``static/`` with one of those suffixes, under its name.
_STATIC = {
    f"/{file.name}": _CONTENT_TYPES[PurePosixPath(file.name).suffix]
    for file in resources.files(__package__).joinpath("static").iterdir()
    if file.is_file() and PurePosixPath(file.name).suffix in _CONTENT_TYPES
}

#: What TensorBoard serves a route with: a WSGI application.
WSGIApp = Callable[[dict[str, Any], Any], Iterable[bytes]]
#: What a route of one model builds its document from: the request, its context, experiment and model.
Build = Callable[[wrappers.Request, Any, str, Model], object]


class HealthPlugin(base_plugin.TBPlugin):  # type: ignore[misc]
    """The "Model health" tab: active when a run holds this package's tags."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        kept = (context.sampling_hints or {}).get("scalars", DEFAULT_SCALARS_KEPT)
        self._source = Source(context.data_provider, kept)
        self._analyses = Analyses(self._source)

    def get_plugin_apps(self) -> dict[str, WSGIApp]:
        documents_of: dict[str, Build] = {
            "/heatmap": self._heatmap,
            "/findings": lambda request, ctx, eid, model: documents.findings(self._analyses.of(ctx, eid, model)),
            "/modules": lambda request, ctx, eid, model: documents.module_table(
                self._analyses.of(ctx, eid, model), model.histograms
            ),
            "/series": self._series,
            "/spikes": lambda request, ctx, eid, model: documents.spikes(self._analyses.of(ctx, eid, model)),
            "/heads": functools.partial(self._table, HEADS_TABLE_TAG),
            "/numerics": functools.partial(self._table, NUMERICS_TABLE_TAG),
            "/compare": self._compare,
        }
        apps = {path: _app(self._static) for path in _STATIC} | {"/runs": _app(self._runs)}
        apps["/overview"] = _app(self._overview)
        apps["/scales"] = _app(lambda request: _respond(request, documents.scales()))
        apps["/kinds"] = _app(lambda request: _respond(request, documents.kinds()))
        return apps | {path: _app(functools.partial(self._of_model, build)) for path, build in documents_of.items()}

    def is_active(self) -> bool:
        """Whether any run holds this package's tags (TensorBoard lists the tab as inactive otherwise)."""
        return bool(self._source.models(RequestContext(), ""))

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Model health")

    def _static(self, request: wrappers.Request) -> wrappers.Response:
        name = request.path.rsplit("/", 1)[-1]
        body = resources.files(__package__).joinpath("static", name).read_bytes()
        return _respond(request, body, _STATIC[f"/{name}"])

    def _runs(self, request: wrappers.Request) -> wrappers.Response:
        ctx, eid = _context(request)
        return _respond(request, [documents.run_entry(model) for model in self._source.models(ctx, eid)])

    def _overview(self, request: wrappers.Request) -> wrappers.Response:
        """Every run's findings counted, worst run first: each run judged (once per change of it);
        a run that cannot be judged gets its error in its row, the others their findings."""
        ctx, eid = _context(request)
        judged: list[tuple[Model, Analysis | Exception]] = []
        for model in self._source.models(ctx, eid):
            try:
                judged.append((model, self._analyses.of(ctx, eid, model)))
            except Exception as error:
                judged.append((model, error))
        return _respond(request, documents.overview(judged))

    def _of_model(self, build: Build, request: wrappers.Request) -> wrappers.Response:
        """A route of one run's model: ``run=`` and ``prefix=`` choose it (see :meth:`_model`);
        ``format=csv`` or ``format=json`` (``heatmap``, ``findings``, ``series``) make its answer a
        file to download (see :mod:`.downloads`)."""
        ctx, eid = _context(request)
        route, fmt = request.path.rsplit("/", 1)[-1], request.args.get("format")
        if fmt is not None and (route not in downloads.TABLES or fmt not in downloads.FORMATS):
            raise errors.InvalidArgumentError(
                f"format={fmt!r} is not a download of {route}: format= is one of {', '.join(downloads.FORMATS)},"
                f" for the routes {', '.join(downloads.TABLES)}"
            )
        model = self._model(request, ctx, eid)
        doc = build(request, ctx, eid, model)
        if fmt is None:
            return _respond(request, doc)
        detail = request.args.get("tag", request.args.get("module", ""))
        response = (
            _respond(request, doc) if fmt == "json" else _respond(request, downloads.csv_table(route, doc), "text/csv")
        )
        name = downloads.file_name(route, model.run, model.prefix, detail, fmt)
        response.headers["Content-Disposition"] = f'attachment; filename="{name}"'
        return response

    def _model(
        self, request: wrappers.Request, ctx: Any, eid: str, which: tuple[str, str] = ("run", "prefix")
    ) -> Model:
        """The model ``run=`` names; its prefix is ``prefix=``, else the one a prefixed ``tag=``
        names, else the run's only one (``which``: other arguments than ``run=`` and ``prefix=``,
        whose prefix is ``prefix=`` when not given)."""
        run = _argument(request, which[0])
        models = {m.prefix: m for m in self._source.models(ctx, eid, run)}
        if not models:
            raise errors.NotFoundError(f"run {run!r} holds no tblog_hooks tags")
        prefix = request.args.get(which[1], request.args.get("prefix"))
        if prefix is None and (root := request.args.get("tag")) and (split := split_prefix(f"{root}/x")):
            prefix = split[0] if split[0] in models else None
        if prefix is None and len(models) == 1:
            prefix = next(iter(models))
        if prefix not in models:
            held = ", ".join(repr(p) for p in models)
            raise errors.InvalidArgumentError(f"run {run!r} holds the prefixes {held}: pass prefix= (got {prefix!r})")
        return models[prefix]

    def _heatmap(self, request: wrappers.Request, ctx: Any, eid: str, model: Model) -> object:
        root = _argument(request, "tag")
        split = split_prefix(f"{root}/x")
        if split is None or split[1].count("/") != 2:
            raise errors.InvalidArgumentError(f"tag={root!r} is not a tag root of a module statistic (gradient/norm)")
        root = split[1].rsplit("/", 1)[0]
        tags = list(names_of(model, root))
        if not tags:
            held = ", ".join(documents.roots(model))
            raise errors.InvalidArgumentError(f"{model.name!r} holds no {root}/{{module}} scalars; it holds {held}")
        values = self._source.read(ctx, eid, model, tags)
        return documents.heatmap(model, root, values, self._source.order(ctx, eid, model), self._source.scalars_kept)

    def _table(self, table: str, request: wrappers.Request, ctx: Any, eid: str, model: Model) -> object:
        """A value table at ``step=`` (the latest without it)."""
        if table not in model.tables:
            raise errors.NotFoundError(f"{model.name!r} holds no {table} (written with attention= or numerics=)")
        step = request.args.get("step")
        if step is not None and not _STEP.fullmatch(step):
            raise errors.InvalidArgumentError(f"step={step!r} is not a step number (an integer such as 40)")
        chosen = None if step is None else int(step)
        doc = documents.value_table(model, table, self._source.table(ctx, eid, model, table), chosen)
        if chosen is not None and chosen not in doc["steps"]:
            raise errors.NotFoundError(
                f"{model.name!r} holds no {table} at step {chosen}; it holds steps {doc['steps']}"
            )
        return doc

    def _compare(self, request: wrappers.Request, ctx: Any, eid: str, model: Model) -> object:
        """``tblog-hooks compare --json`` of the model and the one ``other=`` and ``other_prefix=`` name."""
        other = self._model(request, ctx, eid, ("other", "other_prefix"))
        try:
            tolerance = Tolerance(**{k: float(request.args[k]) for k in ("rtol", "atol") if k in request.args})
            a, b = (self._analyses.of(ctx, eid, m).run for m in (model, other))
            return compare.as_json(compare.compare(a, b, tolerance))
        except ValueError as error:
            raise errors.InvalidArgumentError(f"rtol= and atol= are numbers ({error})") from None
        except compare.CompareError as error:
            raise errors.InvalidArgumentError(str(error)) from None

    def _series(self, request: wrappers.Request, ctx: Any, eid: str, model: Model) -> object:
        module, analysis = _argument(request, "module"), self._analyses.of(ctx, eid, model)
        series = documents.module_series(analysis, module)
        if not series["series"] and module not in analysis.run.order:
            raise errors.NotFoundError(f"{model.name!r} holds no statistics of a module {module!r}")
        return series


def _app(handler: Callable[[wrappers.Request], wrappers.Response]) -> WSGIApp:
    return wrappers.Request.application(handler)


def _respond(request: wrappers.Request, body: object, content_type: str = "application/json") -> wrappers.Response:
    """TensorBoard's response (gzipped where the client accepts it). The documents are valid JSON as
    built (see :mod:`.documents`), so they are encoded as they are: TensorBoard's own encoder first
    walks every value in Python, which takes longer than the read for a heatmap of 150,000 cells."""
    if content_type == "application/json":
        body = json.dumps(body, allow_nan=False)
    response: wrappers.Response = http_util.Respond(request, body, content_type)
    return response


def _context(request: wrappers.Request) -> tuple[Any, str]:
    return plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)


def _argument(request: wrappers.Request, name: str) -> str:
    value = request.args.get(name)
    if value is None:
        raise errors.InvalidArgumentError(f"missing {name}=")
    return str(value)
