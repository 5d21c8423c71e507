"""No leaks over long runs: thousands of logged steps leave memory, threads, files, hooks and
tensors where they were."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import read_run
from models import train
from torch import nn
from torch.utils.hooks import RemovableHandle

from tblog_hooks import HookLogger

WARMUP, STEPS = 300, 3000  # warm-up past the heatmap window (240 logged steps), which fills first


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _writers_idle() -> None:
    """Wait until every TensorBoard writer thread waits for its queue: a thread between two
    records holds other (transient) objects than one that waits, which the census would count."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        frames = sys._current_frames()
        busy = [t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread"]
        if all(t.ident in frames and frames[t.ident].f_code.co_name == "wait" for t in busy):
            return
        time.sleep(0.001)
    raise AssertionError("a TensorBoard writer thread stayed busy for 10 s")


def _census(model: nn.Module) -> dict[str, int]:
    _writers_idle()
    while gc.collect():  # until nothing is left to collect: a finalizer can free more (Pillow's do)
        pass
    objects = gc.get_objects()
    hook_dicts = [d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks)]
    hook_dicts += [p._post_accumulate_grad_hooks or {} for p in model.parameters()]
    return {
        "hooks on the model": sum(map(len, hook_dicts)),
        "threads": threading.active_count(),
        "os threads": len(os.listdir("/proc/self/task")),
        "open files": len(os.listdir("/proc/self/fd")),
        "tensors": sum(issubclass(type(o), torch.Tensor) for o in objects),  # type(): no __class__ lookups
        "hook handles": sum(type(o) is RemovableHandle for o in objects),
        "python objects": len(objects),
    }


def soak(log_dir: str) -> None:
    """The soak itself, run in a fresh interpreter by the test below."""
    torch.set_num_threads(1)  # two cores shared with other test processes: a thread pool would spin
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    without_logger = _census(model)
    hooks = HookLogger(model, log_dir=log_dir, every=1)
    train(hooks, (model(x).square().mean() for _ in range(WARMUP)), opt)
    before, rss_before = _census(model), _rss_mib()
    train(hooks, (model(x).square().mean() for _ in range(STEPS)), opt)
    after, rss_after = _census(model), _rss_mib()
    assert after == before, (before, after)
    assert rss_after - rss_before < 10, (rss_before, rss_after)  # MiB; a kept histogram row per step is ~30
    hooks.close()
    closed = _census(model)
    for key in ("hooks on the model", "threads", "os threads", "open files", "tensors", "hook handles"):
        assert closed[key] == without_logger[key], (key, without_logger[key], closed[key])


@pytest.mark.soak
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc (Linux)")
def test_thousands_of_logged_steps_leak_nothing(tmp_path) -> None:
    # In a fresh interpreter: the census counts every Python object of the process, and a thread
    # another test left running allocates objects whenever it wakes (tqdm's monitor, started by the
    # demo's progress bar, every 10 s), so counts taken here could differ by objects not the logger's.
    tests = Path(__file__).resolve().parent
    path = os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])
    code = f"import test_soak; test_soak.soak({str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": path}, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-5000:]
    assert len(read_run(tmp_path).scalars["activation/mean/0"]) == WARMUP + STEPS
