"""Where a logger's records go: its ``SummaryWriter``, that writer's run directory and ``prefix=``.

Every record the logger writes passes through a :class:`Destination`, the one place a tag
gets its prefix. Live destinations are known here, so a second logger writing the same tags
into the same directory is noticed, and loggers sharing a directory share one custom-scalars
layout (TensorBoard shows only the latest layout of a run).
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

from .._compat import event_file_writer, writer_closed
from ..errors import HookLoggerError
from .events import to_proto
from .summary import StepSummary

ChartLayout = dict[str, dict[str, list[Any]]]  # {category: {chart: [kind, [tag regex, ...]]}}

_LIVE: weakref.WeakSet[Destination] = weakref.WeakSet()  # destinations of loggers not yet closed
_LIVE_LOCK = threading.RLock()  # loggers are made and closed (or collected) on any thread


def run_directory(writer: SummaryWriter) -> str:
    """The writer's run directory as one string per directory (remote URLs as they are)."""
    log_dir = str(writer.get_logdir())
    return log_dir if "://" in log_dir else os.path.realpath(log_dir)


class Destination:
    """A logger's writer and tag prefix: ``{prefix}/{tag}`` for every tag it writes."""

    def __init__(self, writer: SummaryWriter, prefix: str | None) -> None:
        self.writer, self.prefix = writer, prefix
        self.directory = run_directory(writer)
        self._layout: ChartLayout = {}  # this logger's categories, prefixed, once written

    def tag(self, tag: str) -> str:
        return tag if self.prefix is None else f"{self.prefix}/{tag}"

    def open(self) -> bool:
        """Count as live; returns whether another live destination already writes the same
        tags (same run directory, same prefix)."""
        with _LIVE_LOCK:
            clash = any(d.directory == self.directory and d.prefix == self.prefix for d in list(_LIVE))
            _LIVE.add(self)
        return clash

    def close(self) -> None:
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def write(self, summary: StepSummary) -> None:
        """Append one step's event (the caller flushes once the step's last event is added)."""
        self._check_open()
        proto = to_proto(summary)
        if self.prefix is not None:
            for value in proto.value:
                value.tag = self.tag(value.tag)
        event_file_writer(self.writer).add_summary(proto, global_step=summary.step)

    def write_series(self, values: Mapping[int, Mapping[str, float]]) -> None:
        """Scalars of several steps (``{step: {tag: value}}``), one event per step in step order."""
        self._check_open()
        events = event_file_writer(self.writer)
        for step in sorted(values):
            scalars = [Summary.Value(tag=self.tag(t), simple_value=v) for t, v in values[step].items()]
            events.add_summary(Summary(value=scalars), global_step=step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._check_open()
        self.writer.add_text(self.tag(tag), text, step)

    def add_custom_scalars(self, layout: ChartLayout) -> None:
        """Write ``layout`` (chart regexes anchored as ``^tag$``), prefixed, merged with the
        layouts of the other live loggers writing into this directory, through each of their
        writers: whichever event file TensorBoard reads last then holds every chart."""
        self._check_open()
        self._layout = {
            self.tag(category): {
                chart: [kind, [self._regex(r) for r in regexes]] for chart, (kind, regexes) in charts.items()
            }
            for category, charts in layout.items()
        }
        with _LIVE_LOCK:
            sharing = [self] + [d for d in list(_LIVE) if d is not self and d.directory == self.directory]
        merged = {c: charts for d in sharing for c, charts in d._layout.items()}
        merged = dict(sorted(merged.items(), key=lambda item: item[0]))
        writers = {id(d.writer): d.writer for d in sharing}
        for writer in writers.values():
            if not writer_closed(writer):
                writer.add_custom_scalars(merged)

    def flush(self) -> None:
        self.writer.flush()

    def _regex(self, regex: str) -> str:
        return regex if self.prefix is None else "^" + re.escape(f"{self.prefix}/") + regex.removeprefix("^")

    def _check_open(self) -> None:
        if writer_closed(self.writer):
            raise HookLoggerError(
                f"the SummaryWriter passed as writer= (log_dir={self.writer.get_logdir()!r}) was closed while "
                "the logger was attached; writing would open a new event file: close the logger before the writer"
            )
