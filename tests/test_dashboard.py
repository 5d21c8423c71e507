"""The "Model health" plugin in a real TensorBoard server: found through its entry point, active only
with this package's tags, and its JSON routes give exactly what ``EventAccumulator`` reads back and
the findings ``tblog-hooks report --json`` gives."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import math
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from graphlib import CycleError, TopologicalSorter
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import health_runs
import numpy as np
import pytest
import torch
from conftest import (
    ORDER_COPIES,
    TENSORBOARD_READY_S,
    get,
    read_run,
    read_tags,
    read_tensors,
    tensorboard,
    wait_until_loaded,
    without_tags,
    written_order,
)
from models import OutOfOrder, out_of_order_run
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.context import RequestContext
from tensorboard.plugins import base_plugin
from torch.utils.tensorboard import SummaryWriter
from werkzeug.test import Client

from tblog_hooks import HookLogger
from tblog_hooks.cli import report
from tblog_hooks.dashboard import analyses, documents
from tblog_hooks.dashboard.documents import SEVERITY
from tblog_hooks.dashboard.plugin import HealthPlugin
from tblog_hooks.dashboard.source import Source
from tblog_hooks.diagnostics import gradient_rules, replay
from tblog_hooks.diagnostics.findings import FINDING_KINDS, MEASURES, Thresholds, log
from tblog_hooks.diagnostics.health import default_health
from tblog_hooks.diagnostics.replay import owner
from tblog_hooks.stats.tags import (
    HEADS_TABLE_TAG,
    NUMERICS_TABLE_TAG,
    Lost,
    Stat,
    escape,
    rows_tag,
    scale_of,
    split_prefix,
    unescape,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="stops the server's process group (POSIX)")
ROUTE = "/data/plugin/tblog_hooks"


def error(url: str, path: str, **query: str) -> tuple[int, str]:
    with pytest.raises(urllib.error.HTTPError) as raised:
        get(url, path, **query)
    return raised.value.code, raised.value.read().decode()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dashboard") / "runs"
    health_runs.write_all(path)
    return path


@pytest.fixture(scope="module")
def server(logdir: Path) -> Iterator[str]:
    # More than the default 1,000 scalars per tag, so that the run "long" is kept whole.
    with tensorboard(logdir, "--samples_per_plugin", f"scalars={2 * health_runs.LONG_STEPS}") as url:
        wait_until_loaded(url, logdir)
        yield url


def reference(logdir: Path, run: str, prefix: str) -> tuple[dict[str, dict[int, float]], list[str]]:
    """The model's scalars (``{tag without prefix: {step: value}}``) as ``EventAccumulator`` reads
    them, and its forward order as written."""
    scalars = {}
    for full, values in read_run(logdir / run).scalars.items():
        if (split := split_prefix(full)) and split[0] == prefix:
            scalars[split[1]] = values
    return scalars, written_order(logdir / run, prefix)


def same(served: object, value: float | None) -> bool:
    """Whether ``served`` is ``value`` as TensorBoard's JSON writes it (NaN and infinities as strings)."""
    if value is None or math.isfinite(value):
        return served == value
    return served == ("NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity")


def test_the_entry_point_names_the_plugin() -> None:
    (point,) = entry_points(group="tensorboard_plugins", name="tblog_hooks")
    assert point.load() is HealthPlugin


def test_tensorboard_lists_the_tab_active(server) -> None:
    listing = get(server, "/data/plugins_listing")["tblog_hooks"]  # type: ignore[index]
    assert listing["enabled"] is True and listing["tab_name"] == "Model health"
    assert listing["loading_mechanism"] == {"type": "IFRAME", "module_path": f"{ROUTE}/index.js"}


#: The tab's files, which the plugin serves under its route, and the content type of each kind.
STATIC = Path(documents.__file__).with_name("static")
STATIC_TYPES = {".js": "application/javascript", ".css": "text/css"}
#: What an ES module imports: ``import ... from '...'``, ``export ... from '...'``, ``import '...'``, ``import('...')``.
_JS_IMPORT = re.compile(r"""\b(?:from|import)\s*\(?\s*(['"])([^'"]+)\1""")


def _js_imports(path: Path) -> set[str]:
    """The URL paths the module at ``path`` imports, resolved as the browser does from its own URL
    (``{ROUTE}/{its name}``): statically and with ``import()``."""
    text = path.read_text(encoding="utf-8")
    return {urllib.parse.urljoin(f"{ROUTE}/{path.name}", spec) for _, spec in _JS_IMPORT.findall(text)}


