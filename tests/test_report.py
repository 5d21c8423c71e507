"""``tblog-hooks report``: reads runs back, agrees with the live logger, fails cleanly."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import read_images, read_run
from PIL import Image
from torch import nn

from tblog_hooks import HookLogger
from tblog_hooks.cli import main


def _train_sigmoid(log_dir, steps: int = 3) -> list[tuple[str, str, int]]:
    layers: list[nn.Module] = []
    for _ in range(7):
        layers += [nn.Linear(8, 8), nn.Sigmoid()]
    model = nn.Sequential(*layers, nn.Linear(8, 2))
    with HookLogger(model, log_dir=log_dir, every=1) as hooks:
        for _ in range(steps):
            nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 2, (16,))).backward()
            hooks.step()
    return [(f.kind, f.module, f.step) for f in hooks.findings]


def test_report_table_json_and_fail_on(tmp_path, capsys) -> None:
    live = _train_sigmoid(tmp_path / "run")
    assert live
    assert main(["report", str(tmp_path / "run"), "--fail-on", "vanishing_gradient"]) == 1
    text = capsys.readouterr().out
    run = read_run(tmp_path / "run")
    norms = run.scalars["gradient/norm/0"]
    row = next(line.split() for line in text.splitlines() if line.startswith("0 "))
    assert row[1:4] == [f"{norms[2]:.3g}", f"{min(norms.values()):.3g}", f"{norms[2] / norms[0]:.3g}"]
    assert f"findings: {len(live)}" in text

    assert main(["report", str(tmp_path / "run"), "--json", "--fail-on", "dead_units,nonfinite"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run"] == "run" and doc["steps"] == [0, 1, 2]
    assert [m["module"] for m in doc["modules"]] == [str(i) for i in range(0, 15, 2)]  # forward order
    assert [(f["kind"], f["module"], f["step"]) for f in doc["findings"]] == live  # the same as live
    assert all(set(f) == {"kind", "module", "step", "value", "message"} for f in doc["findings"])


def test_report_png_and_several_runs(tmp_path, capsys) -> None:
    _train_sigmoid(tmp_path / "a", steps=1)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert main(["report", str(tmp_path), "--json", "--png", str(tmp_path / "flow.png")]) == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["run"] for d in docs] == ["a", "b"]
    for name in ("a", "b"):
        image = np.asarray(Image.open(tmp_path / f"flow-{name}.png"))
        assert image.ndim == 3 and image.shape[2] == 3
    # The PNG is the heatmap the logger wrote into the run.
    (logged,) = read_images(tmp_path / "a", "health/gradient_flow").values()
    assert np.array_equal(np.asarray(Image.open(io.BytesIO((tmp_path / "flow-a.png").read_bytes()))), logged)


def test_report_errors_are_messages_with_exit_2(tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "events.out.tfevents.1.host").write_bytes(b"\x00not an event file" * 20)
    cases = {
        str(tmp_path / "missing"): "is not a directory",
        str(tmp_path / "empty"): "no TensorBoard event files",
        str(tmp_path / "corrupt"): "no tblog_hooks statistics",
    }
    for path, message in cases.items():
        assert main(["report", path]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path), "--fail-on", "vanishing"])
    assert info.value.code == 2 and "valid kinds" in capsys.readouterr().err
