"""Nothing logged is lost: every completed logged step is on disk when ``step()`` returns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import read_run

import tblog_hooks

K = 5

# Logs steps 0..K-1, then freezes itself (every thread, TensorBoard's writer thread too) the moment
# the K-th step() returns, with step K begun: what is not on disk by then is lost to the SIGKILL.
TRAIN = textwrap.dedent(
    """
    import os
    import signal
    import sys
    import torch
    from torch import nn
    from tblog_hooks import HookLogger

    torch.set_num_threads(1)
    sys.setswitchinterval(1.0)  # the writer thread runs only while the main thread waits: the worst case
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = HookLogger(model, log_dir=sys.argv[1], every=1, histograms=1)
    for step in range(int(sys.argv[2])):
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        hooks.step()
    os.kill(os.getpid(), signal.SIGSTOP)
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals")
def test_sigkill_after_k_logged_steps_keeps_steps_0_to_k_minus_1(tmp_path) -> None:
    package_root = os.path.dirname(os.path.dirname(tblog_hooks.__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", TRAIN, str(tmp_path), str(K)], env=env)
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)  # returns when the child stops itself (or dies)
        assert os.WIFSTOPPED(status), f"the child ended before stopping: status {status}"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    run = read_run(tmp_path)
    for tag in ("activation/mean/0", "gradient/norm/2", "param_grad/global_norm"):
        assert sorted(run.scalars[tag]) == list(range(K)), tag
    assert sorted(run.histograms["activation/0"]) == list(range(K))
