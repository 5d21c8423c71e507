"""The ``tblog-hooks demo`` command trains and writes a run TensorBoard can read."""

from __future__ import annotations

from conftest import read_run

from tblog_hooks.cli import main


def test_demo_writes_a_readable_run(tmp_path, capsys) -> None:
    assert main(["demo", "--logdir", str(tmp_path), "--steps", "4", "--every", "2", "--device", "cpu"]) == 0
    assert f"tensorboard --logdir {tmp_path}" in capsys.readouterr().out
    run = read_run(tmp_path / "resnet18")
    assert set(run.scalars["param_grad/global_norm"]) == {0, 2}
    assert "activation/layer4.1.conv2" in run.histograms
