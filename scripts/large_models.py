"""What a run costs on disk and in TensorBoard's reader as the model grows: narrow GPT-2s.

Trains a randomly initialised ``transformers`` GPT-2 (``n_embd=64``, 4 heads, vocabulary 1,024,
batch 4 x 32 tokens, AdamW) of each depth with ``HookLogger``'s defaults and ``every=1``, then
measures per run: the bytes of the event files, the tags, and the CPU time
(``time.process_time``, best of ``--repeat``) TensorBoard's ``EventAccumulator`` takes to load
the run keeping every value. Per logged step and per watched module, as a Markdown table:

    python scripts/large_models.py                           # 6, 24 and 96 layers, 10 logged steps
    python scripts/large_models.py --layers 24 --histograms all # every histogram on every logged step
    python scripts/large_models.py --layers 96 --steps 100 --report   # also time `tblog-hooks report`
    python scripts/large_models.py --blocks-every 4          # watch every 4th block (a glob per block)

Needs ``pip install transformers`` (the ``bench`` extra). Load times are CPU times of this
process; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tensorboard.backend.event_processing import event_accumulator

from tblog_hooks import Histograms, HookLogger
from tblog_hooks.cli import main as cli_main
from tblog_hooks.stats.kinds import HISTOGRAM_KINDS as KINDS

#: Keep every value of every kind, as a user opening the whole run does.
KEEP_ALL = {kind: 0 for kind in event_accumulator.DEFAULT_SIZE_GUIDANCE}


@dataclass
class Row:
    layers: int
    modules: int
    steps: int
    bytes: int
    scalar_tags: int
    histogram_tags: int
    load_s: float
    report_s: float | None = None

    def cells(self) -> list[str]:
        per = self.modules * self.steps
        cells = [
            str(self.layers),
            str(self.modules),
            f"{self.bytes / self.steps / 1e3:,.0f} kB",
            f"{self.bytes / per:,.0f} B",
            f"{self.scalar_tags:,} / {self.histogram_tags:,}",
            f"{self.load_s / self.steps * 1e3:,.0f} ms",
            f"{self.load_s / per * 1e3:.2f} ms",
        ]
        return cells + ([f"{self.report_s:.1f} s"] if self.report_s is not None else [])


HEADER = [
    "layers",
    "watched modules",
    "event bytes per logged step",
    "per module",
    "scalar / histogram tags",
    "EventAccumulator load per logged step",
    "per module",
]


def gpt2(layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # a small vocabulary lacks GPT-2's special tokens: unused here
    config = GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=1024, n_positions=64)
    return GPT2LMHeadModel(config)


def blocks(layers: int, k: int) -> list[str]:
    """``modules=`` for every ``k``-th block's four linear layers, the embeddings and the head."""
    return ["transformer.wte", "transformer.wpe", "lm_head"] + [f"transformer.h.{i}.*.c_*" for i in range(0, layers, k)]


def train(model: torch.nn.Module, log_dir: Path, steps: int, options: dict[str, object]) -> int:
    """``steps`` optimizer steps, each logged; returns the number of watched modules."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HookLogger(model, log_dir=log_dir, every=1, **options) as hooks:  # type: ignore[arg-type]
        for _ in range(steps):
            tokens = torch.randint(0, 1024, (4, 32))
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            hooks.step()
    return len(hooks.module_names)


def load_time(log_dir: Path, repeat: int) -> tuple[float, dict[str, list[str]]]:
    """Best CPU time of loading the run with every value kept, and its tags."""
    best, tags = float("inf"), {}
    for _ in range(repeat):
        start = time.process_time()
        acc = event_accumulator.EventAccumulator(str(log_dir), size_guidance=KEEP_ALL)
        acc.Reload()
        best = min(best, time.process_time() - start)
        tags = acc.Tags()
    return best, tags


def report_time(log_dir: Path) -> float:
    """CPU time of ``tblog-hooks report`` (text output, discarded)."""
    start = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        cli_main(["report", str(log_dir)])
    return time.process_time() - start


def measure(layers: int, args: argparse.Namespace, root: Path) -> Row:
    torch.manual_seed(0)
    log_dir = root / f"gpt2-{layers}"
    options: dict[str, object] = {} if args.histograms is None else {"histograms": args.histograms}
    if args.blocks_every:
        options["modules"] = blocks(layers, args.blocks_every)
    if args.numerics:
        options["numerics"] = True
    modules = train(gpt2(layers), log_dir, args.steps, options)
    size = sum(p.stat().st_size for p in log_dir.iterdir())
    load_s, tags = load_time(log_dir, args.repeat)
    row = Row(layers, modules, args.steps, size, len(tags["scalars"]), len(tags["histograms"]), load_s)
    if args.report:
        row.report_s = report_time(log_dir)
    return row


def markdown(rows: list[Row], report: bool) -> str:
    header = HEADER + (["`tblog-hooks report`"] if report else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def histogram_option(value: str) -> bool | int | Histograms:
    """``true``, ``false``, an int, or ``all`` (every kind these runs record, on every logged step:
    all but ``input``, which needs ``inputs=True``)."""
    every_kind = [kind for kind in KINDS if kind != "input"]
    named = {"true": True, "false": False, "all": Histograms(every_logged=1, weights_every_logged=1, kinds=every_kind)}
    return named[value.lower()] if value.lower() in named else int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 24, 96])
    parser.add_argument("--steps", type=int, default=10, help="logged steps (every=1)")
    parser.add_argument(
        "--histograms",
        type=histogram_option,
        help="HookLogger's histograms=: true, false, an int, or all (every kind on every logged step)",
    )
    parser.add_argument(
        "--blocks-every", type=int, metavar="K", help="watch every K-th block's linear layers (default: the defaults)"
    )
    parser.add_argument("--numerics", action="store_true", help="with numerics=True (docs/numerics.md)")
    parser.add_argument("--repeat", type=int, default=3, help="loads timed per run (the best is kept)")
    parser.add_argument("--report", action="store_true", help="also time `tblog-hooks report` on each run")
    parser.add_argument("--keep", type=Path, help="write the runs here instead of a temporary directory")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    logging.getLogger("tblog_hooks.health").setLevel(logging.ERROR)  # a deep random model has many findings
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        rows = [measure(n, args, root) for n in args.layers]
    print(markdown(rows, args.report))


if __name__ == "__main__":
    main()
