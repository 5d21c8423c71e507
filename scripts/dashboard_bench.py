"""How fast the "Model health" tab is at scale, in a real TensorBoard and Debian's chromium.

Two runs:

- **deep**: a GPT-2 of ``--layers`` blocks (48: 292 watched modules) with ``--steps`` logged steps
  (500). Its tags are those the logger writes (``attention=True``, ``optimizer=``): a real run of
  the model logs two steps, and its tags are written again with varied values for every logged
  step (training 500 logged steps of a 48-layer model would take hours on a CPU);
- **small**: a 4-layer GPT-2 trained for 300 steps with ``every=10``, ``attention=True`` and
  ``spikes=True``, a loss spike at step 220 (the run ``--screenshot`` pictures).

For each, on a server that has loaded the run and answered nothing else: the time from opening
TensorBoard on the tab to the first heatmap drawn, and the time the page takes to handle one mouse
move over the heatmap (tooltip and redraw; the median of 200); then, on another such server, the
wall time of each JSON route (the first call, which reads the run and replays its findings, then
the median of the next 5).

    python scripts/dashboard_bench.py                           # both runs, a Markdown table
    python scripts/dashboard_bench.py --screenshot docs/dashboard.png   # also picture the small run
    python scripts/dashboard_bench.py --layers 0 --screenshot docs/dashboard.png   # the small run only

Needs ``transformers``, ``playwright`` (the Python package; no browser download) and Debian's
``chromium``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from tblog_hooks import HookLogger
from tblog_hooks.stats.tags import ORDER_TAG

ROUTE = "/data/plugin/tblog_hooks"
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


def gpt2(layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # a small vocabulary lacks GPT-2's special tokens: unused here
    config = GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=64, n_positions=32, attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def train(model: torch.nn.Module, run_dir: Path, steps: int, every: int, spikes: bool) -> None:
    """Train on random tokens with the logger; a loss 50 times larger at step 220 (a spike)."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HookLogger(model, log_dir=run_dir, every=every, optimizer=opt, attention=True, spikes=spikes) as hooks:
        for step in range(steps):
            x = torch.randint(0, 64, (8, 32))
            loss = model(x, labels=x).loss * (50.0 if step == 220 else 1.0)
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss.detach()) if spikes else hooks.step()


