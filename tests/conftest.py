"""Shared helpers: read a run back with TensorBoard's own reader, serve runs with a real TensorBoard,
look for hooks left behind, run a function on several ranks."""

from __future__ import annotations

import datetime
import faulthandler
import gc
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator, event_file_loader
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.summary.writer import record_writer
from tensorboard.util import tensor_util
from torch.utils._python_dispatch import TorchDispatchMode

#: Skips a test (or a parameter) without a CUDA device; every test it marks is also marked ``cuda``
#: (``pytest_collection_modifyitems``), which is how scripts/cuda_check.py finds them all.
NEEDS_CUDA = "needs a CUDA device"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)


def _interpret_without_swapping_twice() -> None:
    """Triton's interpreter swaps ``triton.language``'s builtins for interpreted ones when a
    kernel is launched (undone when it ends), and again on every call of a ``@triton.jit``
    function inside it (``tl.sum``, ``tl.max``, ``tl.zeros`` are such functions), each time
    listing every member of the language with ``inspect.getmembers``: half the time the fused
    kernels take in the interpreter. Inside a launch, a call whose language modules the launch
    has already swapped swaps nothing, so it is skipped (where Triton's interpreter has no
    ``_patch_lang``, nothing is changed: the kernels run as they are, slower)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    swap = getattr(interpreter, "_patch_lang", None)
    if swap is None:
        return
    swapped: set[int] = set()  # the language modules the launch under way has swapped

    class Launch:
        def __init__(self, scope: object) -> None:
            self.scope = scope

        def restore(self) -> None:
            swapped.clear()
            self.scope.restore()  # type: ignore[attr-defined]

    class Nothing:
        def restore(self) -> None:
            pass

    def swap_once(fn: Callable[..., object]) -> object:
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if swapped and langs <= swapped:
            return Nothing()
        launch = not swapped  # (a launch's own call: nothing swapped yet)
        scope = swap(fn)
        swapped.update(langs)
        return Launch(scope) if launch else scope

    interpreter._patch_lang = swap_once


if not torch.cuda.is_available():
    # Triton's interpreter runs the fused kernels on CPU tensors (tests/test_kernels.py); it is
    # chosen when the kernels are defined, so before anything imports tblog_hooks.kernels.fused.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _interpret_without_swapping_twice()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(mark.name == "skipif" and mark.kwargs.get("reason") == NEEDS_CUDA for mark in item.iter_markers()):
            item.add_marker(pytest.mark.cuda)


@dataclass
class Run:
    scalars: dict[str, dict[int, float]]
    histograms: dict[str, dict[int, object]]  # HistogramValue with min, max, num, bucket_limit, bucket

    def scalar(self, tag: str, step: int) -> float:
        return self.scalars[tag][step]


def read_run(log_dir: str | Path) -> Run:
    acc = event_accumulator.EventAccumulator(
        str(log_dir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0}
    )
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags["scalars"]}
    histograms = {t: {e.step: e.histogram_value for e in acc.Histograms(t)} for t in tags["histograms"]}
    return Run(scalars, histograms)


class OpCounter(TorchDispatchMode):
    """The aten ops run inside it, by overload packet (``aten.add``, ...), in ``ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def hook_dicts(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> list[dict]:
    """Every hook dict of the model's modules and parameters (and the optimizer's step hooks)."""
    dicts: list[dict] = []
    for m in model.modules():
        dicts += [m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks]
    for p in model.parameters():
        dicts += [p._post_accumulate_grad_hooks or {}, p._backward_hooks or {}]
    if opt is not None:
        dicts += [opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks]
    return dicts


def assert_same_weights(plain: torch.nn.Module, logged: torch.nn.Module) -> None:
    """Training with the logger left every weight bit-for-bit as training without it."""
    for (name, a), b in zip(plain.state_dict().items(), logged.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs from the run without the logger"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The fused kernels launched, by name, while the test runs (skipped where Triton is not
    importable)."""
    fused = pytest.importorskip("tblog_hooks.kernels.fused", reason="Triton is not importable")
    launched: Counter[str] = Counter()
    for name in ("_partials", "_combine", "_scaled_counts", "_buckets", "_gather_samples"):
        kernel = getattr(fused, name)

        def run(*args: object, _run: object = kernel.run, _name: str = name, **kwargs: object) -> object:
            launched[_name] += 1
            return _run(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(kernel, "run", run)
    return launched


def _accumulator(log_dir: str | Path) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(
        str(log_dir), size_guidance={event_accumulator.IMAGES: 0, event_accumulator.TENSORS: 0}
    )
    acc.Reload()
    return acc


def read_tags(log_dir: str | Path) -> dict[str, list[str]]:
    """Every tag in the run, by kind (``scalars``, ``images``, ``tensors``, ...)."""
    return _accumulator(log_dir).Tags()


def read_text(log_dir: str | Path, tag: str) -> dict[int, str]:
    """Text summaries of ``tag`` (as written by ``add_text``), by step."""
    events = _accumulator(log_dir).Tensors(f"{tag}/text_summary")
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events}


def read_tensors(log_dir: str | Path, tag: str) -> dict[int, np.ndarray]:
    """The tensors of ``tag`` by step, decoded by TensorBoard (strings as ``bytes``)."""
    return {e.step: tensor_util.make_ndarray(e.tensor_proto) for e in _accumulator(log_dir).Tensors(tag)}


def written_order(log_dir: str | Path, prefix: str = "") -> list[str]:
    """The forward order a logger (of ``prefix=``) wrote last: its ``health/forward_order``
    string tensor as ``EventAccumulator`` reads it, the names percent-decoded; empty without one."""
    tag = f"{prefix}/health/forward_order" if prefix else "health/forward_order"
    if tag not in read_tags(log_dir)["tensors"]:
        return []
    written = read_tensors(log_dir, tag)
    return [urllib.parse.unquote(n.decode(), errors="surrogatepass") for n in written[max(written)]]


#: Copies of a run (:func:`without_tags`) with the forward order as one kind only: its string
#: tensor, its Markdown text (as versions before the tensor wrote it), or neither; by what is dropped.
ORDER_COPIES = {
    "tensor": ("health/forward_order/text_summary",),
    "text": ("health/forward_order",),
    "none": ("health/forward_order", "health/forward_order/text_summary"),
}


def without_tags(source: Path, target: Path, *tags: str) -> None:
    """``source``'s event files copied into ``target`` (same names, same records) without the
    values of ``tags``."""
    target.mkdir(parents=True)
    for path in sorted(source.glob("events.out.tfevents.*")):
        with open(target / path.name, "wb") as file:
            records = record_writer.RecordWriter(file)
            for event in event_file_loader.LegacyEventFileLoader(str(path)).Load():
                kept = [v for v in event.summary.value if v.tag not in tags]
                del event.summary.value[:]
                event.summary.value.extend(kept)
                records.write(event.SerializeToString())


def read_images(log_dir: str | Path, tag: str) -> dict[int, np.ndarray]:
    """Images of ``tag`` decoded with Pillow (independent of the package's PNG writer), H x W x C."""
    events = _accumulator(log_dir).Images(tag)
    return {e.step: np.asarray(Image.open(io.BytesIO(e.encoded_image_string))) for e in events}


def read_layout(log_dir: str | Path) -> layout_pb2.Layout:
    """The custom-scalars layout written with ``add_custom_scalars``: the latest (TensorBoard shows it)."""
    event = _accumulator(log_dir).Tensors("custom_scalars__config__")[-1]
    return layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])


