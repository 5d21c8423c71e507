"""The Model health tab's ``compare`` route and its difference view, on a TensorBoard server (the
view in Debian's chromium through playwright, as in ``test_dashboard_browser.py``)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import get, read_run, tensorboard, wait_until_loaded
from test_compare import CHANGED, train_mlp, two_loggers
from test_dashboard import ROUTE, error
from test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS, READY_MS, _sync_playwright, frame, health
from torch import nn

from tblog_hooks.cli import main
from tblog_hooks.stats.tags import escape

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="stops the server's process group (POSIX)")


def _change(model: nn.Sequential, step: int) -> None:
    if step == CHANGED - 1:
        with torch.no_grad():
            model[2].weight.mul_(1.01)


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("compare_dashboard") / "runs"
    train_mlp(path / "a")
    train_mlp(path / "b", before_step=_change)
    two_loggers(path / "pair")
    return path


@pytest.fixture(scope="module")
def server(logdir: Path) -> Iterator[str]:
    with tensorboard(logdir) as url:
        wait_until_loaded(url, logdir)
        yield url


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    main(["compare", *argv, "--json"])
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_the_route_answers_the_commands_document(server, logdir, capsys) -> None:
    a, b, pair = (str(logdir / name) for name in ("a", "b", "pair"))
    cases = [
        ({"run": "a", "other": "b"}, [a, b], ("a", "b")),
        ({"run": "a", "other": "b", "rtol": "0.05", "atol": "1e-3"},
         [a, b, "--rtol", "0.05", "--atol", "1e-3"], ("a", "b")),
        ({"run": "b", "other": "a"}, [b, a], ("b", "a")),
        ({"run": "pair", "prefix": "P", "other": "pair", "other_prefix": "Q"},
         [pair, pair, "--prefix", "P", "--other-prefix", "Q"], ("pair [P]", "pair [Q]")),
        ({"run": "pair", "prefix": "Q", "other": "pair"}, [pair, pair, "--prefix", "Q"], ("pair [Q]", "pair [Q]")),
    ]  # fmt: skip
    for query, argv, names in cases:
        served = get(server, f"{ROUTE}/compare", **query)
        assert served == {**_cli(capsys, *argv), "a": names[0], "b": names[1]}, query
    assert get(server, f"{ROUTE}/compare", run="a", other="b")["first"]["module"] == "2"  # type: ignore[index]


def test_the_route_says_what_is_wrong(server) -> None:
    path = f"{ROUTE}/compare"
    assert error(server, path, run="a") == (400, "Invalid argument: missing other=")
    code, message = error(server, path, run="a", other="nope")
    assert code == 404 and "run 'nope' holds no tblog_hooks tags" in message
    code, message = error(server, path, run="a", other="pair")
    assert code == 400 and "run 'pair' holds the prefixes 'P', 'Q': pass prefix= (got None)" in message
    code, message = error(server, path, run="a", other="b", rtol="-1")
    assert code == 400 and "rtol must be a finite number >= 0, got -1.0" in message
    code, message = error(server, path, run="a", other="b", atol="x")
    assert code == 400 and "rtol= and atol= are numbers" in message


@pytest.fixture(scope="module")
def page(logdir, server) -> Iterator[Any]:
    sync_playwright = _sync_playwright()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(f"{server}/#tblog_hooks")
            frame(tab).locator("#modules table").wait_for(timeout=READY_MS)
            yield tab
            assert errors == []
        finally:
            browser.close()


def test_the_difference_view_names_and_outlines_where_the_runs_part(page, server, logdir) -> None:
    doc = get(server, f"{ROUTE}/compare", run="a", other="b")
    first = doc["first"]  # type: ignore[index]
    stat = first["stat"].rsplit("/", 1)[0]
    frame(page).locator("#stat").select_option(stat)
    frame(page).locator("#compare").select_option(label="b")
    frame(page).locator(f'#difference-title[data-step="{CHANGED}"]').wait_for(timeout=READY_MS)
    title = frame(page).locator("#difference-title").inner_text()
    assert title.startswith(f"they part at step {CHANGED} in 2: {first['stat']}")
    view = "page.difference.map"
    assert health(page, f"{view}.first") == first
    assert health(page, f"{view}.marks.map((m) => [m.module, m.step])") == [
        [m["module"], m["step"]]
        for m in doc["modules"]  # type: ignore[index]
    ]
    # The outline of the first divergence: drawn left of its cell.
    centre = health(page, f"{view}.firstCentre()")
    pixel = health(
        page,
        f"Array.from({view}.canvas.getContext('2d').getImageData("
        f"Math.round(({centre['x']} - {view}.colWidth / 2 - 1.5) * devicePixelRatio), "
        f"Math.round({centre['y']} * devicePixelRatio), 1, 1).data)",
    )
    assert pixel[:3] == [0, 184, 212]
    # Hovering its cell shows both runs' values and the difference.
    box = frame(page).locator("#difference canvas.cells").bounding_box()
    page.mouse.move(box["x"] + centre["x"], box["y"] + centre["y"])
    tooltip = frame(page).locator("#tooltip")
    assert tooltip.is_visible() and "2" in tooltip.inner_text() and f"step {CHANGED}" in tooltip.inner_text()
    a, b = read_run(logdir / "a").scalars, read_run(logdir / "b").scalars
    tag = f"{stat}/{escape('2')}"
    want_a, want_b = a[tag][CHANGED], b[tag][CHANGED]
    assert (float(tooltip.get_attribute("data-a")), float(tooltip.get_attribute("data-b"))) == (want_a, want_b)
    assert float(tooltip.get_attribute("data-value")) == pytest.approx(abs(math.log10(want_b / want_a)), rel=1e-9)
    assert health(page, f"{view}.doc.values[0][0]") == 0  # module 0 at step 0: the same in both


def test_the_difference_is_a_log_ratio_or_where_signs_differ_the_relative_difference(page, server) -> None:
    got = (
        frame(page)
        .locator("body")
        .evaluate(
            f"async () => {{ const m = await import('{server}{ROUTE}/compare.js');"
            " return [m.difference(2, 20), m.difference(-1, 3), m.difference(0, 5), m.difference(1, 1),"
            " m.difference('NaN', 'NaN'), m.difference(1, 'NaN'), m.difference(null, 1)]; }"
        )
    )
    assert got == [1, 4 / 3, 1, 0, 0, math.inf, None]