def test_the_tabs_modules_import_without_circles_and_are_all_served(tmp_path) -> None:
    graph = {f"{ROUTE}/{path.name}": _js_imports(path) for path in STATIC.glob("*.js")}
    assert any(f"{ROUTE}/compare.js" in imported for imported in graph.values())  # import() is read too
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as circle:
        pytest.fail(f"import circle: {' -> '.join(circle.args[1])}")
    plugin = _plugin(tmp_path)
    apps = plugin.get_plugin_apps()
    files = {f"/{path.name}": path for path in STATIC.iterdir() if path.suffix in STATIC_TYPES}
    # The plugin serves every file of static/, each as it is, and no other file of the package.
    assert {route for route in apps if "." in route} == set(files)
    for route, path in files.items():
        served = _app(plugin, route).get(route)
        assert (served.status_code, served.mimetype) == (200, STATIC_TYPES[path.suffix]), route
        assert served.get_data() == path.read_bytes(), route
    # What the browser loads: the entry point and every module imported, each one of those files.
    loaded = {f"{ROUTE}{plugin.frontend_metadata().es_module_path}", *(url for urls in graph.values() for url in urls)}
    assert sorted(url for url in loaded if url.removeprefix(ROUTE) not in files) == []


def _provider(logdir: Path) -> data_provider.MultiplexerDataProvider:
    """TensorBoard's Python data provider over ``logdir`` (``tensorboard --load_fast=false``), loaded."""
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    return data_provider.MultiplexerDataProvider(multiplexer, str(logdir))


def _plugin(logdir: Path) -> HealthPlugin:
    return HealthPlugin(base_plugin.TBContext(data_provider=_provider(logdir), logdir=str(logdir)))


def test_the_forward_order_is_its_tensors_or_an_older_runs_texts(tmp_path) -> None:
    """Through TensorBoard's data provider: a run's forward order is its string tensor's, and of a
    run written before that tensor (its Markdown text alone) the text's; none without either."""
    out_of_order_run(tmp_path / "written")
    for run, dropped in ORDER_COPIES.items():
        without_tags(tmp_path / "written", tmp_path / run, *dropped)
    source = Source(_provider(tmp_path))
    orders = {m.run: source.order(RequestContext(), "", m) for m in source.models(RequestContext(), "")}
    forward = list(OutOfOrder.FORWARD)
    assert orders == {"none": [], "tensor": forward, "text": forward, "written": forward}


def test_the_plugin_is_inactive_without_this_packages_tags(tmp_path) -> None:
    health_runs.write_user_tags(tmp_path / "user")
    assert not _plugin(tmp_path).is_active()
    health_runs.write_long(tmp_path / "long")
    assert _plugin(tmp_path).is_active()


def test_runs_are_the_loggers_with_their_prefixes(server, logdir) -> None:
    runs = get(server, f"{ROUTE}/runs")
    assert [(r["run"], r["prefix"]) for r in runs] == health_runs.MODELS  # type: ignore[index, union-attr]
    net = next(r for r in runs if r["run"] == "net")  # type: ignore[index, union-attr]
    assert net["name"] == "net" and net["spikes"] is True
    assert net["stats"][:3] == ["gradient/norm", "activation/std", "activation/dead_frac"]
    assert {"attention/max_logit", "attention/entropy", "param_grad/norm", "param/update_ratio"} <= set(net["stats"])
    gan_g = next(r for r in runs if r["prefix"] == "G")  # type: ignore[index, union-attr]
    assert gan_g["name"] == "gan [G]" and gan_g["spikes"] is False


@pytest.mark.parametrize(("run", "prefix"), health_runs.MODELS)
def test_heatmaps_are_the_scalars(server, logdir, run, prefix) -> None:
    scalars, order = reference(logdir, run, prefix)
    entry = next(r for r in get(server, f"{ROUTE}/runs") if (r["run"], r["prefix"]) == (run, prefix))  # type: ignore[index, union-attr]
    roots = {t.rsplit("/", 1)[0] for t in scalars if t.count("/") == 2}
    assert set(entry["stats"]) == roots
    for root in roots:
        doc = get(server, f"{ROUTE}/heatmap", run=run, prefix=prefix, tag=root)
        names = {unescape(t.rsplit("/", 1)[1]): t for t in scalars if t.rsplit("/", 1)[0] == root}
        assert sorted(doc["modules"]) == sorted(names)  # type: ignore[index]
        watched = [m for m in doc["modules"] if m in order]  # type: ignore[index]
        assert watched == [m for m in order if m in names]  # modules in forward order
        assert doc["steps"] == sorted({s for t in names.values() for s in scalars[t]})  # type: ignore[index]
        for name, row in zip(doc["modules"], doc["values"]):  # type: ignore[index]
            expected = scalars[names[name]]
            assert all(same(v, expected.get(step)) for step, v in zip(doc["steps"], row)), (root, name)  # type: ignore[index]