def spawn_ranks(
    worker: Callable[[int, str], None], root: str | Path, world: int, timeout: datetime.timedelta | None = None
) -> None:
    """``worker(rank, root)`` in ``world`` CPU processes of one gloo process group (its file store in ``root``)."""
    mp.spawn(_rank, args=(worker, str(root), world, timeout), nprocs=world)


def _rank(
    rank: int, worker: Callable[[int, str], None], root: str, world: int, timeout: datetime.timedelta | None
) -> None:
    """One rank: ``worker`` between setting up and tearing down the process group."""
    faulthandler.enable()  # a crash in native code prints every thread's Python stack
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world, timeout=timeout)
    try:
        worker(rank, root)
        gc.collect()  # FSDP2 modules sit in reference cycles that hold the process group
        dist.barrier()  # no rank tears the store down while another still uses it
    finally:
        dist.destroy_process_group()
    # Leave without interpreter teardown, where a gloo thread that drops the last reference to a
    # tensor must take the GIL of a finalizing interpreter, which aborts the process (SIGABRT,
    # "terminate called without an active exception"; pytorch/pytorch#179291). Seen once in CI.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_same_run(
    run: Run, reference: Run, steps: range, roots: tuple[str, ...], *, histograms: bool = True, gradients: float = 1.0
) -> None:
    """Every scalar (and histogram) under ``roots`` at ``steps``: the same tags, the same values
    (output gradients ``gradients`` times the reference's: norms, extremes, log10 histograms shifted)."""
    compared = [("scalar", run.scalars, reference.scalars)]
    if histograms:
        compared.append(("histogram", run.histograms, reference.histograms))  # type: ignore[arg-type]
    for kind, ours, theirs in compared:
        tags = sorted(t for t in theirs if t.startswith(roots))
        assert tags and sorted(t for t in ours if t.startswith(roots)) == tags, kind
        for tag in tags:
            for step in steps:
                assert (step in ours[tag]) == (step in theirs[tag]), (tag, step)
                if step not in theirs[tag]:
                    continue  # (an update ratio of all-zero weights)
                got, want = ours[tag][step], theirs[tag][step]
                if kind == "scalar":
                    scale = gradients if tag.startswith(("gradient/norm/", "gradient/amax/", "gradient/rms/")) else 1.0
                    assert got == pytest.approx(want * scale, rel=1e-4, abs=1e-7), (tag, step)
                    continue
                scale, shift = (gradients, 0.0) if tag.startswith("gradient/") else (1.0, 0.0)
                if tag.startswith("gradient_log10/"):
                    scale, shift = 1.0, math.log10(gradients)
                # Extremes as exact as float32 sums in another order allow. The smallest gradient
                # magnitude (gradient_log10's min) is a near-cancellation of larger terms, whose
                # rounding error is of the order of those terms: not compared.
                assert got.num == want.num, (tag, step)  # type: ignore[attr-defined]
                assert got.max == pytest.approx(want.max * scale + shift, rel=1e-5, abs=1e-7), (tag, step)  # type: ignore[attr-defined]
                if not tag.startswith("gradient_log10/"):
                    assert got.min == pytest.approx(want.min * scale, rel=1e-5, abs=1e-7), (tag, step)  # type: ignore[attr-defined]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def tensorboard(logdir: Path, *flags: str) -> Iterator[str]:
    """Start ``tensorboard --logdir`` (with ``flags``) on a free port; yield its URL; stop it (and its
    data server). Its output goes to ``tensorboard.log`` beside ``logdir``."""
    executable = Path(sys.executable).with_name("tensorboard")
    assert executable.exists(), f"tensorboard is a dependency and should be next to {sys.executable}"
    port = _free_port()
    log = open(logdir.parent / "tensorboard.log", "w+")  # noqa: SIM115 (closed in finally)
    args = ["--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1", *flags]
    server = subprocess.Popen(
        [str(executable), *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the data server it starts goes with it
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


TENSORBOARD_READY_S = 90  # how long a test waits for a server to load its runs


def get(url: str, path: str, **query: str) -> object:
    """The JSON a server answers at ``path`` with ``query``."""
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(query)}", timeout=30) as response:
        return json.load(response)


def wait_until_loaded(url: str, logdir: Path) -> None:
    """Poll until TensorBoard (which loads runs in the background) serves every scalar of every run
    under ``logdir`` (each of whose tags must fit in the server's reservoir)."""
    expected = {run.name: read_run(run).scalars for run in logdir.iterdir()}
    deadline = time.monotonic() + TENSORBOARD_READY_S
    while time.monotonic() < deadline:
        try:
            served = get(url, "/data/plugin/scalars/tags")
            if all(set(tags) <= set(served.get(run, {})) for run, tags in expected.items()):  # type: ignore[union-attr]
                counts = {
                    (run, tag): len(get(url, "/data/plugin/scalars/scalars", run=run, tag=tag))  # type: ignore[arg-type]
                    for run, tags in expected.items()
                    for tag in tags
                }
                if all(counts[run, tag] == len(v) for run, t in expected.items() for tag, v in t.items()):
                    return
        except (urllib.error.URLError, ConnectionError):
            pass  # not listening yet
        time.sleep(0.5)
    pytest.fail(f"tensorboard did not load the runs; its log:\n{(logdir.parent / 'tensorboard.log').read_text()}")
