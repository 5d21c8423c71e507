"""Training on a side stream (``with torch.cuda.stream(s):``): a logged step is packed on the stream
current at ``step()`` only after it waited for ``s``, and every tensor it packs is marked as used
by that stream, so that ``s`` cannot reuse the memory before the packing reads it. Checked with
stand-in streams here (no GPU); on CUDA by tests/test_cuda.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from models import mlp
from torch import nn

from tblog_hooks import Histograms, HookLogger
from tblog_hooks.stats import packing
from tblog_hooks.transport.streams import Streams


@dataclass(eq=False)
class FakeStream:
    name: str
    events: list[tuple[str, object]]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def wait_stream(self, other: FakeStream) -> None:
        self.events.append((f"{self.name} waits", other.name))


def test_a_step_recorded_on_a_side_stream_is_packed_after_it_and_keeps_its_memory(tmp_path, monkeypatch) -> None:
    events: list[tuple[str, object]] = []
    side, default = FakeStream("side", events), FakeStream("default", events)
    current = [side]  # the stream the hooks run on
    monkeypatch.setattr(Streams, "note", lambda self, t: self._seen.add(current[0]))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: events.append(("record", (id(t), s.name))))
    packed: list[int] = []
    real_pack = packing.pack

    def spy(records, device, recipe):  # type: ignore[no-untyped-def]
        events.append(("pack", None))
        packed.extend(id(t) for record in records for t in record.values)
        return real_pack(records, device, recipe)

    monkeypatch.setattr(packing, "pack", spy)
    model = mlp(4, 8, 2, act=nn.ReLU, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=tmp_path, every=1, histograms=Histograms(every_logged=1)) as hooks:
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        current[0] = default  # step() outside the stream's block
        hooks.step()
    kinds = [kind for kind, _ in events]
    assert events[0] == ("default waits", "side")
    assert kinds.count("default waits") == 1 and kinds.index("pack") > kinds.index("record")
    marked = {record[0] for kind, record in events if kind == "record" and record[1] == "default"}  # type: ignore[index]
    # Every packed tensor but the binned histograms, which packing itself makes on its stream.
    assert len(set(packed) - marked) == 1 and len(packed) > 10


def test_a_step_on_one_stream_makes_no_stream_call(monkeypatch) -> None:
    events: list[tuple[str, object]] = []
    default = FakeStream("default", events)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: events.append(("record", s.name)))
    streams = Streams()
    streams._seen.add(default)
    streams.wait()
    streams.keep([torch.ones(2)])
    assert events == [] and not streams._seen


def test_cpu_tensors_note_no_stream() -> None:
    streams = Streams()
    streams.note(torch.ones(2))
    assert not streams._seen