def test_heatmap_rows_follow_the_forward_order(server, logdir) -> None:
    _, order = reference(logdir, "net", "")
    assert order == ["embed", "a/b c.qkv", "a/b c.out", "dead", "head"]
    assert get(server, f"{ROUTE}/heatmap", run="net", tag="gradient/norm")["modules"] == order  # type: ignore[index]
    params = get(server, f"{ROUTE}/heatmap", run="net", tag="param_grad/norm")["modules"]  # type: ignore[index]
    assert params == [f"{m}.{p}" for m in order for p in ("bias", "weight")]
    # The attention module is not watched itself: it comes before its first watched submodule.
    assert get(server, f"{ROUTE}/heatmap", run="net", tag="attention/max_logit")["modules"] == ["a/b c"]  # type: ignore[index]


def test_non_finite_values_are_served_as_tensorboard_writes_them(server, logdir) -> None:
    doc = get(server, f"{ROUTE}/heatmap", run="net", tag="activation/mean")
    row = doc["values"][doc["modules"].index("head")]  # type: ignore[index]
    written = read_run(logdir / "net").scalars["activation/mean/head"]
    assert row == ["NaN" if math.isnan(written[s]) else written[s] for s in doc["steps"]]  # type: ignore[index]
    assert "NaN" in row and any(isinstance(v, float) for v in row)  # the NaN from its step on


def _report(logdir: Path) -> dict[str, object]:
    cli = Path(sys.executable).with_name("tblog-hooks")
    lines = subprocess.run([str(cli), "report", "--json", str(logdir)], capture_output=True, text=True).stdout
    return {doc["run"]: doc for doc in map(json.loads, lines.splitlines())}


def _as_reported(findings: object) -> list[dict[str, object]]:
    """Served findings as ``report --json`` gives them: NaN and infinities there are ``null``."""
    return [{**f, "value": None if isinstance(f["value"], str) else f["value"]} for f in findings]  # type: ignore[attr-defined, index]


def test_findings_are_those_of_the_report(server, logdir) -> None:
    reported = _report(logdir)
    for run, prefix in health_runs.MODELS:
        name = f"{run} [{prefix}]" if prefix else run
        assert _as_reported(get(server, f"{ROUTE}/findings", run=run, prefix=prefix)) == reported[name]["findings"]  # type: ignore[index]
    kinds = {f["kind"] for f in reported["net"]["findings"]}  # type: ignore[index]
    assert {"dead_units", "vanishing_gradient", "nonfinite", "gradient_spike", "loss_spike"} <= kinds


def test_tensorboards_python_data_provider_gives_the_same_findings(logdir) -> None:
    """``tensorboard --load_fast=false`` serves runs from Python's multiplexer, not the data server."""
    source, reported = Source(_provider(logdir)), _report(logdir)
    models, judged = source.models(RequestContext(), ""), analyses.Analyses(source)
    assert [(m.run, m.prefix) for m in models] == health_runs.MODELS
    for model in models:
        served = documents.findings(judged.of(RequestContext(), "", model))
        assert _as_reported(served) == reported[model.name]["findings"]  # type: ignore[index]
    net = next(m for m in models if m.run == "net")
    assert net.tables == {HEADS_TABLE_TAG, NUMERICS_TABLE_TAG}
    for table in net.tables:
        served, written = source.table(RequestContext(), "", net, table), _written_table(logdir, table)
        assert served.keys() == written.keys()
        assert all(
            served[s][0] == written[s][0] and np.array_equal(served[s][1], written[s][1], equal_nan=True)
            for s in served
        )


