"""Overhead of tblog_hooks against no hooks, hand-written hooks and wandb.watch, side by side.

The configurations take turns on one model in this process, in short blocks (A B C, B C A,
C A B, ...): each is attached to the model for a block of steps and removed after it, so drift in
the machine hits all alike, and all time the same weights in the same memory (separate copies of
a model differ by ~1% in step time by where their tensors lie). Reported as ratios to the no-hook
baseline:

- non-logged / logged / logged + histograms: median of steps that do not log (nor follow a
  logged step), that log scalars, that log scalars and histograms (tblog_hooks: every 5th
  logged step by default; the hand-written hooks and wandb.watch write histograms on every
  logged step), each step timed over the baseline's median step in the same round;
- every=N amortised: (an average logged step + its aftermath + (N - 1) * non-logged) / N, over
  the baseline, where the aftermath is how much longer the step after a logged one takes than
  a non-logged one (the logged step's work left the caches cold): a cost of each logged step,
  counted once per logged step rather than in every non-logged one;
- idle: the logger attached but logging no step of its blocks, so that its hooks' own cost can
  be told from what logged steps leave behind in the non-logged steps of ``tblog``'s blocks;
- spikes: ``idle`` with ``spikes=True`` (every step's gradient norms and loss, docs/spikes.md);
- aten ops a logged step adds per watched module (TorchDispatchMode; ~kernel launches on a GPU);
- RSS growth: measured in a fresh subprocess per configuration over ``--rss-steps`` steps.

After each block a configuration's writer is flushed and its hooks removed (untimed), so that
its background thread does not steal the next configuration's time.

    python scripts/bench.py                        # both workloads, CPU, Markdown table
    python scripts/bench.py --workload w2 --steps 120 --json bench.json
    python scripts/bench.py --device cuda --batch 256
    python scripts/bench.py --attention            # the cost of attention=True on GPT-2 and a ViT
    python scripts/bench.py --attention --attention-workloads seq256,seq1024,seq2048,seq4096
                                                   # ... on one sequence of 256 to 4,096 tokens
    python scripts/bench.py --numerics             # the cost of numerics=True on W1 and W2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torchvision
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import Histograms, HookLogger
from tblog_hooks.cli.demo import pick_device

CONFIGS = ("none", "tblog", "idle", "spikes", "manual", "wandb")


# -- workloads ---------------------------------------------------------------------------------
def make_workload(name: str, batch: int | None, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """W1: stock ResNet-18, 16x3x64x64. W2: 16 x [Linear(512, 512) + Sigmoid] + head, batch 256."""
    torch.manual_seed(0)
    if name == "w1":
        model: nn.Module = torchvision.models.resnet18(num_classes=10)
        x = torch.randn(batch or 16, 3, 64, 64)
    elif name == "w2":
        layers: list[nn.Module] = []
        for _ in range(16):
            layers += [nn.Linear(512, 512), nn.Sigmoid()]
        model = nn.Sequential(*layers, nn.Linear(512, 10))
        x = torch.randn(batch or 256, 512)
    else:
        raise SystemExit(f"unknown workload {name!r}; use w1 or w2")
    y = torch.randint(0, 10, (x.shape[0],))
    return model.to(device), x.to(device), y.to(device)


# -- configurations ----------------------------------------------------------------------------
#: The timings key of a non-logged step that follows a logged one.
AFTER = 3


@dataclass
class Attached:
    """One way of watching the model, attached for one block of steps."""

    after_backward: Callable[[int], None] = lambda step: None
    after_step: Callable[[], None] = lambda: None
    #: Remove every hook (untimed).
    detach: Callable[[], None] = lambda: None
    #: Wait for background work (a writer thread still writing events) before another
    #: configuration's block starts, so that it is not timed against the wrong one.
    settle: Callable[[], None] = lambda: None
    #: The loss of the step being trained (``spikes`` passes it to ``step(loss=...)``).
    loss: torch.Tensor | None = None


@dataclass
class Config:
    """A configuration: ``attach(model, step)`` watches ``model`` from global step ``step`` on;
    ``logs(step)`` says what step ``step`` does: 0 nothing, 1 log scalars, 2 log scalars and histograms."""

    name: str
    attach: Callable[[nn.Module, int], Attached] = lambda model, step: Attached()
    logs: Callable[[int], int] = lambda step: 0
    #: Of its logged steps, the share that also write histograms.
    histogram_share: float = 1.0
    close: Callable[[], None] = lambda: None
    #: (round, seconds) of timed steps by ``logs(step)`` (0, 1, 2), and ``AFTER`` for non-logged
    #: steps after a logged one.
    timings: dict[int, list[tuple[int, float]]] = field(default_factory=lambda: {0: [], 1: [], 2: [], AFTER: []})


def config_none(every: int, log_dir: str) -> Config:
    return Config("none")


def attach_logger(writer: SummaryWriter, every: int) -> Callable[[nn.Module, int], Attached]:
    """``HookLogger`` with its defaults, writing into the configuration's ``writer``."""

    def attach(model: nn.Module, step: int) -> Attached:
        hooks = HookLogger(model, writer=writer, every=every, start_step=step)
        return Attached(after_step=hooks.step, detach=hooks.close, settle=writer.flush)

    return attach


