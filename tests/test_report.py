"""``tblog-hooks report``: reads runs back, agrees with the live logger, fails cleanly."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import ORDER_COPIES, read_images, read_run, read_text, without_tags, written_order
from models import OutOfOrder, mlp, out_of_order_run, sigmoid_stack, train
from PIL import Image
from tensorboard.backend.event_processing import event_file_loader
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger
from tblog_hooks.cli import main, report
from tblog_hooks.stats.tags import ORDER_TAG


def _train_sigmoid(log_dir, steps: int = 3) -> list[tuple[str, str, int]]:
    model = sigmoid_stack(7, 8)
    with HookLogger(model, log_dir=log_dir, every=1, histograms=1) as hooks:  # steps alike in size
        train(
            hooks,
            (nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 2, (16,))) for _ in range(steps)),
        )
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


def test_the_forward_order_is_written_as_a_tensor_and_read_back(tmp_path, capsys) -> None:
    """The logger writes the forward order as a string tensor (and as Markdown text); the report
    lists the modules in the tensor's order, or from the text alone (a run written before the
    tensor) in the text's, and in their names' order from neither."""
    out_of_order_run(tmp_path / "written")
    assert written_order(tmp_path / "written") == list(OutOfOrder.FORWARD)
    for run, dropped in ORDER_COPIES.items():
        without_tags(tmp_path / "written", tmp_path / run, *dropped)
    assert written_order(tmp_path / "text") == [] and read_text(tmp_path / "text", ORDER_TAG)
    for run in ("written", "tensor", "text"):
        assert main(["report", str(tmp_path / run), "--json"]) == 0
        assert [m["module"] for m in json.loads(capsys.readouterr().out)["modules"]] == list(OutOfOrder.FORWARD)
    assert report.load(tmp_path / "none", "none").order == sorted(OutOfOrder.FORWARD) != list(OutOfOrder.FORWARD)


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
    (tmp_path / "a file").write_text("")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "events.out.tfevents.1.host").write_bytes(b"\x00not an event file" * 20)
    with SummaryWriter(tmp_path / "plain") as writer:
        writer.add_scalar("loss", 1.0, 0)
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(tmp_path / "a file"): "is not a directory",
        str(tmp_path / "empty"): "no TensorBoard event files",
        str(tmp_path / "corrupt"): "is damaged: the length of the record at byte 0 fails its checksum",
        str(tmp_path / "plain"): "skipped 'plain': no tblog_hooks statistics",
    }
    for path, message in cases.items():
        assert main(["report", path]) == 2
        captured = capsys.readouterr()
        assert message in captured.err and "Traceback" not in captured.err and not captured.out
    with pytest.raises(SystemExit) as info:
        main(["report", str(tmp_path), "--fail-on", "vanishing"])
    assert info.value.code == 2 and "valid kinds" in capsys.readouterr().err


def test_a_folder_reports_every_tblog_run_and_names_the_others(tmp_path, capsys, monkeypatch) -> None:
    live = _train_sigmoid(tmp_path / "a")
    with SummaryWriter(tmp_path / "plain") as writer:  # someone else's run
        writer.add_scalar("loss", 1.0, 0)
    SummaryWriter(tmp_path / "fresh").close()  # a run that has not logged a step yet
    assert main(["report", str(tmp_path), "--json", "--fail-on", "vanishing_gradient"]) == 1
    captured = capsys.readouterr()
    (doc,) = [json.loads(line) for line in captured.out.splitlines()]
    assert doc["run"] == "a" and len(doc["findings"]) == len(live)
    assert "skipped 'fresh': no tblog_hooks statistics" in captured.err
    assert "skipped 'plain': no tblog_hooks statistics" in captured.err
    # Inside a run directory, "." is named after the directory.
    monkeypatch.chdir(tmp_path / "a")
    assert main(["report", ".", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"] == "a"


def test_only_steps_the_logger_logged_count(tmp_path, capsys) -> None:
    # The user's own scalars in the same writer, every step; the logger logs every 5th.
    model = sigmoid_stack(7, 8)
    with SummaryWriter(tmp_path / "run") as writer, HookLogger(model, writer=writer, every=5) as hooks:
        for step in range(15):
            loss = nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 2, (16,)))
            loss.backward()
            writer.add_scalar("train/loss", loss.item(), step)
            writer.add_scalar("gradient/clip", 1.0, step)  # a user tag in a kind of the logger's
            hooks.step()
    assert main(["report", str(tmp_path / "run"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"] == [0, 5, 10]
    assert [(f["kind"], f["module"], f["step"]) for f in doc["findings"]] == [
        (f.kind, f.module, f.step) for f in hooks.findings
    ]
    assert doc["findings"]


def _event_files(run_dir) -> list:
    return sorted(run_dir.glob("events.out.tfevents.*"))


def test_a_damaged_event_file_is_an_error_a_cut_short_one_is_not(tmp_path, capsys) -> None:
    _train_sigmoid(tmp_path / "good" / "run", steps=4)
    shutil.copytree(tmp_path / "good", tmp_path / "damaged")
    shutil.copytree(tmp_path / "good", tmp_path / "cut")
    (event_file,) = _event_files(tmp_path / "damaged" / "run")
    data = bytearray(event_file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    event_file.write_bytes(bytes(data))
    assert main(["report", str(tmp_path / "damaged" / "run")]) == 2
    captured = capsys.readouterr()
    assert not captured.out and f"{str(event_file)!r} is damaged" in captured.err

    # A crash leaves the last record cut short: the steps before it are reported, as TensorBoard shows them.
    (event_file,) = _event_files(tmp_path / "cut" / "run")
    event_file.write_bytes(event_file.read_bytes()[:middle])
    shown = sorted(read_run(tmp_path / "cut" / "run").scalars["gradient/norm/0"])
    assert main(["report", str(tmp_path / "cut" / "run"), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["steps"] == shown and 0 < len(shown) < 4 and not captured.err

    # In a folder, the intact run is reported and the exit status still says 2.
    shutil.copytree(tmp_path / "damaged" / "run", tmp_path / "good" / "damaged")
    assert main(["report", str(tmp_path / "good"), "--json"]) == 2
    captured = capsys.readouterr()
    assert [json.loads(line)["run"] for line in captured.out.splitlines()] == ["run"]
    assert "is damaged" in captured.err


def _train_mlp(log_dir, steps: int, *, skip: int = 0) -> dict[int, float]:
    """Log every 10th step; the first ``skip`` steps run no forward pass, so they log nothing
    (as a run resumed at step ``skip`` would). Returns the logged ``gradient/norm/0``."""
    model = mlp(4, 16, 2, act=nn.ReLU)
    with HookLogger(model, log_dir=log_dir, every=10) as hooks:
        for step in range(steps):
            if step >= skip:
                model(torch.randn(8, 4)).pow(2).sum().backward()
            hooks.step()
    return read_run(log_dir).scalars["gradient/norm/0"]


def test_steps_that_go_back_are_a_restart_the_later_run_wins(tmp_path, capsys) -> None:
    first = _train_mlp(tmp_path / "first", 25)  # logs 0, 10, 20
    resumed = _train_mlp(tmp_path / "resumed", 35, skip=10)  # logs 10, 20, 30
    assert set(first) == {0, 10, 20} and set(resumed) == {10, 20, 30}
    (tmp_path / "run").mkdir()
    # File names sort the other way round: the order is the files' start time.
    (first_file,), (resumed_file,) = _event_files(tmp_path / "first"), _event_files(tmp_path / "resumed")
    shutil.copy(first_file, tmp_path / "run" / "events.out.tfevents.9999999999.z")
    shutil.copy(resumed_file, tmp_path / "run" / "events.out.tfevents.0000000000.a")

    run = report.load(tmp_path / "run", "run")
    assert run.restarts == [(20, 10)]
    assert {step: s["gradient/norm/0"] for step, s in run.scalars.items()} == {0: first[0], **resumed}
    assert main(["report", str(tmp_path / "run"), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["steps"] == [0, 10, 20, 30]
    assert "run: the logged steps go back from 20 to 10" in captured.err


def _copy_with_prefix(source, prefix: str) -> list:
    """Every summary of ``source`` as a logger with ``prefix=`` writes it: ``{prefix}/{tag}``."""
    (path,) = _event_files(source)
    events = [e for e in event_file_loader.LegacyEventFileLoader(str(path)).Load() if e.HasField("summary")]
    for event in events:
        for value in event.summary.value:
            value.tag = f"{prefix}/{value.tag}"
    return events


def test_each_prefix_is_a_run_of_its_own(tmp_path, capsys) -> None:
    _train_sigmoid(tmp_path / "G")  # vanishing gradients
    _train_mlp(tmp_path / "D", 25)
    assert main(["report", str(tmp_path / "G"), "--json"]) == 0
    alone = {"G": json.loads(capsys.readouterr().out)}
    assert main(["report", str(tmp_path / "D"), "--json"]) == 0
    alone["D"] = json.loads(capsys.readouterr().out)
    with SummaryWriter(tmp_path / "gan") as writer:
        g, d = _copy_with_prefix(tmp_path / "G", "G"), _copy_with_prefix(tmp_path / "D", "D")
        for event in sorted(g + d, key=lambda e: e.step):  # interleaved, as two loggers of one loop write
            writer._get_file_writer().add_summary(event.summary, global_step=event.step)
    assert main(["report", str(tmp_path / "gan"), "--json", "--png", str(tmp_path / "flow.png")]) == 0
    captured = capsys.readouterr()
    docs = {doc.pop("run"): doc for doc in map(json.loads, captured.out.splitlines())}
    assert list(docs) == ["gan [D]", "gan [G]"] and "go back" not in captured.err
    with pytest.raises(report.ReportError, match=r"holds 2 tblog_hooks runs \('gan \[D\]', 'gan \[G\]'\), not one"):
        report.load(tmp_path / "gan", "gan")
    for prefix in ("D", "G"):
        del alone[prefix]["run"]
        assert docs[f"gan [{prefix}]"] == alone[prefix]
        assert (tmp_path / f"flow-gan-{prefix}.png").is_file()