def test_a_prefix_is_chosen_by_the_tag_or_the_runs_only_one(server) -> None:
    by_param = get(server, f"{ROUTE}/heatmap", run="gan", prefix="G", tag="gradient/norm")
    assert get(server, f"{ROUTE}/heatmap", run="gan", tag="G/gradient/norm") == by_param
    assert by_param["prefix"] == "G" and by_param["modules"] == ["0", "2"]  # type: ignore[index]
    code, message = error(server, f"{ROUTE}/findings", run="gan")
    assert code == 400 and "'D', 'G'" in message and "prefix=" in message
    assert get(server, f"{ROUTE}/findings", run="net") == get(server, f"{ROUTE}/findings", run="net", prefix="")


def test_bad_queries_get_clear_errors(server) -> None:
    assert error(server, f"{ROUTE}/heatmap", tag="gradient/norm") == (400, "Invalid argument: missing run=")
    code, message = error(server, f"{ROUTE}/heatmap", run="user", tag="gradient/norm")
    assert code == 404 and "'user' holds no tblog_hooks tags" in message
    code, message = error(server, f"{ROUTE}/heatmap", run="net", tag="gradient")
    assert code == 400 and "tag='gradient'" in message
    code, message = error(server, f"{ROUTE}/heatmap", run="gan", prefix="G", tag="attention/max_logit")
    assert code == 400 and "'gan [G]' holds no attention/max_logit/{module} scalars; it holds gradient/norm" in message
    code, message = error(server, f"{ROUTE}/series", run="net", module="nope")
    assert code == 404 and "'net' holds no statistics of a module 'nope'" in message


def test_every_step_series_are_read_whole(server, logdir) -> None:
    scalars, _ = reference(logdir, "long", "")
    doc = get(server, f"{ROUTE}/spikes", run="long")
    assert len(doc["grad_norm"]["steps"]) == health_runs.LONG_STEPS  # type: ignore[index]
    assert dict(zip(doc["grad_norm"]["steps"], doc["grad_norm"]["values"])) == scalars["step/grad_norm"]  # type: ignore[index]
    assert dict(zip(doc["loss"]["steps"], doc["loss"]["values"])) == scalars["step/loss"]  # type: ignore[index]


def test_spikes_are_the_series_and_the_spike_findings(server, logdir) -> None:
    scalars, _ = reference(logdir, "net", "")
    doc = get(server, f"{ROUTE}/spikes", run="net")
    assert doc["grad_norm"]["steps"] == sorted(scalars["step/grad_norm"])  # type: ignore[index]
    assert doc["loss"]["steps"] == sorted(scalars["step/loss"])  # type: ignore[index]
    assert all(
        same(v, scalars["step/grad_norm"][s]) for s, v in zip(doc["grad_norm"]["steps"], doc["grad_norm"]["values"])
    )  # type: ignore[index]
    assert [(f["kind"], f["step"]) for f in doc["spikes"]] == [("gradient_spike", 30), ("loss_spike", 30)]  # type: ignore[index]


def test_a_modules_series_are_its_scalars_and_its_parameters(server, logdir) -> None:
    scalars, _ = reference(logdir, "net", "")
    doc = get(server, f"{ROUTE}/series", run="net", module="a/b c.qkv")
    logged = sorted({s for t, v in scalars.items() if t.startswith("gradient/norm/") for s in v})
    assert doc["steps"] == logged  # type: ignore[index]
    served = {(s["stat"], s["name"]) for s in doc["series"]}  # type: ignore[index]
    named = {(t.rsplit("/", 1)[0], unescape(t.rsplit("/", 1)[1])): t for t in scalars if t.count("/") == 2}
    mine = {key: t for key, t in named.items() if key[1] in ("a/b c.qkv", "a/b c.qkv.weight", "a/b c.qkv.bias")}
    assert served == {key for key in mine if not key[0].startswith("spike/")}  # spike/* lies between logged steps
    assert {("gradient/norm", "a/b c.qkv"), ("param_grad/norm", "a/b c.qkv.weight")} <= served
    for s in doc["series"]:  # type: ignore[index]
        tag = mine[s["stat"], s["name"]]
        assert all(same(v, scalars[tag].get(step)) for step, v in zip(doc["steps"], s["values"]))  # type: ignore[index]