def write_deep(run_dir: Path, layers: int, steps: int, every: int) -> int:
    """The deep run: the tags of a real logged step, with values that drift and vary, at ``steps``
    logged steps ``every`` apart; returns the number of watched modules."""
    template_dir = run_dir.parent / "template"
    train(gpt2(layers), template_dir, 2, 1, spikes=False)
    acc = event_accumulator.EventAccumulator(str(template_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    first = {t: acc.Scalars(t)[0].value for t in acc.Tags()["scalars"]}
    order = summary_pb2.Summary.Value(
        tag=ORDER_TAG, metadata=acc.SummaryMetadata(ORDER_TAG), tensor=acc.Tensors(ORDER_TAG)[-1].tensor_proto
    )
    rng = random.Random(0)
    writer = EventFileWriter(str(run_dir))
    writer.add_event(event_pb2.Event(wall_time=time.time(), summary=summary_pb2.Summary(value=[order])))
    for i in range(steps):
        drift = math.exp(-i / steps)  # norms shrink as training goes on
        values = [
            summary_pb2.Summary.Value(tag=t, simple_value=v * (drift if v > 0 else 1.0) * math.exp(rng.gauss(0, 0.1)))
            for t, v in first.items()
        ]
        event = event_pb2.Event(wall_time=time.time(), step=i * every, summary=summary_pb2.Summary(value=values))
        writer.add_event(event)
    writer.close()
    shutil.rmtree(template_dir)
    return len(order.tensor.string_val)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def tensorboard(logdir: Path) -> Iterator[str]:
    port = _free_port()
    executable = Path(sys.executable).with_name("tensorboard")
    args = [str(executable), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()


def get(url: str, path: str, **query: str) -> object:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(query)}", timeout=120) as response:
        return json.load(response)


def wait_for(url: str, run: str, steps: int) -> None:
    """Until the server has loaded the run's last logged step."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            doc = get(url, f"{ROUTE}/heatmap", run=run, tag="gradient/norm")
            if len(doc["steps"]) == steps and all(v is not None for v in doc["values"][-1]):  # type: ignore[index]
                return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"tensorboard did not load {run!r} within 10 minutes")


def timed(call: object) -> tuple[float, float]:
    """``(first, median of the next 5)`` wall times of ``call()``, in seconds."""
    times = []
    for _ in range(6):
        start = time.perf_counter()
        call()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


#: Resolves, with the frame's clock, once the page has drawn its first heatmap (the frame after its document arrived).
_DRAWN = """() => new Promise((done) => {
    const drawn = () => requestAnimationFrame(() => done(performance.now()));
    const wait = () => (window.tblogHealth?.heatmap?.doc ? drawn() : setTimeout(wait, 5));
    wait();
})"""
#: The median time the page takes to handle a mouse move over a random heatmap cell, in ms.
_HOVER = """() => {
    const map = window.tblogHealth.heatmap, box = map.canvas.getBoundingClientRect(), times = [];
    for (let i = 0; i < 200; i++) {
        const x = box.left + map.left + Math.random() * (box.width - map.left - 8);
        const y = box.top + Math.random() * map.plotHeight;
        const t = performance.now();
        map.canvas.dispatchEvent(new MouseEvent('mousemove', {clientX: x, clientY: y, bubbles: true}));
        times.push(performance.now() - t);
    }
    times.sort((a, b) => a - b);
    return times[100];
}"""


def browse(url: str, screenshot: Path | None) -> dict[str, float]:
    """Seconds from opening TensorBoard on the tab, and from the tab's own page starting, to the
    first heatmap drawn; milliseconds per mouse move."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        start = time.perf_counter()
        page.goto(f"{url}/#tblog_hooks")
        body = page.frame_locator("iframe").locator("body")
        body.locator("#heatmap canvas.cells").wait_for(timeout=120_000)
        in_tab = body.evaluate(_DRAWN) / 1e3  # the frame's clock starts when its page does
        first_draw = time.perf_counter() - start
        if screenshot is not None:
            body.locator("#findings tr[data-module]").first.click()
            body.locator("#series .chart").first.wait_for(timeout=120_000)
            time.sleep(0.5)
            page.screenshot(path=str(screenshot))
        hover_ms = body.evaluate(_HOVER)
        browser.close()
    return {"first_draw_s": first_draw, "in_tab_s": in_tab, "hover_ms": hover_ms}


def measure(logdir: Path, run: str, steps: int, screenshot: Path | None = None) -> dict[str, object]:
    """The page on a fresh server, then the routes on another (their first call finds nothing cached)."""
    with tensorboard(logdir) as url:
        wait_for(url, run, steps)
        shown = browse(url, screenshot)
    with tensorboard(logdir) as url:
        wait_for(url, run, steps)
        routes = {
            "heatmap": lambda: get(url, f"{ROUTE}/heatmap", run=run, tag="gradient/norm"),
            "findings": lambda: get(url, f"{ROUTE}/findings", run=run),
            "modules": lambda: get(url, f"{ROUTE}/modules", run=run),
        }
        return shown | {name: timed(call) for name, call in routes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48, help="blocks of the deep GPT-2 (default: 48; 0: no deep run)")
    parser.add_argument("--steps", type=int, default=500, help="logged steps of the deep run (default: 500)")
    parser.add_argument("--screenshot", type=Path, help="save a picture of the tab on the small run here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        if args.layers:
            deep = Path(tmp) / "deep" / "gpt2-deep"
            modules = write_deep(deep, args.layers, args.steps, every=10)
            name = f"deep GPT-2, {modules} modules x {args.steps} logged steps"
            rows.append((name, measure(deep.parent, deep.name, args.steps)))
        small = Path(tmp) / "small" / "gpt2"
        train(gpt2(4), small, 300, 10, spikes=True)
        logged = len(get_steps(small))
        rows.append(
            (
                f"GPT-2 4 layers trained, {logged} logged steps",
                measure(small.parent, small.name, logged, args.screenshot),
            )
        )
    header = ["run", "heatmap drawn (from opening TensorBoard / in the tab)", "mouse move"]
    print("| " + " | ".join([*header, "`heatmap`", "`findings`", "`modules`"]) + " |")
    print("|---|---|---|---|---|---|")
    for name, m in rows:
        cells = [f"{m['first_draw_s']:.2f} s / {m['in_tab_s']:.2f} s", f"{m['hover_ms']:.1f} ms"]
        cells += [f"{m[r][0] * 1e3:,.0f} / {m[r][1] * 1e3:,.0f} ms" for r in ("heatmap", "findings", "modules")]  # type: ignore[index]
        print(f"| {name} | " + " | ".join(cells) + " |")


def get_steps(run_dir: Path) -> list[int]:
    """The logged steps of a run (those with output-gradient norms)."""
    acc = event_accumulator.EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tag = next(t for t in acc.Tags()["scalars"] if t.startswith("gradient/norm/"))
    return [e.step for e in acc.Scalars(tag)]


if __name__ == "__main__":
    main()
