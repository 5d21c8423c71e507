"""The "Model health" tab in a real browser: Debian's chromium, headless, driven by playwright
(which downloads no browser). Without chromium or playwright these tests skip, except under
``CI=true``, where they must run."""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import health_runs
import pytest
from conftest import TENSORBOARD_READY_S, get, read_run, read_tensors, read_text, tensorboard, wait_until_loaded
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks.stats.tags import HEADS_TABLE_TAG, NUMERICS_TABLE_TAG, ORDER_TAG, escape, parse_order

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
    return path


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
    assert frame(page).locator("#run option").all_text_contents() == ["gan [D]", "gan [G]", "net"]
    assert frame(page).locator("#stat").input_value() == "gradient/norm"  # the first statistic offered


def test_the_heatmap_lists_the_modules_in_forward_order(page, logdir) -> None:
    text = read_text(logdir / "net", ORDER_TAG)
    assert health(page, "page.heatmap.doc.modules") == parse_order(text[max(text)])


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


def test_no_errors_in_the_browser(page, console) -> None:
    assert console == []