def test_the_module_table_is_worst_first_with_the_latest_values(server, logdir) -> None:
    scalars, _ = reference(logdir, "net", "")
    doc = get(server, f"{ROUTE}/modules", run="net")
    rows = doc["rows"]  # type: ignore[index]
    assert rows[0]["module"] == "head" and "nonfinite" in rows[0]["findings"]  # NaN/Inf is the worst
    dead = next(r for r in rows if r["module"] == "dead")
    assert "dead_units" in dead["findings"]
    assert same(
        dead["values"]["activation/dead_frac"],
        scalars["activation/dead_frac/dead"][max(scalars["activation/dead_frac/dead"])],
    )
    assert doc["stats"][0] == "gradient/norm"  # type: ignore[index]


def test_every_finding_kind_has_a_severity() -> None:
    assert sorted(SEVERITY) == sorted(FINDING_KINDS)


def test_every_finding_kind_says_what_its_value_is(server) -> None:
    measures = get(server, f"{ROUTE}/kinds")
    assert list(measures) == list(FINDING_KINDS)  # type: ignore[arg-type]
    assert measures == {str(k): {"label": m.label, "meaning": m.meaning} for k, m in MEASURES.items()}
    assert all(m["label"] and m["meaning"] for m in measures.values())  # type: ignore[union-attr, index]
    assert "ratio" in measures["vanishing_gradient"]["label"]  # type: ignore[index]


def test_the_overview_counts_each_runs_findings_worst_first(server, logdir) -> None:
    reported = _report(logdir)
    rows = get(server, f"{ROUTE}/overview")
    assert sorted(r["name"] for r in rows) == sorted(f"{r} [{p}]" if p else r for r, p in health_runs.MODELS)  # type: ignore[union-attr, index]
    for row in rows:  # type: ignore[union-attr]
        found = reported[row["name"]]["findings"]  # type: ignore[index]
        counts = {k: n for k in SEVERITY if (n := sum(f["kind"] == k for f in found))}
        assert (row["findings"], row["kinds"], list(row["kinds"])) == (len(found), counts, list(counts))  # type: ignore[index]
        assert row["worst"] == next(iter(counts), None)  # type: ignore[index]

    def rank(row: dict[str, Any]) -> tuple[int, int, str]:
        worst = min((SEVERITY.index(k) for k in row["kinds"]), default=len(SEVERITY))
        return worst, -row["findings"], row["name"]

    assert rows == sorted(rows, key=rank) and rows[0]["name"] == "net"  # type: ignore[arg-type, index]


def test_a_run_that_cannot_be_judged_says_why_in_its_overview_row(tmp_path, monkeypatch) -> None:
    """One run's analysis failing (here made to) leaves the overview of the others whole."""
    health_runs.write_net(tmp_path / "net")
    health_runs.write_gan(tmp_path / "gan")
    real = analyses.findings

    def findings(run):  # type: ignore[no-untyped-def]
        if run.label == "net":
            raise ValueError("a broken run")
        return real(run)

    monkeypatch.setattr(analyses, "findings", findings)
    answer = _app(_plugin(tmp_path), "/overview").get("/overview")
    assert answer.status_code == 200
    rows = json.loads(answer.get_data())
    assert rows[0] == {
        "run": "net", "prefix": "", "name": "net", "findings": None, "kinds": {}, "worst": None,
        "logged_steps": None, "sampled": False, "error": "ValueError: a broken run",
    }  # fmt: skip
    judged = {r["name"]: r for r in rows[1:]}
    assert set(judged) == {"gan [D]", "gan [G]"} and all(r["error"] is None for r in judged.values())
    for name, row in judged.items():
        assert row["findings"] == len(_report(tmp_path)[name]["findings"])  # type: ignore[index]


def test_a_module_row_says_whether_the_run_holds_its_histograms(tmp_path) -> None:
    """``histograms``: a histogram of the module or of one of its own parameters is in the run (the
    page's link to TensorBoard's Histograms tab is offered only then)."""
    health_runs.write_net(tmp_path / "net")
    model = health_runs.net()
    with HookLogger(model, log_dir=tmp_path / "plain", every=1, histograms=False) as hooks:
        model(torch.randn(4, 5, 6)).square().mean().backward()
        hooks.step()
    plugin = _plugin(tmp_path)
    for run in ("net", "plain"):
        rows = json.loads(_app(plugin, "/modules").get(f"/modules?run={run}").get_data())["rows"]
        modules = [r["module"] for r in rows]
        of: dict[str, set[str]] = {m: set() for m in modules}  # the module's own histograms and its parameters'
        for t in read_tags(tmp_path / run)["histograms"]:
            root, name = t.split("/")[0], unescape(t.rsplit("/", 1)[1])
            held = owner(name, modules) if root in ("param", "param_grad") else name
            if held in of:
                of[held].add(t)
        assert {r["module"]: r["histograms"] for r in rows} == {m: bool(of[m]) for m in modules}
        assert any(r["histograms"] for r in rows) == (run == "net"), run


