"""The C CRC-32C is given to the logger's own writer only, writes the same bytes as TensorBoard's
pure-Python one, and is taken back at close()."""

from __future__ import annotations

import os

import torch
from conftest import read_run
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_crc
from tensorboard.summary.writer import record_writer
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger
from tblog_hooks.output.event_files import frame


def _record_writer(writer: SummaryWriter) -> record_writer.RecordWriter:
    return writer._get_file_writer().event_writer._async_writer._writer


def _own_write(writer: SummaryWriter) -> bool:
    """Whether the writer's record writer has a ``write`` of its own (the fast checksum)."""
    return "write" in vars(_record_writer(writer))


def test_frames_are_tensorboards() -> None:
    class File:
        data = b""

        def write(self, data: bytes) -> None:
            self.data += data

    for payload in (b"", b"x", os.urandom(1000), os.urandom(70_000)):
        file = File()
        record_writer.RecordWriter(file).write(payload)  # TensorBoard's own framing and checksum
        assert frame(payload) == file.data


def test_only_the_loggers_writer_changes_and_only_until_close(tmp_path) -> None:
    module_crc = record_writer.masked_crc32c
    model, second = nn.Linear(3, 2), nn.Linear(3, 2)
    given, other = SummaryWriter(tmp_path / "given"), SummaryWriter(tmp_path / "other")
    owned = HookLogger(model, log_dir=tmp_path / "owned", every=1)
    shared = HookLogger(second, writer=given, every=1, prefix="second")
    assert _own_write(owned.writer) and _own_write(given)  # type: ignore[arg-type]
    assert not _own_write(other)  # a writer no logger writes to keeps TensorBoard's checksum
    assert record_writer.masked_crc32c is module_crc is tensorboard_crc  # nothing process-wide
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        second(torch.randn(4, 3)).sum().backward()
        owned.step()
        shared.step()
    owned.close()
    shared.close()
    assert not _own_write(given)  # given back, still open
    given.add_scalar("after", 1.0, 0)
    given.close()
    other.close()
    assert set(read_run(tmp_path / "owned").scalars["gradient/norm/root"]) == {0, 1, 2}
    run = read_run(tmp_path / "given")
    assert set(run.scalars["second/gradient/norm/root"]) == {0, 1, 2} and run.scalars["after"] == {0: 1.0}
