"""The "Model health" tab in a real browser: Debian's chromium, headless, driven by playwright
(which downloads no browser). Without chromium or playwright these tests skip, except under
``CI=true``, where they must run."""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import health_runs
import pytest
from conftest import (
    TENSORBOARD_READY_S,
    get,
    read_run,
    read_tags,
    read_tensors,
    tensorboard,
    wait_until_loaded,
    written_order,
)
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks._compat import event_file_writer
from tblog_hooks.dashboard.documents import SEVERITY
from tblog_hooks.diagnostics.findings import FINDING_KINDS
from tblog_hooks.diagnostics.replay import owner
from tblog_hooks.stats.tags import HEADS_TABLE_TAG, NUMERICS_TABLE_TAG, escape, unescape

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="stops the server's process group (POSIX)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: Flags that let chromium run headless in a container, without a profile of its own.
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
LATER = 1000  # a step after the run's last
READY_MS = 60_000  # how long the page may take to show a run's findings and table on this shared machine
#: TensorBoard's auto-reload turned on as its settings dialog ("Reload data") keeps it: in its page's
#: localStorage, read when the page starts. Its period stays TensorBoard's default and least, 30 s.
AUTO_RELOAD = (
    "if (window.parent === window && localStorage.getItem('_tb_global_settings') === null)"
    " localStorage.setItem('_tb_global_settings', JSON.stringify({autoReload: true}))"
)
#: How long a tab may take to show what was written after it opened: two of TensorBoard's 30 s
#: reloads (the first may come before its server loaded the write), then the time to draw it.
FOLLOW_MS = 2 * 30_000 + READY_MS
WIDE_STEPS = 600  # the logged steps of the run "wide"
#: The steps at which the first module of "wide" has a vanishing gradient (a finding where each begins).
WIDE_VANISHING = {120, 121, 122, 380, 381, 540}


def _sync_playwright() -> Any:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    missing = [what for what, ok in (("chromium", CHROMIUM), ("playwright", sync_playwright)) if not ok]
    if missing:
        reason = f"no {' and no '.join(missing)} (apt-get install chromium; pip install playwright)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true runs the browser tests, but there is {reason}")
        pytest.skip(f"browser tests need Debian's chromium and the playwright package: {reason}")
    return sync_playwright


@pytest.fixture(scope="module")
def playwright_api() -> Any:
    """playwright's entry point; skips (fails under ``CI=true``) before any run is written without a browser."""
    return _sync_playwright()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dashboard_browser") / "runs"
    health_runs.write_net(path / "net")
    health_runs.write_gan(path / "gan")  # another run to compare with
    _write_norms(path / "wide", ["a", "b", "c", "d"], range(WIDE_STEPS), _wide_norm)
    return path


def _write_norms(run_dir: Path, modules: list[str], steps: Iterable[int], norm: Callable[[int, int], float]) -> None:
    """A run of the gradient norms ``norm(module's index, step)`` of ``modules`` (in forward order) at
    ``steps``: one event a step, as the logger writes a logged step."""
    with SummaryWriter(run_dir) as writer:
        for step in steps:
            norms = [
                Summary.Value(tag=f"gradient/norm/{escape(m)}", simple_value=norm(i, step))
                for i, m in enumerate(modules)
            ]
            event_file_writer(writer).add_summary(Summary(value=norms), global_step=step)


def _wide_norm(module: int, step: int) -> float:
    return 1e-6 if module == 0 and step in WIDE_VANISHING else 1.0 + 0.1 * module + 0.01 * (step % 7)


@pytest.fixture(scope="module")
def console() -> list[str]:
    """The errors the browser reported (console errors, uncaught exceptions, failed requests)."""
    return []


@pytest.fixture(scope="module")
def page(playwright_api, logdir, console) -> Iterator[Any]:
    with tensorboard(logdir) as url, playwright_api() as playwright:
        wait_until_loaded(url, logdir)
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            tab.on("console", lambda m: console.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: console.append(str(e)))
            tab.on("requestfailed", lambda r: console.append(f"{r.url}: {r.failure}"))
            tab.goto(f"{url}/#tblog_hooks")
            tab.frame_locator("iframe").locator("#modules table").wait_for(timeout=READY_MS)
            tab.frame_locator("iframe").locator("#run").select_option(label="net")  # the first is "gan [D]"
            tab.frame_locator("iframe").locator('#findings tr[data-module="dead"]').first.wait_for(timeout=READY_MS)
            yield tab
        finally:
            browser.close()


def frame(page: Any) -> Any:
    return page.frame_locator("iframe")


def health(page: Any, expression: str) -> Any:
    """``expression`` evaluated in the plugin's frame, where ``page`` is the dashboard's state."""
    return frame(page).locator("body").evaluate(f"() => {{ const page = window.tblogHealth; return {expression}; }}")


def test_the_tab_is_listed_and_shows_the_run(page) -> None:
    assert page.get_by_text("Model health", exact=False).count() >= 1
    assert frame(page).locator("#run option").all_text_contents()[:3] == ["gan [D]", "gan [G]", "net"]
    assert frame(page).locator("#stat").input_value() == "gradient/norm"  # the first statistic offered


def test_the_heatmap_lists_the_modules_in_forward_order(page, logdir) -> None:
    assert health(page, "page.heatmap.doc.modules") == written_order(logdir / "net")
    assert written_order(logdir / "net") == ["embed", "a/b c.qkv", "a/b c.out", "dead", "head"]