def config_tblog(every: int, log_dir: str) -> Config:
    writer = SummaryWriter(log_dir)
    cadence = Histograms().every_logged  # the default: histograms on every 5th logged step
    return Config(
        "tblog",
        attach_logger(writer, every),
        logs=lambda step: 0 if step % every else 2 if (step // every) % cadence == 0 else 1,
        histogram_share=1 / cadence,
        close=writer.close,
    )


def config_idle(every: int, log_dir: str) -> Config:
    """``HookLogger`` attached with its defaults but logging no step of its blocks: what its hooks
    cost by themselves, apart from what logged steps leave behind in the steps after them."""
    writer = SummaryWriter(log_dir)
    return Config("idle", attach_logger(writer, _NEVER), close=writer.close)


#: An ``every=`` no timed step reaches (the first timed step comes after the warm-up).
_NEVER = 1 << 62


def config_spikes(every: int, log_dir: str) -> Config:
    """``idle`` with ``spikes=True`` and the loss given to ``step()``: what watching every step's
    gradient norms and loss costs a step that is not logged (their series are written at close)."""
    writer = SummaryWriter(log_dir)

    def attach(model: nn.Module, step: int) -> Attached:
        hooks = HookLogger(model, writer=writer, every=_NEVER, start_step=step, spikes=True)
        attached = Attached(detach=hooks.close, settle=writer.flush)
        attached.after_step = lambda: hooks.step(loss=attached.loss)
        return attached

    return Config("spikes", attach, close=writer.close)


def config_manual(every: int, log_dir: str) -> Config:
    """The usual hand-written approach: host copies, numpy histograms and .item() per module."""
    writer = SummaryWriter(log_dir)

    def attach(model: nn.Module, step: int) -> Attached:
        state = {"step": step}

        def logs() -> bool:
            return state["step"] % every == 0

        leaves = [(n, m) for n, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]

        def forward_hook(name: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
                if not logs():
                    return
                writer.add_histogram(f"activation/{name}", out.detach().cpu().numpy(), state["step"])
                if out.requires_grad:
                    out.register_hook(
                        lambda g: writer.add_scalar(f"gradient/norm/{name}", g.norm().item(), state["step"])
                    )

            return hook

        handles = [m.register_forward_hook(forward_hook(n)) for n, m in leaves]

        def after_backward(step: int) -> None:
            if logs():
                for name, p in model.named_parameters():
                    if p.grad is not None:
                        writer.add_histogram(f"param_grad/{name}", p.grad.detach().cpu().numpy(), step)

        def after_step() -> None:
            state["step"] += 1

        def detach() -> None:
            for h in handles:
                h.remove()

        return Attached(after_backward, after_step, detach, writer.flush)

    return Config("manual", attach, logs=lambda step: 0 if step % every else 2, close=writer.close)


def config_wandb(every: int, log_dir: str) -> Config:
    """``wandb.watch(log="all")`` in offline mode: it never touches the network."""
    import wandb

    os.environ["WANDB_SILENT"] = "true"
    # No system-metrics sampling or machine probing: that background work would be timed
    # against whichever configuration happens to run, not against wandb.watch.
    quiet = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True)
    run = wandb.init(mode="offline", dir=log_dir, project="bench", settings=quiet)
    # wandb counts backward calls per parameter hook from watch() on; with one backward per
    # step, the step k steps after watch() logs when (k + 1) % every == 0.
    watched_at = {"step": 0}

    def attach(model: nn.Module, step: int) -> Attached:
        watched_at["step"] = step
        wandb.watch(model, log="all", log_freq=every)
        return Attached(detach=lambda: wandb.unwatch(model))

    return Config(
        "wandb",
        attach,
        logs=lambda step: 0 if (step - watched_at["step"] + 1) % every else 2,
        close=run.finish,
    )


MAKERS = {
    "none": config_none,
    "tblog": config_tblog,
    "idle": config_idle,
    "spikes": config_spikes,
    "manual": config_manual,
    "wandb": config_wandb,
}


def available(name: str) -> bool:
    if name != "wandb":
        return True
    try:
        import wandb  # noqa: F401
    except ImportError:
        print("wandb is not installed (pip install -e '.[bench]'): skipping wandb.watch", file=sys.stderr)
        return False
    return True


# -- measurement -------------------------------------------------------------------------------
def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, hooks: Attached, step: int, x: torch.Tensor, y: torch.Tensor
) -> None:
    loss = nn.functional.cross_entropy(model(x), y)
    hooks.loss = loss
    loss.backward()
    hooks.after_backward(step)
    optimizer.step()
    optimizer.zero_grad()
    hooks.after_step()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(workload: str, names: list[str], args: argparse.Namespace, device: torch.device) -> dict[str, dict]:
    model, x, y = make_workload(workload, args.batch, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    for _ in range(args.warmup):  # not timed
        train_step(model, optimizer, Attached(), step, x, y)
        step += 1
    with tempfile.TemporaryDirectory() as tmp:
        configs = [MAKERS[n](args.every, os.path.join(tmp, n)) for n in names]
        sync(device)
        for round_ in range(max(1, args.steps // args.block)):
            # Each round in another order, so that no configuration always follows the same one.
            for c in configs[round_ % len(configs) :] + configs[: round_ % len(configs)]:
                hooks = c.attach(model, step)
                # The first step of a block runs with the other configuration's data in the caches
                # (and its hooks just attached): it is not timed.
                for i in range(args.block + 1):
                    start = time.perf_counter()
                    train_step(model, optimizer, hooks, step, x, y)
                    sync(device)
                    if i:
                        logs = c.logs(step)
                        after = not logs and c.logs(step - 1)
                        c.timings[AFTER if after else logs].append((round_, time.perf_counter() - start))
                    step += 1
                hooks.settle()
                hooks.detach()
        for c in configs:
            c.close()
    # Each step over the baseline's median in its own round: the machine's drift from one round
    # to the next (another tenant, a frequency change) cancels out.
    by_round: dict[int, list[float]] = {}
    for round_, seconds in configs[0].timings[0]:
        by_round.setdefault(round_, []).append(seconds)
    baselines = {round_: statistics.median(times) for round_, times in by_round.items()}
    baseline_ms = statistics.median(t for _, t in configs[0].timings[0]) * 1e3
    results: dict[str, dict] = {}
    for c in configs:
        ratio = {kind: statistics.median(t / baselines[r] for r, t in samples) if samples else None
                 for kind, samples in c.timings.items()}  # fmt: skip
        plain = ratio[0]
        assert plain is not None, "no step that does not log was timed: raise --steps"
        if ratio[1] is None and ratio[2] is None:  # a configuration that logs nothing (none, idle)
            results[c.name] = {"baseline_ms": baseline_ms, "non_logged": plain}
            continue
        with_histograms = ratio[2] or plain
        logged = ratio[1] or with_histograms
        # A logged step on average: the share of them that writes histograms, at its cost.
        average = c.histogram_share * with_histograms + (1 - c.histogram_share) * logged
        aftermath = ratio[AFTER] - plain if ratio[AFTER] is not None else 0.0
        results[c.name] = {
            "baseline_ms": baseline_ms,
            "non_logged": plain,
            "logged": logged,
            "logged_histograms": with_histograms,
            "aftermath": aftermath,
            "every10": (average + aftermath + 9 * plain) / 10,
            "every100": (average + aftermath + 99 * plain) / 100,
            "samples": {
                "logged": len(c.timings[1]),
                "histograms": len(c.timings[2]),
                "non_logged": len(c.timings[0]),
                "after_logged": len(c.timings[AFTER]),
            },
        }
    return results


class _OpCounter(TorchDispatchMode):
    """Counts dispatched aten ops: on a GPU nearly each one is a kernel launch."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_added(workload: str, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Aten ops ``HookLogger`` adds to one training step, per watched module: on a logged step
    with every histogram of the defaults, and on one without histograms."""
    model, x, y = make_workload(workload, args.batch, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    counts: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        hooks = HookLogger(model, log_dir=tmp, every=2, histograms=Histograms(every_logged=2, weights_every_logged=2))
        for _ in range(8):  # logs steps 0, 2, 4, 6; histograms on 0 and 4: count steps 4, 5 and 6
            counter = _OpCounter()
            with counter:
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                hooks.step()
            counts.append(counter.count)
        modules = len(hooks.module_names)
        hooks.close()
    baseline = counts[5]  # a step it does not log: as without the logger (tests/test_fidelity.py)
    return {
        "ops_histograms": (counts[4] - baseline) / modules,
        "ops_logged": (counts[6] - baseline) / modules,
    }


# -- attention= --------------------------------------------------------------------------------
def attention_workload(name: str, device: torch.device) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """GPT-2 (4 layers, width 256, 4 heads) on 8 x 256 tokens, torchvision's ViT (4 layers,
    width 256, 4 heads) on 16 x 3 x 64 x 64 images (65 tokens), or ``seqN``: GPT-2 (2 layers,
    width 256, 4 heads) on one sequence of N tokens; returns the model and its loss."""
    torch.manual_seed(0)
    if name.startswith("seq") and name[3:].isdigit():
        import transformers

        length = int(name[3:])
        config = transformers.GPT2Config(vocab_size=1000, n_positions=length, n_embd=256, n_layer=2, n_head=4)
        gpt = transformers.GPT2LMHeadModel(config).to(device)
        tokens = torch.randint(0, 1000, (1, length), device=device)
        return gpt, lambda: gpt(tokens, labels=tokens).loss
    if name == "gpt2":
        import transformers

        config = transformers.GPT2Config(vocab_size=1000, n_positions=256, n_embd=256, n_layer=4, n_head=4)
        gpt = transformers.GPT2LMHeadModel(config).to(device)
        tokens = torch.randint(0, 1000, (8, 256), device=device)
        return gpt, lambda: gpt(tokens, labels=tokens).loss
    if name == "vit":
        vit = torchvision.models.VisionTransformer(
            image_size=64, patch_size=8, num_layers=4, num_heads=4, hidden_dim=256, mlp_dim=512, num_classes=10
        ).to(device)
        images, labels = torch.randn(16, 3, 64, 64, device=device), torch.randint(0, 10, (16,), device=device)
        return vit, lambda: nn.functional.cross_entropy(vit(images), labels)
    raise SystemExit(f"unknown attention workload {name!r}; use gpt2, vit or seqN (N tokens)")


def option_cost(
    model: nn.Module, loss_of: Callable[[], torch.Tensor], option: str, args: argparse.Namespace, device: torch.device
) -> dict[str, float]:
    """A logged step (every=1, no histograms) with ``option=True`` over one without, in
    interleaved blocks on one model; and the aten ops ``option=True`` adds to a logged step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times: dict[bool, list[float]] = {False: [], True: []}
    ops: dict[bool, int] = {}
    with tempfile.TemporaryDirectory() as tmp, SummaryWriter(tmp) as writer:
        for round_ in range(max(1, args.steps // args.block)):
            for on in (False, True) if round_ % 2 == 0 else (True, False):
                hooks = HookLogger(model, writer=writer, every=1, histograms=False, **{option: on})
                for i in range(args.block + 1):  # the first step of a block is not timed
                    counter = _OpCounter() if round_ == 0 and i == 1 else contextlib.nullcontext()
                    start = time.perf_counter()
                    with counter:
                        loss_of().backward()
                        optimizer.step()
                        optimizer.zero_grad()
                        hooks.step()
                    sync(device)
                    if i:
                        times[on].append(time.perf_counter() - start)
                    if isinstance(counter, _OpCounter):
                        ops[on] = counter.count
                watched = len(hooks.module_names)
                hooks.close()
    plain, with_option = statistics.median(times[False]), statistics.median(times[True])
    return {
        "logged_ms": plain * 1e3,
        "logged_option_ms": with_option * 1e3,
        "ratio": with_option / plain,
        "ops_added": float(ops[True] - ops[False]),
        "modules": float(watched),
    }


def attention_peak_child(name: str, attention: bool, device: torch.device) -> dict[str, float]:
    """In a fresh process: the peak RSS three logged steps (``attention=`` as given) add to a
    step without the logger."""
    model, loss_of = attention_workload(name, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train() -> None:
        loss_of().backward()
        optimizer.step()
        optimizer.zero_grad()

    train()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with (
        tempfile.TemporaryDirectory() as tmp,
        HookLogger(model, log_dir=tmp, every=1, histograms=False, attention=attention) as hooks,
    ):
        for _ in range(3):
            train()
            hooks.step()
    return {"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base}


def attention_peak(name: str, args: argparse.Namespace) -> float:
    """The peak RSS ``attention=True`` adds to a logged step, MB (fresh processes)."""
    peaks = []
    for attention in (False, True):
        cmd = [sys.executable, __file__, "--attention-peak-child", f"{name}:{int(attention)}", "--device", args.device]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        peaks.append(json.loads(out.strip().splitlines()[-1])["peak_mb"])
    return peaks[1] - peaks[0]


def option_table(option: str, results: dict[str, dict[str, float]]) -> str:
    peaks = all("peak_added_mb" in r for r in results.values())
    rows = [
        f"| workload | logged step | with {option}=True | ratio | aten ops added | per watched module |"
        + (" peak RSS added |" if peaks else ""),
        "|---|---|---|---|---|---|" + ("---|" if peaks else ""),
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {r['logged_ms']:.1f} ms | {r['logged_option_ms']:.1f} ms | {r['ratio']:.2f}x "
            f"| {r['ops_added']:.0f} | {r['ops_added'] / r['modules']:.1f} |"
            + (f" {r['peak_added_mb']:+.0f} MB |" if peaks else "")
        )
    return "\n".join(rows)


def numerics_workload(name: str, device: torch.device) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """W1 or W2 (``make_workload``) with their cross-entropy loss."""
    model, x, y = make_workload(name, None, device)
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_child(workload: str, name: str, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Run one configuration for ``--rss-steps`` steps; RSS growth after a short warm-up."""
    model, x, y = make_workload(workload, args.batch, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = MAKERS[name](args.every, tmp)
        hooks = cfg.attach(model, 0)
        for step in range(20):
            train_step(model, optimizer, hooks, step, x, y)
        start, peak_start = rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        for step in range(20, 20 + args.rss_steps):
            train_step(model, optimizer, hooks, step, x, y)
        end, peak = rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        hooks.detach()
        cfg.close()
    return {"rss_growth_mb": end - start, "peak_growth_mb": peak - peak_start}


def rss(workload: str, name: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--rss-child", f"{workload}:{name}", "--every", str(args.every),
           "--rss-steps", str(args.rss_steps), "--device", args.device]  # fmt: skip
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# -- report ------------------------------------------------------------------------------------
def table(results: dict[str, dict[str, dict]]) -> str:
    lines = [
        "| workload | config | baseline ms/step | non-logged | logged | logged + histograms | step after a logged one "
        "| every=10 | every=100 | RSS growth MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, by_config in results.items():
        for name, r in by_config.items():
            growth = f"{r['rss_growth_mb']:+.1f}" if "rss_growth_mb" in r else "-"
            cells = [f"{r['non_logged']:.3f}x"]
            if "logged" in r:
                cells += [f"{r['logged']:.2f}x", f"{r['logged_histograms']:.2f}x", f"{r['aftermath']:+.3f}"]
                cells += [f"{r['every10']:.3f}x", f"{r['every100']:.3f}x"]
            else:  # logs nothing
                cells += ["-"] * 5
            lines.append(f"| {workload} | {name} | {r['baseline_ms']:.1f} | {' | '.join(cells)} | {growth} |")
    return "\n".join(lines)


def environment(device: torch.device) -> str:
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return (
        f"{machine}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"python {platform.python_version()}"
    )


@contextlib.contextmanager
def quiet_warnings() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="w1,w2", help="w1 (ResNet-18), w2 (deep sigmoid MLP), or both")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per configuration (default 150)")
    parser.add_argument("--block", type=int, default=10, help="steps per interleaved block (default 10)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--every", type=int, default=5, help="log every N steps while timing (default 5)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 16 for w1, 256 for w2)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    parser.add_argument("--rss-steps", type=int, default=0, help="also measure RSS over this many steps")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--rss-child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--attention", action="store_true", help="only the cost of attention=True on a logged step (GPT-2, ViT)"
    )
    parser.add_argument(
        "--attention-workloads", default="gpt2,vit", help="with --attention: gpt2, vit and seqN (one sequence of N)"
    )
    parser.add_argument("--attention-peak-child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--numerics", action="store_true", help="only the cost of numerics=True on a logged step (W1, W2)"
    )
    args = parser.parse_args()
    device = pick_device(args.device)

    if args.attention_peak_child:
        name, attention = args.attention_peak_child.split(":")
        with quiet_warnings():
            print(json.dumps(attention_peak_child(name, attention == "1", device)))
        return

    if args.rss_child:
        workload, name = args.rss_child.split(":")
        with quiet_warnings():
            print(json.dumps(rss_child(workload, name, args, device)))
        return

    for option, workloads, make in (
        ("attention", tuple(args.attention_workloads.split(",")), attention_workload),
        ("numerics", ("w1", "w2"), numerics_workload),
    ):
        if not getattr(args, option):
            continue
        with quiet_warnings():
            costs = {name: option_cost(*make(name, device), option, args, device) for name in workloads}
        if option == "attention":
            for name, cost in costs.items():
                cost["peak_added_mb"] = attention_peak(name, args)
        print(f"\n{environment(device)}; {args.steps} timed logged steps per configuration\n")
        print(option_table(option, costs))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": environment(device), "args": vars(args), option: costs}, f, indent=2)
        return

    names = [n for n in args.configs.split(",") if available(n)]
    if names[0] != "none":
        names.insert(0, "none")
    results: dict[str, dict[str, dict]] = {}
    for workload in args.workload.split(","):
        with quiet_warnings():
            results[workload] = measure(workload, names, args, device)
        if "tblog" in results[workload]:
            results[workload]["tblog"].update(ops_added(workload, args, device))
        if args.rss_steps:
            for name in names:
                results[workload][name].update(rss(workload, name, args))
    print(f"\n{environment(device)}; {args.steps} timed steps per configuration, logging every {args.every}\n")
    print(table(results))
    for workload, by_config in results.items():
        if "ops_logged" in by_config.get("tblog", {}):
            r = by_config["tblog"]
            print(
                f"{workload}: aten ops per watched module (~kernel launches on a GPU) added by a logged step: "
                f"{r['ops_logged']:.1f}, with histograms: {r['ops_histograms']:.1f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(device), "args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