def test_a_download_is_the_routes_document_as_a_file(server) -> None:
    query = urllib.parse.urlencode({"run": "gan", "prefix": "G", "tag": "gradient/norm", "format": "csv"})
    with urllib.request.urlopen(f"{server}{ROUTE}/heatmap?{query}", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/csv")
        assert response.headers["Content-Disposition"] == 'attachment; filename="gan_G_heatmap_gradient_norm.csv"'
        rows = response.read().decode().splitlines()
    doc = get(server, f"{ROUTE}/heatmap", run="gan", prefix="G", tag="gradient/norm")
    assert rows[0] == ",".join(["module", *map(str, doc["steps"])])  # type: ignore[index]
    assert [r.split(",")[0] for r in rows[1:]] == doc["modules"]  # type: ignore[index]
    code, message = error(server, f"{ROUTE}/heatmap", run="net", tag="gradient/norm", format="xlsx")
    assert code == 400 and "format='xlsx'" in message and "csv, json" in message
    code, message = error(server, f"{ROUTE}/modules", run="net", format="csv")
    assert code == 400 and "heatmap, findings, series" in message


def _written_table(logdir: Path, table: str) -> dict[int, tuple[list[str], np.ndarray]]:
    """``{step: (module names, values)}`` of a value table as ``EventAccumulator`` reads it back."""
    names = read_tensors(logdir / "net", rows_tag(table))
    values = read_tensors(logdir / "net", table)
    return {s: ([unescape(n.decode()) for n in names[s]], values[s]) for s in sorted(values)}


def test_the_runs_say_which_hold_the_value_tables(server) -> None:
    runs = {(r["run"], r["prefix"]): r for r in get(server, f"{ROUTE}/runs")}  # type: ignore[union-attr, index]
    assert (runs["net", ""]["heads"], runs["net", ""]["numerics"]) == (True, True)
    assert not any(runs[m]["heads"] or runs[m]["numerics"] for m in health_runs.MODELS if m != ("net", ""))
    code, message = error(server, f"{ROUTE}/heads", run="gan", prefix="G")
    assert code == 404 and "'gan [G]' holds no health/attention_heads" in message
    code, message = error(server, f"{ROUTE}/numerics", run="net", step="5")
    assert code == 404 and "holds no health/numerics at step 5" in message
    assert error(server, f"{ROUTE}/heads", run="net", step="x")[0] == 400
    for step in ("--5", "\u00b2", "+3", " 4"):  # int() takes some, isdigit() others
        code, message = error(server, f"{ROUTE}/numerics", run="net", step=step)
        assert code == 400 and f"step={step!r} is not a step number" in message, (step, message)


def test_the_heads_grid_is_each_heads_values_and_their_max_the_modules_scalar(server, logdir) -> None:
    scalars, _ = reference(logdir, "net", "")
    peaks, entropies = (
        scalars[f"attention/max_logit/{escape('a/b c')}"],
        scalars[f"attention/entropy/{escape('a/b c')}"],
    )
    written = _written_table(logdir, HEADS_TABLE_TAG)
    latest = get(server, f"{ROUTE}/heads", run="net")
    assert latest["steps"] == sorted(peaks) == sorted(written)  # type: ignore[index]
    assert latest["step"] == max(peaks) and latest["quantities"] == ["max_logit", "entropy"]  # type: ignore[index]
    for step in latest["steps"]:  # type: ignore[index]
        doc = get(server, f"{ROUTE}/heads", run="net", step=str(step))
        assert doc["modules"] == ["a/b c"] and doc["heads"] == 2  # type: ignore[index]
        values = np.array(doc["values"], dtype=np.float64)  # type: ignore[index]
        assert np.array_equal(values, written[step][1].astype(np.float64), equal_nan=True)
        assert values[0, :, 0].max() == peaks[step]  # float32 both: the max over heads is the module's
        assert values[0, :, 1].mean() == pytest.approx(entropies[step], rel=1e-5)  # every head has every query


def test_the_numerics_grid_holds_every_format_and_the_written_ones_are_the_scalars(server, logdir) -> None:
    scalars, order = reference(logdir, "net", "")
    written = _written_table(logdir, NUMERICS_TABLE_TAG)
    latest = get(server, f"{ROUTE}/numerics", run="net")
    assert latest["steps"] == sorted(written) and latest["step"] == max(written)  # type: ignore[index]
    assert latest["roots"] == ["activation", "gradient"] and latest["formats"] == ["fp16", "bf16", "e4m3", "e5m2"]  # type: ignore[index]
    assert latest["quantities"] == ["underflow", "overflow", "subnormal", "floor"]  # type: ignore[index]
    checked = 0
    for step in latest["steps"]:  # type: ignore[index]
        doc = get(server, f"{ROUTE}/numerics", run="net", step=str(step))
        assert doc["modules"] == written[step][0] == [m for m in order if m in doc["modules"]]  # type: ignore[index]
        for r, root in enumerate(doc["roots"]):  # type: ignore[index]
            for m, module in enumerate(doc["modules"]):  # type: ignore[index]
                for f, fmt in enumerate(doc["formats"]):  # type: ignore[index]
                    for q, lost in enumerate(doc["quantities"]):  # type: ignore[index]
                        served, value = doc["values"][r][m][f][q], float(written[step][1][r, m, f, q])  # type: ignore[index]
                        assert served == (None if math.isnan(value) else value)
                        if (tag := f"{root}/{lost}_{fmt}/{escape(module)}") in scalars and step in scalars[tag]:
                            assert served == scalars[tag][step], tag  # the written format's column
                            checked += 1
    assert checked >= 2 * 5 * 3  # bf16 (the format numerics=True writes on float32): every module, both roots


def _app(plugin: HealthPlugin, route: str) -> Any:
    """The WSGI application of one of the plugin's routes, under werkzeug's test client."""
    return Client(plugin.get_plugin_apps()[route])


def test_findings_give_non_finite_values_as_strings(tmp_path) -> None:
    with SummaryWriter(tmp_path / "inf") as writer:  # a parameter gradient that overflowed, nothing else
        for step in range(3):
            writer.add_scalar("gradient/norm/fc", 1.0, step)
            writer.add_scalar("param_grad/norm/fc.weight", math.inf if step == 2 else 1.0, step)
    found = json.loads(_app(_plugin(tmp_path), "/findings").get("/findings?run=inf").get_data())
    assert [(f["kind"], f["module"], f["step"], f["value"]) for f in found] == [
        ("nonfinite", "fc.weight", 2, "Infinity")
    ]
    assert _as_reported(found) == _report(tmp_path)["inf"]["findings"]  # type: ignore[index]


def test_a_run_is_judged_once_for_the_routes_that_ask_at_once(tmp_path, monkeypatch) -> None:
    health_runs.write_net(tmp_path / "net")
    plugin, judged = _plugin(tmp_path), []
    real = analyses.findings
    monkeypatch.setattr(analyses, "findings", lambda run: judged.append(run.label) or real(run))
    routes = ["/findings", "/modules", "/spikes", "/series", "/findings", "/modules"]
    with concurrent.futures.ThreadPoolExecutor(len(routes)) as pool:
        answers = list(pool.map(lambda r: _app(plugin, r).get(f"{r}?run=net&module=dead"), routes))
    assert [a.status_code for a in answers] == [200] * len(routes)
    assert judged == ["net"]
    assert answers[0].get_data() == answers[4].get_data()
    _app(plugin, "/findings").get("/findings?run=net")  # asked again, unchanged: not judged again
    assert judged == ["net"]


def test_runs_judged_at_once_get_their_findings_and_a_live_logger_keeps_logging(tmp_path, monkeypatch, caplog) -> None:
    """The server judges runs in threads of its own: a replay logs nothing, whatever another thread
    judges meanwhile, and the live logger's findings are logged while a replay runs."""
    health_runs.write_net(tmp_path / "net")
    health_runs.write_gan(tmp_path / "gan")
    runs = [report.load_all(tmp_path / "net", "net")[0], report.load_all(tmp_path / "gan", "gan")[0]]
    alone = [replay.findings(run) for run in runs]
    assert any(f.step > min(runs[0].scalars) for f in alone[0])  # some found after the first step
    inside, done = threading.Event(), threading.Event()
    real = gradient_rules.GradientRules.judge

    def judge(self, step, scalars, order, heads):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "first" and not inside.is_set():
            inside.set()  # the first replay waits inside its first step until the other is done
            assert done.wait(TENSORBOARD_READY_S)
        return real(self, step, scalars, order, heads)

    monkeypatch.setattr(gradient_rules.GradientRules, "judge", judge)
    caplog.set_level(logging.WARNING, logger=log.name)
    caplog.clear()  # (what the loggers writing the runs logged)
    found: dict[str, list[object]] = {}
    first = threading.Thread(target=lambda: found.setdefault("first", replay.findings(runs[0])), name="first")
    first.start()
    assert inside.wait(TENSORBOARD_READY_S)
    live = default_health(Thresholds())  # the live logger's, in a training thread
    assert live.update(7777, {"gradient/norm/body": 1e-9, "gradient/norm/head": 0.5}, ["body", "head"])
    found["second"] = replay.findings(runs[1])
    done.set()
    first.join()
    assert [found["first"], found["second"]] == alone
    assert [r.getMessage() for r in caplog.records] == [
        "tblog_hooks: step 7777: vanishing_gradient: " + live.started[0].message
    ]


def test_the_scales_are_the_statistics_declarations(server) -> None:
    scales = get(server, f"{ROUTE}/scales")
    assert scales["dead_frac"] == scales["zero_frac"] == "fraction"  # type: ignore[index]
    assert scales["norm"] == scales["update_ratio"] == scales["underflow_fp16"] == "log"  # type: ignore[index]
    assert scales["mean"] == scales["entropy"] == "linear"  # type: ignore[index]
    assert {k: v for k, v in scales.items() if k in set(Stat) | set(Lost)} == {  # type: ignore[union-attr]
        str(s): str(scale_of(s)) for s in [*Stat, *Lost]
    }
    held = {stat.split("/")[1] for r in get(server, f"{ROUTE}/runs") for stat in r["stats"]}  # type: ignore[union-attr, index]
    assert held <= set(scales)  # type: ignore[arg-type]


#: The flag docs/dashboard.md gives for reading every value of a run of up to 100,000 logged steps.
EVERY_VALUE = ("--samples_per_plugin", "scalars=100000,tblog_hooks=100000")


def test_the_documented_flag_keeps_every_value_and_the_page_says_when_a_sample_is_read(tmp_path) -> None:
    assert " ".join(EVERY_VALUE) in (Path(__file__).parents[1] / "docs" / "dashboard.md").read_text()
    logdir = tmp_path / "runs"
    health_runs.write_net(logdir / "net")
    with SummaryWriter(logdir / "many") as writer:  # more logged steps than TensorBoard keeps by default
        for step in range(1200):
            writer.add_scalar("gradient/norm/0", 1.0 + step % 3, step)
    tables = read_tensors(logdir / "net", HEADS_TABLE_TAG)
    assert len(tables) > 10  # more than TensorBoard keeps of a tensor tag by default
    with tensorboard(logdir, *EVERY_VALUE) as url:
        wait_until_loaded(url, logdir)
        assert get(url, f"{ROUTE}/heads", run="net")["steps"] == sorted(tables)  # type: ignore[index]
        doc = get(url, f"{ROUTE}/heatmap", run="many", tag="gradient/norm")
        assert len(doc["steps"]) == 1200 and doc["sampled"] is False  # type: ignore[index]
        assert get(url, f"{ROUTE}/modules", run="many")["sampled"] is False  # type: ignore[index]
    with tensorboard(logdir) as url:  # TensorBoard's defaults: 1,000 values of a scalar tag
        deadline = time.monotonic() + TENSORBOARD_READY_S
        while not any(r["run"] == "many" and r["max_step"] == 1199 for r in _runs(url)):
            assert time.monotonic() < deadline, "tensorboard did not load the run"
            time.sleep(0.5)
        doc = get(url, f"{ROUTE}/heatmap", run="many", tag="gradient/norm")
        assert len(doc["steps"]) == 1000 and doc["sampled"] is True  # type: ignore[index]
        modules = get(url, f"{ROUTE}/modules", run="many")
        assert modules["sampled"] is True and modules["logged_steps"] == 1000  # type: ignore[index]
        assert get(url, f"{ROUTE}/modules", run="net")["sampled"] is False  # type: ignore[index]


def _runs(url: str) -> list[dict[str, Any]]:
    try:
        return get(url, f"{ROUTE}/runs")  # type: ignore[return-value]
    except (urllib.error.URLError, ConnectionError):
        return []  # not listening yet