def test_hovering_a_cell_shows_its_value(page, logdir) -> None:
    scalars = read_run(logdir / "net").scalars
    box = frame(page).locator("#heatmap canvas.cells").bounding_box()
    modules, steps = health(page, "page.heatmap.doc.modules"), health(page, "page.heatmap.doc.steps")
    norms = scalars[f"gradient/norm/{escape(modules[-1])}"]
    late = [s for s in steps if math.isfinite(norms.get(s, math.nan))][-1]  # (the NaN makes the last ones NaN)
    for module, step in [(modules[0], steps[0]), (modules[-1], late), (modules[2], steps[len(steps) // 2])]:
        centre = health(page, f"page.heatmap.centre({module!r}, {step})")
        page.mouse.move(box["x"] + centre["x"], box["y"] + centre["y"])
        tooltip = frame(page).locator("#tooltip")
        assert tooltip.is_visible()
        assert module in tooltip.inner_text() and f"step {step}" in tooltip.inner_text()
        assert float(tooltip.get_attribute("data-value")) == scalars[f"gradient/norm/{escape(module)}"][step]


def test_clicking_a_finding_selects_its_module_and_step(page) -> None:
    row = frame(page).locator('#findings tr[data-module="dead"]').first
    step = int(row.get_attribute("data-step"))
    row.click()
    selection = frame(page).locator("#selection")
    assert (selection.get_attribute("data-module"), selection.get_attribute("data-step")) == ("dead", str(step))
    assert health(page, "page.heatmap.selected") == {
        "row": health(page, "page.heatmap.doc.modules.indexOf('dead')"),
        "col": health(page, f"page.heatmap.doc.steps.indexOf({step})"),
    }
    frame(page).locator("#series .chart").first.wait_for()
    titles = frame(page).locator("#series .chart .title").all_text_contents()
    assert "gradient/norm" in titles and "activation/dead_frac" in titles and "param_grad/norm · weight" in titles


def test_a_modules_non_finite_steps_are_shown_in_its_series(page, logdir) -> None:
    _open(page, "net")
    frame(page).locator('#modules tbody tr[data-module="head"]').click()
    chart = frame(page).locator('#series .chart[data-stat="activation/mean"][data-name="head"] canvas')
    chart.wait_for(timeout=READY_MS)
    written = read_run(logdir / "net").scalars["activation/mean/head"]
    step = min(s for s, v in written.items() if math.isnan(v))
    chart.scroll_into_view_if_needed()
    box = chart.bounding_box()
    x = chart.evaluate(f"(c) => c.xOf({step})")
    page.mouse.move(box["x"] + x, box["y"] + box["height"] / 2)
    tooltip = frame(page).locator("#tooltip")
    assert f"step {step}: NaN" in tooltip.inner_text() and tooltip.get_attribute("data-value") == "NaN"


def test_the_spikes_and_attention_cards_show_what_the_run_holds(page) -> None:
    assert frame(page).locator("#spikes .chart .title").all_text_contents() == [
        "step/grad_norm · every step · spike steps marked",
        "step/loss · every step · spike steps marked",
    ]
    assert frame(page).locator("#attention .chart .title").all_text_contents() == [
        "attention/max_logit",
        "attention/entropy",
    ]


def _hover(page: Any, name: str, module: str, column: int) -> Any:
    """Hover the cell of ``module`` and ``column`` in the grid of the value table ``name``; the tooltip."""
    cells = frame(page).locator(f"#{name}-cells")
    cells.scroll_into_view_if_needed()
    box = cells.bounding_box()
    centre = health(page, f"page.tables.{name}.grid.centre({module!r}, {column})")
    page.mouse.move(box["x"] + centre["x"], box["y"] + centre["y"])
    tooltip = frame(page).locator("#tooltip")
    assert tooltip.is_visible()
    return tooltip


def test_hovering_a_cell_of_the_heads_grid_shows_the_heads_value_at_the_chosen_step(page, logdir) -> None:
    frame(page).locator("#heads-cells").wait_for(timeout=READY_MS)
    written = read_tensors(logdir / "net", HEADS_TABLE_TAG)
    steps = health(page, "page.tables.heads.doc.steps")
    assert steps == sorted(written) and frame(page).locator("#heads-step").input_value() == str(steps[-1])
    for step in (steps[-1], steps[0]):
        if str(step) != frame(page).locator("#heads-step").input_value():
            frame(page).locator("#heads-step").select_option(str(step))
            page.wait_for_function(
                f"() => document.querySelector('iframe').contentWindow.tblogHealth.tables.heads.doc.step === {step}"
            )
        tooltip = _hover(page, "heads", "a/b c", 1)
        assert (
            "a/b c" in tooltip.inner_text() and "head 1" in tooltip.inner_text() and "max_logit" in tooltip.inner_text()
        )
        assert float(tooltip.get_attribute("data-value")) == written[step][0, 1, 0]
    frame(page).locator("#heads-quantity").select_option("entropy")
    tooltip = _hover(page, "heads", "a/b c", 0)
    assert (
        "entropy" in tooltip.inner_text() and float(tooltip.get_attribute("data-value")) == written[steps[0]][0, 0, 1]
    )


def test_hovering_a_cell_of_the_numerics_grid_shows_the_modules_fraction_in_that_format(page, logdir) -> None:
    frame(page).locator("#numerics-cells").wait_for(timeout=READY_MS)
    written = read_tensors(logdir / "net", NUMERICS_TABLE_TAG)
    doc = health(page, "page.tables.numerics.doc")
    assert doc["step"] == max(written)
    columns = [(r, f) for r in range(len(doc["roots"])) for f in range(len(doc["formats"]))]
    frame(page).locator("#numerics-quantity").select_option("overflow")
    for module, column in [("embed", 0), ("dead", 5), ("head", 7)]:
        r, f = columns[column]
        tooltip = _hover(page, "numerics", module, column)
        text = tooltip.inner_text()
        assert module in text and f"{doc['roots'][r]} {doc['formats'][f]}" in text and "overflow" in text
        want = written[doc["step"]][r, doc["modules"].index(module), f, 1]
        assert float(tooltip.get_attribute("data-value")) == want


def test_the_module_table_sorts_by_a_column(page) -> None:
    first = frame(page).locator("#modules tbody tr").first
    assert first.get_attribute("data-module") == "head"  # the NaN/Inf: the worst health
    frame(page).locator("#modules th", has_text="module").click()  # forward order
    assert frame(page).locator("#modules tbody tr").first.get_attribute("data-module") == "embed"


def test_reload_reads_what_was_written_since(page, logdir) -> None:
    modules, steps = health(page, "page.heatmap.doc.modules"), health(page, "page.heatmap.doc.steps")
    frame(page).locator("#findings tr[data-module]").first.click()
    selected = health(page, "page.selection")
    with SummaryWriter(logdir / "net") as writer:  # a later logged step of every module
        for module in modules:
            writer.add_scalar(f"gradient/norm/{escape(module)}", 0.5, LATER)
    url = page.url.split("/#")[0]
    deadline = time.monotonic() + TENSORBOARD_READY_S
    while next(r["max_step"] for r in get(url, "/data/plugin/tblog_hooks/runs") if r["run"] == "net") != LATER:  # type: ignore[index, union-attr]
        assert time.monotonic() < deadline, "tensorboard did not load the later step"
        time.sleep(0.25)
    frame(page).get_by_role("button", name="Reload").click()
    frame(page).locator("#heatmap-title", has_text=f"\u00d7 {len(steps) + 1}").wait_for(timeout=READY_MS)
    assert health(page, "page.heatmap.doc.steps")[-1] == LATER
    assert health(page, "page.selection") == selected  # the selection is kept


def test_another_run_is_drawn_beside_on_the_same_colour_scale(page) -> None:
    frame(page).locator("#compare").select_option(label="gan [G]")
    frame(page).locator("#compare-title", has_text="gan [G] · gradient/norm").wait_for(timeout=READY_MS)
    assert health(page, "page.compare.doc.modules") == ["0", "2"]
    assert health(page, "page.compare.scale === page.heatmap.scale")
    lowest = health(page, "Math.min(...[...page.doc.values, ...page.compare.doc.values].flat().filter((v) => v > 0))")
    assert health(page, "page.heatmap.scale.lo") == pytest.approx(math.log10(lowest))
    frame(page).locator("#compare").select_option(label="—")
    frame(page).locator("#compare-card").wait_for(state="hidden", timeout=READY_MS)


def _wait(page: Any, condition: str, timeout: int = READY_MS) -> None:
    """Until ``condition`` (an expression of ``page``, the dashboard's state) holds in the plugin's frame."""
    frame_page = "document.querySelector('iframe').contentWindow.tblogHealth"
    page.wait_for_function(f"() => {{ const page = {frame_page}; return !!page && !!({condition}); }}", timeout=timeout)


def _open(page: Any, name: str) -> None:
    frame(page).locator("#run").select_option(label=name)
    _wait(page, f"page.model.name === {name!r} && page.analysis && !page.opening")


def test_a_selection_stays_only_where_the_run_has_its_module(page) -> None:
    _open(page, "net")
    frame(page).locator('#modules tbody tr[data-module="dead"]').click()
    assert frame(page).locator("#selection").inner_text() == "dead"  # a module chosen without a step
    _open(page, "gan [G]")  # modules "0" and "2": no "dead"
    assert frame(page).locator("#selection").inner_text() == "click a cell or a finding"
    assert health(page, "page.selection") is None and health(page, "page.heatmap.selected") is None
    frame(page).locator("#heatmap canvas.cells").hover()
    _open(page, "net")
    assert not frame(page).locator("#tooltip").is_visible()  # no tooltip outlives its chart


def test_the_compared_run_is_on_the_same_step_axis_with_its_findings(page) -> None:
    _open(page, "gan [G]")
    frame(page).locator("#compare").select_option(label="net")
    frame(page).locator("#compare-title", has_text="net · gradient/norm").wait_for(timeout=READY_MS)
    _wait(page, "page.compare.marks.length > 0")
    steps = health(page, "page.heatmap.doc.steps")
    assert health(page, "page.compare.doc.steps") == steps
    own = get(page.url.split("/#")[0], "/data/plugin/tblog_hooks/heatmap", run="gan", prefix="G", tag="gradient/norm")
    other = get(page.url.split("/#")[0], "/data/plugin/tblog_hooks/heatmap", run="net", tag="gradient/norm")
    assert steps == sorted(set(own["steps"]) | set(other["steps"]))  # type: ignore[index]
    row = health(page, "page.compare.doc.values[page.compare.doc.modules.indexOf('dead')]")
    written = dict(zip(other["steps"], other["values"][other["modules"].index("dead")]))  # type: ignore[index]
    assert row == [written.get(s) for s in steps]  # a column is one step in both
    findings = get(page.url.split("/#")[0], "/data/plugin/tblog_hooks/findings", run="net")
    assert health(page, "page.compare.marks") == findings
    frame(page).locator("#compare").select_option(label="—")
    _open(page, "net")


def test_heatmaps_read_while_tensorboard_reloads_are_drawn(page) -> None:
    # TensorBoard's auto-reload may list the runs anew while the heatmaps are read: the runs listed
    # then are new objects of the same runs, and what was being drawn is drawn all the same.
    _open(page, "gan [G]")
    frame(page).locator("#compare").select_option(label="—")
    frame(page).locator("#compare-card").wait_for(state="hidden", timeout=READY_MS)
    relisted = "page.listModels(page.models.map((m) => ({ ...m })))"  # what a reload finding nothing new lists
    health(
        page,
        "(async () => { page.toolbar.statSelect.value = 'activation/std';"
        " page.toolbar.compareSelect.value = String(page.models.findIndex((m) => m.name === 'net'));"
        f" const drawing = page.drawHeatmap(); {relisted}; await drawing; }})()",
    )
    assert health(page, "[page.heatmap.stat, page.compare.stat, page.compare.doc.modules.includes('dead')]") == [
        "activation/std",
        "activation/std",
        True,
    ]
    assert frame(page).locator("#compare-card").is_visible()
    # The run compared with itself is no comparison, reloaded or not.
    health(
        page,
        "(async () => { page.toolbar.compareSelect.value = page.toolbar.runSelect.value;"
        f" const drawing = page.drawHeatmap(); {relisted}; await drawing; }})()",
    )
    assert not frame(page).locator("#compare-card").is_visible()
    frame(page).locator("#stat").select_option("gradient/norm")
    _open(page, "net")


def test_a_finding_about_the_whole_model_marks_its_step(page) -> None:
    _open(page, "net")
    row = frame(page).locator('#findings tr[data-module=""]', has_text="loss_spike")
    step = int(row.get_attribute("data-step"))
    column = health(page, f"page.heatmap.column({step})")  # its own, or the first logged step after it
    assert health(page, "page.heatmap.doc.steps")[column] >= step and column in health(
        page, "page.heatmap.modelColumns()"
    )
    row.click()
    assert frame(page).locator("#selection").inner_text() == f"step {step} (whole model)"
    assert health(page, "page.heatmap.selected") == {"row": None, "col": column}


def test_findings_and_module_rows_are_chosen_with_the_keyboard(page) -> None:
    _open(page, "net")
    row = frame(page).locator('#findings tr[data-module="dead"]').first
    row.focus()
    page.keyboard.press("Enter")
    assert frame(page).locator("#selection").get_attribute("data-module") == "dead"
    page.keyboard.press("Tab")  # the next finding
    page.keyboard.press("Enter")
    assert health(page, "page.selection.module") == frame(page).locator("#findings tr.selected").get_attribute(
        "data-module"
    )
    frame(page).locator('#modules tbody tr[data-module="embed"]').focus()
    page.keyboard.press(" ")
    assert frame(page).locator("#selection").get_attribute("data-module") == "embed"


def test_the_filter_says_what_it_shows(page) -> None:
    _open(page, "net")
    frame(page).locator("#filter").fill("dead|head")
    frame(page).locator("#heatmap-title", has_text="2 of 5 \u00d7").wait_for(timeout=READY_MS)
    frame(page).locator("#filter").fill("(")
    frame(page).locator("#heatmap-title", has_text="invalid filter: every row shown").wait_for(timeout=READY_MS)
    assert "invalid" in frame(page).locator("#filter").get_attribute("class")
    frame(page).locator("#filter").fill("")
    frame(page).locator("#heatmap-title", has_text="gradient/norm · 5 \u00d7").wait_for(timeout=READY_MS)


def test_scales_come_from_the_servers_table_and_the_legend_ends_differ(page) -> None:
    _open(page, "net")
    frame(page).locator("#stat").select_option("activation/dead_frac")  # a fraction: linear from 0 to 1
    _wait(page, "page.heatmap.stat === 'activation/dead_frac'")
    assert health(page, "[page.heatmap.scale.log, page.heatmap.scale.lo, page.heatmap.scale.hi]") == [False, 0, 1]
    frame(page).locator("#stat").select_option("gradient/norm")
    _wait(page, "page.heatmap.stat === 'gradient/norm'")
    assert health(page, "page.heatmap.scale.log") is True
    for kind in ("log", "linear"):  # a range within the last digits of four
        labels = health(
            page, f"new page.heatmap.scale.constructor([[1.91712, 1.91718]], {kind!r}).ticks().map((t) => t[1])"
        )
        assert len(set(labels)) == len(labels), labels


def test_a_later_step_chosen_after_an_automatic_reload_is_drawn(page, logdir) -> None:
    _open(page, "net")
    frame(page).locator("#heads-cells").wait_for(timeout=READY_MS)
    steps = health(page, "page.tables.heads.doc.steps")
    with SummaryWriter(logdir / "net") as writer:  # the run grows
        writer.add_scalar("gradient/norm/embed", 0.25, LATER + 1)
    url = page.url.split("/#")[0]
    deadline = time.monotonic() + TENSORBOARD_READY_S
    while next(r["max_step"] for r in get(url, "/data/plugin/tblog_hooks/runs") if r["run"] == "net") != LATER + 1:  # type: ignore[index, union-attr]
        assert time.monotonic() < deadline, "tensorboard did not load the later step"
        time.sleep(0.25)
    health(page, "(page.openTook = 1e9, page.reload(false))")  # the automatic reload of a run slow to judge
    _wait(page, f"page.model.max_step === {LATER + 1}")
    frame(page).locator("#heads-step").select_option(str(steps[0]))
    _wait(page, f"page.tables.heads.doc.step === {steps[0]}")
    assert frame(page).locator("#heads-step").input_value() == str(steps[0])


def test_tensorboards_reload_shows_new_runs_and_steps(page, logdir) -> None:
    _open(page, "net")
    health_runs.write_gan(logdir / "late")  # a run started while the tab is open
    url = page.url.split("/#")[0]
    deadline = time.monotonic() + TENSORBOARD_READY_S
    # Both loggers of the run: each writes an event file of its own, which TensorBoard may load
    # in different passes.
    late = {("late", "G"), ("late", "D")}
    while not late <= {(r["run"], r["prefix"]) for r in get(url, "/data/plugin/tblog_hooks/runs")}:  # type: ignore[index, union-attr]
        assert time.monotonic() < deadline, "tensorboard did not load the later run"
        time.sleep(0.25)
    page.locator("app-header-reload button.reload-button").click()  # TensorBoard's own reload
    _wait(page, "[...page.toolbar.runSelect.options].some((o) => o.text === 'late [G]')")
    assert "late [D]" in frame(page).locator("#compare option").all_text_contents()
    assert health(page, "page.model.name") == "net"  # the run shown stays


def test_a_browser_reload_keeps_the_run_statistic_comparison_and_selection(page) -> None:
    _open(page, "gan [G]")
    frame(page).locator("#stat").select_option("activation/std")
    frame(page).locator("#compare").select_option(label="net")
    frame(page).locator('#modules tbody tr[data-module="2"]').click()
    assert "p.tblog_hooks.run=gan%20%5BG%5D" in page.url
    drawn = (
        "page.seriesCard.title.textContent === 'Module 2' && !page.opening && page.heatmap.stat === 'activation/std'"
        " && page.compare.stat === 'activation/std' && page.compare.marks.length && page.difference"
        " && page.requests.pending === 0"
    )
    _wait(page, drawn)  # drawn, and nothing in flight that the reload would abort
    page.reload()
    frame(page).locator("#modules table").wait_for(timeout=READY_MS)
    _wait(page, "page.analysis && page.selection")
    assert health(page, "[page.model.name, page.toolbar.statSelect.value, page.compareModel().name]") == [
        "gan [G]",
        "activation/std",
        "net",
    ]
    assert frame(page).locator("#selection").get_attribute("data-module") == "2"


def test_each_findings_value_says_what_it_is(page, logdir) -> None:
    _open(page, "net")
    url = page.url.split("/#")[0]
    measures = get(url, "/data/plugin/tblog_hooks/kinds")
    findings = get(url, "/data/plugin/tblog_hooks/findings", run="net")
    rows = frame(page).locator("#findings tbody tr")
    assert rows.count() == len(findings)  # type: ignore[arg-type]
    for i, finding in enumerate(findings):  # type: ignore[arg-type]
        cell = rows.nth(i).locator("td.value")
        measure = measures[finding["kind"]]  # type: ignore[index]
        assert (
            cell.locator(".unit").inner_text() == measure["label"] and cell.get_attribute("title") == measure["meaning"]
        )
    # A vanishing finding's value is the ratio its label says: the largest norm up to its module over the largest.
    vanishing = next(f for f in findings if f["kind"] == "vanishing_gradient")  # type: ignore[union-attr, index]
    scalars, order = read_run(logdir / "net").scalars, written_order(logdir / "net")
    norms = [scalars[f"gradient/norm/{escape(m)}"][vanishing["step"]] for m in order]
    upstream = max(norms[: order.index(vanishing["module"]) + 1])
    assert "ratio" in measures["vanishing_gradient"]["label"] and vanishing["value"] == upstream / max(norms)  # type: ignore[index]
    assert "differs by kind" in frame(page).locator("#findings th", has_text="value").get_attribute("title")
    # Every kind, as the table draws it: one finding of each.
    every = [{"kind": k, "module": "", "step": 0, "value": 0.5, "message": k} for k in FINDING_KINDS]
    health(page, f"(page.analysis = {{...page.analysis, findings: {every}}}, page.drawFindings(), 0)")
    labels = frame(page).locator("#findings tbody td.value .unit").all_text_contents()
    assert labels == [measures[k]["label"] for k in FINDING_KINDS]  # type: ignore[index]
    _open(page, "gan [G]")  # (the run's own findings again)


def _charts_opened(page: Any, link: Any) -> tuple[set[str], list[str]]:
    """Follow ``link`` (to a stock tab, in a browser tab of its own): the tags of the charts the
    stock tab shows under its tag filter, and the runs its run list shows."""
    with page.context.expect_page() as opened:
        link.click()
    shown = opened.value
    try:
        pane = shown.locator("tf-category-paginated-view").first  # "Tags matching" the filter
        pane.locator("tf-scalar-card, tf-histogram-loader").first.wait_for(timeout=READY_MS)
        tags = pane.evaluate("(e) => e.category.items.map((i) => i.tag)")
        runs = shown.locator("tf-multi-checkbox")  # the runs its run filter shows
        runs.locator("paper-checkbox").first.wait_for(timeout=READY_MS)
        return set(tags), runs.evaluate("(e) => e.namesMatchingRegex")
    finally:
        shown.close()


def test_a_finding_or_a_module_links_to_its_charts_in_tensorboards_own_tabs(page, logdir) -> None:
    _open(page, "net")
    written, order = read_tags(logdir / "net"), written_order(logdir / "net")

    def of(kind: str, module: str) -> set[str]:  # the module's tags and its own parameters'
        return {t for t in written[kind] if owner(unescape(t.rsplit("/", 1)[1]), order) == module}

    finding = frame(page).locator('#findings tr[data-module="dead"]').first
    assert _charts_opened(page, finding.locator('a[data-tab="scalars"]')) == (of("scalars", "dead"), ["net"])
    module = frame(page).locator('#modules tbody tr[data-module="a/b c.qkv"]')
    assert _charts_opened(page, module.locator('a[data-tab="histograms"]')) == (of("histograms", "a/b c.qkv"), ["net"])
    model = frame(page).locator('#findings tr[data-module=""]', has_text="loss_spike").locator('a[data-tab="scalars"]')
    assert _charts_opened(page, model)[0] == {t for t in written["scalars"] if t.startswith("step/")}
    frame(page).locator('#modules tbody tr[data-module="head"]').click()
    link = frame(page).locator('#series-links a[data-tab="scalars"]')
    assert _charts_opened(page, link) == (of("scalars", "head"), ["net"])
    _open(page, "gan [G]")  # a prefixed logger: its own tags only, not those of the other in the run
    g = {t for t in read_tags(logdir / "gan")["scalars"] if t.startswith("G/") and (t.endswith("/2") or "/2." in t)}
    assert _charts_opened(page, frame(page).locator('#modules tbody tr[data-module="2"] a[data-tab="scalars"]')) == (
        g,
        ["gan"],
    )


def _download(page: Any, selector: str) -> tuple[str, str]:
    """The text and file name of what the link at ``selector`` downloads."""
    with page.expect_download() as done:
        frame(page).locator(selector).click()
    return Path(done.value.path()).read_text(encoding="utf-8"), done.value.suggested_filename


def _same_cell(cell: str, value: float | None) -> bool:
    """Whether a downloaded CSV cell is ``value`` (empty: no value; ``NaN``, ``Infinity`` as written)."""
    if value is None or cell == "":
        return value is None and cell == ""
    return math.isnan(value) if cell == "NaN" else float(cell) == value


def test_what_a_view_shows_downloads_as_csv_and_json(page, logdir) -> None:
    _open(page, "net")
    frame(page).locator("#stat").select_option("gradient/norm")
    _wait(page, "page.heatmap.stat === 'gradient/norm'")
    scalars = read_run(logdir / "net").scalars
    text, name = _download(page, '.downloads[data-route="heatmap"] a[data-format="csv"]')
    rows = list(csv.reader(io.StringIO(text)))
    assert name == "net_heatmap_gradient_norm.csv" and rows[0][0] == "module"
    steps = [int(s) for s in rows[0][1:]]
    assert [r[0] for r in rows[1:]] == health(page, "page.doc.modules") and len(rows) > 2
    norms = {module: scalars[f"gradient/norm/{escape(module)}"] for module in (r[0] for r in rows[1:])}
    assert steps == sorted({s for written in norms.values() for s in written})  # a column per step any has
    for module, *cells in rows[1:]:
        assert all(_same_cell(c, norms[module].get(s)) for c, s in zip(cells, steps, strict=True))
    assert any(c == "NaN" for r in rows for c in r)  # the run's NaN, as the heatmap draws it
    text, name = _download(page, '.downloads[data-route="heatmap"] a[data-format="json"]')
    url = page.url.split("/#")[0]
    assert json.loads(text) == get(url, "/data/plugin/tblog_hooks/heatmap", run="net", tag="gradient/norm")
    # The findings table: those of the report (read from the event files), with what each value is.
    text, name = _download(page, '.downloads[data-route="findings"] a[data-format="csv"]')
    cli = Path(sys.executable).with_name("tblog-hooks")
    reported = json.loads(
        subprocess.run(
            [str(cli), "report", "--json", str(logdir / "net")], capture_output=True, text=True, check=True
        ).stdout
    )
    measures = get(url, "/data/plugin/tblog_hooks/kinds")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert name == "net_findings.csv" and len(rows) == len(reported["findings"]) > 0
    for row, f in zip(rows, reported["findings"], strict=True):
        assert (row["kind"], row["module"], int(row["step"]), row["message"]) == (
            f["kind"],
            f["module"],
            f["step"],
            f["message"],
        )
        assert row["value_is"] == measures[f["kind"]]["label"]  # type: ignore[index]
        assert _same_cell(row["value"], math.nan if f["value"] is None else f["value"])
    text, _ = _download(page, '.downloads[data-route="findings"] a[data-format="json"]')
    assert [{**f, "value": None if isinstance(f["value"], str) else f["value"]} for f in json.loads(text)] == reported[
        "findings"
    ]
    # A module's series: a column per tag of the module and its parameters.
    frame(page).locator('#modules tbody tr[data-module="dead"]').click()
    frame(page).locator('.downloads[data-route="series"] a[data-format="csv"]').wait_for(timeout=READY_MS)
    text, name = _download(page, '.downloads[data-route="series"] a[data-format="csv"]')
    rows = list(csv.reader(io.StringIO(text)))
    assert name == "net_series_dead.csv" and rows[0][0] == "step"
    order = written_order(logdir / "net")
    own = {t for t in scalars if t.count("/") == 2 and owner(unescape(t.rsplit("/", 1)[1]), order) == "dead"}
    assert set(rows[0][1:]) == {t for t in own if not t.startswith("spike/")}  # (every-step series: the spikes card's)
    for i, tag in enumerate(rows[0][1:], start=1):
        assert all(_same_cell(r[i], scalars[tag].get(int(r[0]))) for r in rows[1:])
    text, _ = _download(page, '.downloads[data-route="series"] a[data-format="json"]')
    assert json.loads(text) == get(url, "/data/plugin/tblog_hooks/series", run="net", module="dead")


def test_the_runs_overview_lists_each_runs_findings_worst_first_and_opens_one(page, logdir) -> None:
    _open(page, "gan [G]")
    cli = Path(sys.executable).with_name("tblog-hooks")
    lines = subprocess.run(
        [str(cli), "report", "--json", str(logdir)], capture_output=True, text=True, check=True
    ).stdout
    reported = {doc["run"]: doc["findings"] for doc in map(json.loads, lines.splitlines())}
    overview = frame(page).locator("#overview")
    overview.locator("tbody tr").first.wait_for(timeout=READY_MS)
    rows = overview.locator("tbody tr")
    names = [rows.nth(i).get_attribute("data-name") for i in range(rows.count())]
    assert sorted(names) == sorted(reported) and len(names) >= 3  # type: ignore[type-var]
    counts = [int(rows.nth(i).locator("td").nth(1).inner_text()) for i in range(rows.count())]
    assert counts == [len(reported[n]) for n in names]  # type: ignore[index]
    worst = [min((SEVERITY.index(f["kind"]) for f in reported[n]), default=len(SEVERITY)) for n in names]  # type: ignore[index]
    assert [(w, -c) for w, c in zip(worst, counts, strict=True)] == sorted(
        (w, -c) for w, c in zip(worst, counts, strict=True)
    )
    assert names[0] == "net"  # its NaN: the worst
    assert overview.locator("tr.selected").get_attribute("data-name") == "gan [G]"
    rows.nth(0).click()
    _wait(page, "page.model.name === 'net' && page.analysis && !page.opening")
    assert overview.locator("tr.selected").get_attribute("data-name") == "net"
    assert frame(page).locator("#run option:checked").inner_text() == "net"


LEGENDS = """(root) => {
    const box = (node) => { const b = node.getBoundingClientRect(); return [b.left, b.right, b.top, b.bottom]; };
    return [...root.querySelectorAll('.legend svg')].filter((bar) => bar.getBoundingClientRect().width > 0)
      .map((bar) => [box(bar), [...bar.querySelectorAll('text')].map((label) => [label.textContent, box(label)])]);
}"""


def _legends(page: Any, within: str = "body") -> list[tuple[list[float], list[tuple[str, list[float]]]]]:
    """Each drawn legend's colour bar under ``within`` (left, right, top, bottom) with its labels' (text, box)."""
    return frame(page).locator(within).evaluate(LEGENDS)  # type: ignore[no-any-return]


def _assert_whole(bar: list[float], labels: list[tuple[str, list[float]]]) -> None:
    """Every label lies inside its colour bar's box, and none covers another."""
    assert labels
    for text, (left, right, top, bottom) in labels:
        assert bar[0] <= left and right <= bar[1] and bar[2] <= top and bottom <= bar[3], (text, bar, left, right)
    spans = sorted(box[:2] for _, box in labels)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), labels


def test_the_legends_labels_lie_within_the_legend(page) -> None:
    _open(page, "net")  # its NaN
    for grid in ("#heads-cells", "#numerics-cells"):
        frame(page).locator(grid).wait_for(timeout=READY_MS)
    drawn = _legends(page)
    assert len(drawn) == 5  # the heatmap's, the two of attention, the heads' and the numerics'
    for bar, labels in drawn:
        _assert_whole(bar, labels)
    # Ranges whose ticks fall next to the bar's ends, and labels as long as they get.
    for values, stat in [
        ([0.99e-10, 1.01e10], "gradient/norm"),
        ([1.0001e-3, 0.9999e-2], "gradient/norm"),
        ([1.91712, 1.91718], "activation/mean"),
        ([-123456.7, 0.000123], "activation/mean"),
    ]:
        health(page, f"page.heatmap.set({{modules: ['m'], steps: [0, 1], values: [{values}]}}, {stat!r})")
        ((bar, labels),) = _legends(page, "#heatmap")
        _assert_whole(bar, labels)
        ticks = health(page, "page.heatmap.scale.ticks().map((t) => t[1])")
        assert [text for text, _ in labels][:: len(labels) - 1] == [ticks[0], ticks[-1]]  # the ends, both shown
    health(page, "page.drawHeatmap()")


def _findings_shown(page: Any) -> list[int]:
    """The steps of the findings listed."""
    rows = frame(page).locator("#findings tbody tr")
    return [int(s) for s in rows.evaluate_all("(rows) => rows.map((r) => r.dataset.step)")]


def test_a_drag_across_the_steps_narrows_the_heatmap_and_the_findings_kept_in_the_url(page) -> None:
    _open(page, "wide")
    frame(page).locator("#compare").select_option(label="—")  # its own steps alone
    drawn = "page.analysis && !page.opening && page.requests.pending === 0"
    _wait(page, f"page.heatmap.doc.steps.length === {WIDE_STEPS} && {drawn}")
    findings = [f["step"] for f in get(page.url.split("/#")[0], "/data/plugin/tblog_hooks/findings", run="wide")]  # type: ignore[index, union-attr]
    assert findings == [120, 380, 540]
    cells = frame(page).locator("#heatmap canvas.cells")
    box = cells.bounding_box()
    axis = health(page, "page.heatmap.plotHeight") + 10  # the step axis, under the cells

    def x(step: int) -> int:  # a whole pixel (as a mouse event gives it) inside the step's column, 1.2 pixels wide
        column = f"page.heatmap.doc.steps.indexOf({step})"
        left, width = health(page, f"[page.heatmap.left + {column} * page.heatmap.colWidth, page.heatmap.colWidth]")
        assert width > 1.1
        return math.ceil(box["x"] + left + 0.05)

    page.mouse.move(x(400), box["y"] + axis)
    page.mouse.down()
    page.mouse.move(x(250), box["y"] + axis, steps=4)
    page.mouse.move(x(100), box["y"] + axis, steps=4)  # right to left
    page.mouse.up()
    _wait(page, f"page.range && page.heatmap.doc.steps.length < {WIDE_STEPS} && {drawn}")
    assert health(page, "page.heatmap.doc.steps") == list(range(100, 401))
    assert "p.tblog_hooks.from=100" in page.url and "p.tblog_hooks.to=400" in page.url
    assert _findings_shown(page) == [s for s in findings if 100 <= s <= 400] == [120, 380]
    assert frame(page).locator("#findings-range").inner_text() == "2 of 3 in steps 100 to 400"
    page.reload()  # the range is kept in the URL
    frame(page).locator("#modules table").wait_for(timeout=READY_MS)
    _wait(page, drawn)
    shown = health(page, "[page.model.name, page.heatmap.doc.steps[0], page.heatmap.doc.steps.length]")
    assert shown == ["wide", 100, 301]
    assert _findings_shown(page) == [120, 380]
    cells.dblclick(position={"x": box["width"] / 2, "y": axis})
    _wait(page, f"!page.range && page.heatmap.doc.steps.length === {WIDE_STEPS} && {drawn}")
    assert "from=" not in page.url and "to=" not in page.url
    assert _findings_shown(page) == findings and frame(page).locator("#findings-range").inner_text() == ""
    _open(page, "net")


def test_no_errors_in_the_browser(page, console) -> None:
    assert console == []


def _kept_all(url: str, run: str, tag: str) -> bool:
    """Whether TensorBoard serves as many values of ``run``'s ``tag`` as it keeps (1,000)."""
    try:
        return len(get(url, "/data/plugin/scalars/scalars", run=run, tag=tag)) == 1000  # type: ignore[arg-type]
    except OSError:  # (not loaded yet: 400)
        return False


def test_a_tab_opened_before_any_run_shows_the_first_and_says_it_is_sampled(page, tmp_path) -> None:
    logdir = tmp_path / "runs"
    logdir.mkdir()
    with tensorboard(logdir) as url:
        tab = page.context.browser.new_page(viewport={"width": 1400, "height": 1000})  # the fixture's browser
        try:
            deadline = time.monotonic() + TENSORBOARD_READY_S
            while True:
                try:
                    get(url, "/data/plugin/tblog_hooks/runs")
                    break
                except OSError:
                    assert time.monotonic() < deadline, "tensorboard did not start"
                    time.sleep(0.5)
            tab.goto(f"{url}/#tblog_hooks")
            frame(tab).locator("#no-runs").wait_for(timeout=READY_MS)
            with SummaryWriter(logdir / "many") as writer:  # more logged steps than TensorBoard keeps
                for step in range(1200):
                    writer.add_scalar("gradient/norm/0", 1.0 + step % 3, step)
            # (until TensorBoard holds its whole sample: a load pass may have read part of the file)
            while not _kept_all(url, "many", "gradient/norm/0"):
                assert time.monotonic() < deadline + TENSORBOARD_READY_S, "tensorboard did not load the run"
                time.sleep(0.5)
            tab.locator("app-header-reload button.reload-button").click()  # TensorBoard's own reload
            frame(tab).locator("#modules table").wait_for(timeout=READY_MS)
            sampling = frame(tab).locator("#sampling")
            sampling.wait_for(timeout=READY_MS)
            assert "a sample of 1,000 of this run's logged steps" in sampling.inner_text()
            assert "scalars=100000" in sampling.inner_text()
            assert "sample of 1,000 logged steps" in frame(tab).locator("#findings-hint").inner_text()
        finally:
            tab.close()


DEEP = [f"block.{i:03d}" for i in range(150)]  # more rows than the heatmap shows at once, once taller


def _deep_norm(module: int, step: int) -> float:
    """The first 20 blocks' gradients vanish at step 3: a finding each, more than the findings list shows at once."""
    return 1e-7 if module < 20 and step == 3 else 1.0 + 0.01 * module + 0.001 * step


def test_the_tab_follows_a_training_on_tensorboards_auto_reload(page, tmp_path) -> None:
    """With TensorBoard's auto-reload on, what is written after a tab opened comes without a click:
    a tab on an empty logdir shows the first run, a tab on a run its new step at the right, with
    the selection, the rows' height, the scrolls and the sort the user left."""
    deep, empty = tmp_path / "deep" / "runs", tmp_path / "empty" / "runs"
    empty.mkdir(parents=True)
    _write_norms(deep / "deep", DEEP, range(12), _deep_norm)
    errors: list[str] = []
    with tensorboard(deep) as deep_url, tensorboard(empty) as empty_url:
        wait_until_loaded(deep_url, deep)
        wait_until_loaded(empty_url, empty)
        context = page.context.browser.new_context(viewport={"width": 1400, "height": 1000})  # the fixture's browser
        context.add_init_script(AUTO_RELOAD)
        try:
            reading, waiting = context.new_page(), context.new_page()
            for tab in (reading, waiting):
                tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                tab.on("pageerror", lambda e: errors.append(str(e)))
            reading.goto(f"{deep_url}/#tblog_hooks")
            waiting.goto(f"{empty_url}/#tblog_hooks")
            frame(waiting).locator("#no-runs").wait_for(timeout=READY_MS)
            follow = frame(waiting).locator("#follow")
            assert follow.get_attribute("data-on") == "true" and "every 30 s" in follow.inner_text()
            _write_norms(empty / "first", ["a", "b"], range(3), lambda module, step: 1.0 + module)
            drawn = "page.analysis && !page.opening && page.requests.pending === 0"
            _wait(reading, drawn)
            # What the user chose and scrolled to: a finding, taller rows scrolled away from it, a
            # sort, the findings list and the page scrolled.
            frame(reading).locator('#findings tr[data-module="block.010"]').click()
            frame(reading).locator(".zoom button", has_text="+").click()
            frame(reading).locator("#modules th", has_text="gradient/norm").click()
            view = (
                "[page.heatmap.rowHeight, page.heatmap.scroller.scrollTop, page.findingsCard.box.scrollTop,"
                " window.scrollY, [...document.querySelectorAll('#modules tbody tr')].map((r) => r.dataset.module)]"
            )
            left = health(
                reading,
                "(page.heatmap.scroller.scrollTop = 200, page.findingsCard.box.scrollTop = 300,"
                f" window.scrollTo(0, 150), {view})",
            )
            assert left[0] > 3 and left[1] == 200 and left[2] == 300 and left[3] == 150
            _write_norms(deep / "deep", DEEP, [12], _deep_norm)  # the training goes on
            _wait(reading, f"page.heatmap.doc.steps.length === 13 && {drawn}", FOLLOW_MS)
            assert health(reading, "page.heatmap.doc.steps") == list(range(13))  # the new step at the right
            assert health(reading, view) == left
            assert health(reading, "[page.selection.module, page.selection.step, page.heatmap.selected]") == [
                "block.010",
                3,
                {"row": 10, "col": 3},
            ]
            assert frame(reading).locator("#findings tr.selected").get_attribute("data-module") == "block.010"
            assert frame(reading).locator("#modules th.sorted").inner_text() == "gradient/norm"
            _wait(waiting, f"page.model && page.model.name === 'first' && {drawn}", FOLLOW_MS)
            assert frame(waiting).locator("#follow").get_attribute("data-on") == "true"
        finally:
            context.close()
    assert errors == []
