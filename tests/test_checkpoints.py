"""A model saved, pickled or copied while a logger is attached comes out as if no logger were:
the word-language-model example's LSTM and Transformer, saved each best epoch with
``torch.save(model)`` and loaded with ``torch.load``'s default ``weights_only=True``, deep-copied
(EMA, ``AveragedModel``) and pickled, also where tblog_hooks cannot be imported."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import read_run
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.serialization import get_unsafe_globals_in_checkpoint, safe_globals
from word_language_model import TOKENS, RNNModel, TransformerModel, outputs, resolve

from tblog_hooks import HookLogger

BPTT, BATCH = 6, 3
MODELS = {"lstm": RNNModel, "transformer": TransformerModel}
#: nn.Transformer says so of the example's model (its layers are not batch_first).
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")


def _data(n: int) -> torch.Tensor:
    """Random tokens, batchified as the example's (sequence x batch)."""
    return torch.randint(0, TOKENS, (n * BPTT + 1, BATCH))


class _Training:
    """The example's training loop for ``model`` (the LSTM: manual SGD after ``clip_grad_norm_``;
    the Transformer: AdamW), a step per ``hooks.step()``, and each step's decoder weight gradient
    norm computed apart (plain torch), to compare with what the logger wrote."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.norms: list[float] = []
        self.lstm = isinstance(model, RNNModel)
        self.opt = None if self.lstm else torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.hidden = model.init_hidden(BATCH) if self.lstm else None

    def backward(self, data: torch.Tensor, i: int) -> None:
        """The forward and backward of the batch at ``i``: the logged step's hooks are all in place after it."""
        source, targets = data[i : i + BPTT], data[i + 1 : i + 1 + BPTT].reshape(-1)
        self.model.train()
        self.model.zero_grad()
        if self.lstm:
            self.hidden = tuple(h.detach() for h in self.hidden)
            output, self.hidden = self.model(source, self.hidden)
        else:
            output = self.model(source).view(-1, TOKENS)
        F.nll_loss(output, targets).backward()
        self.norms.append(float(self.model.decoder.weight.grad.double().norm()))

    def update(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.25)
        if self.opt is None:
            for p in self.model.parameters():
                p.data.add_(p.grad, alpha=-1.0)
        else:
            self.opt.step()

    def epoch(self, hooks: HookLogger, data: torch.Tensor) -> None:
        for i in range(0, data.size(0) - 1, BPTT):
            self.backward(data, i)
            self.update()
            hooks.step()


def _hook_entries(model: nn.Module) -> list[tuple[str, object]]:
    """Every entry of every hook dict of ``model``'s modules and parameters, and anything set on
    those dicts, by where it is."""
    entries: list[tuple[str, object]] = []
    for name, module in model.named_modules():
        for attribute, hooks in vars(module).items():
            if "hooks" in attribute and isinstance(hooks, dict):
                entries += [(f"{name}.{attribute}", e) for e in [*hooks.items(), *vars(hooks).items()]]
    for name, p in model.named_parameters():
        for hooks in (p._post_accumulate_grad_hooks or {}, p._backward_hooks or {}):
            entries += [(name, e) for e in hooks.items()]
    return entries


def _ours(model: nn.Module) -> int:
    """How many forward (pre-)hooks the model's modules carry."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("kind", MODELS)
def test_model_saved_each_best_epoch_loads_with_weights_only_and_carries_no_hook(tmp_path, kind: str) -> None:
    model = MODELS[kind]()
    torch.save(model, tmp_path / "plain.pt")  # never attached: what its checkpoint needs
    needed = get_unsafe_globals_in_checkpoint(tmp_path / "plain.pt")
    training, data, val = _Training(model), _data(3), _data(1)
    with HookLogger(model, log_dir=tmp_path / "run", every=1) as hooks:
        attached = _ours(model)
        for epoch in range(2):
            training.epoch(hooks, data)
            expected = outputs(model, val)  # the example's evaluate(), then its torch.save of the best model
            path = tmp_path / f"model-{epoch}.pt"
            torch.save(model, path)
            assert sorted(get_unsafe_globals_in_checkpoint(path)) == sorted(needed)  # nothing more
            assert b"tblog_hooks" not in path.read_bytes()
            with safe_globals(resolve(needed)):
                loaded = torch.load(path)  # weights_only=True
            assert _hook_entries(loaded) == []
            assert torch.equal(outputs(loaded, val), expected)
            assert _ours(model) == attached  # the model keeps the logger's hooks
    assert _hook_entries(model) == []
    run = read_run(tmp_path / "run")
    logged = run.scalars["param_grad/norm/decoder.weight"]
    assert sorted(logged) == list(range(2 * 3))  # every step, before and after each save
    assert [logged[step] for step in sorted(logged)] == pytest.approx(training.norms, rel=1e-5)


@pytest.mark.parametrize("kind", MODELS)
def test_deep_copies_and_pickles_carry_no_hook_and_never_log(tmp_path, kind: str) -> None:
    """EMA (``AveragedModel``), ``copy.deepcopy`` and ``pickle`` made in the middle of a logged
    step (after its backward: the parameters' hooks are in place too) and between steps; the
    copies train in a logged step, and the logger writes the model's values only."""
    model = MODELS[kind]()
    training, data, val = _Training(model), _data(4), _data(1)
    with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        attached = _ours(model)
        training.epoch(hooks, data[: 2 * BPTT + 1])
        training.backward(data, 2 * BPTT)
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        mid_step = [ema.module, copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
        expected = outputs(model, val)
        assert all(torch.equal(outputs(twin, val), expected) for twin in mid_step)
        training.update()
        hooks.step()
        between = copy.deepcopy(model)
        assert torch.equal(outputs(between, val), outputs(model, val))
        assert _ours(model) == attached
        for twin in [ema, *mid_step, between]:
            assert _hook_entries(twin) == []
        for twin in [*mid_step[1:], between]:  # each trains as the model does, with no logger
            _Training(twin).backward(data, 3 * BPTT)
        ema.update_parameters(model)
        training.epoch(hooks, data[3 * BPTT :])
        assert _ours(model) == attached
    assert _hook_entries(model) == []
    logged = read_run(tmp_path).scalars["param_grad/norm/decoder.weight"]
    assert [logged[step] for step in sorted(logged)] == pytest.approx(training.norms, rel=1e-5)
    assert sorted(logged) == [0, 1, 2, 3]


_LOAD_WITHOUT_TBLOG_HOOKS = """
import json, sys
sys.modules["tblog_hooks"] = None  # as if not installed: importing it raises ModuleNotFoundError
tests, job = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, tests)
import torch
from word_language_model import outputs, resolve
for path, needed in job:
    with torch.serialization.safe_globals(resolve(needed)):
        model = torch.load(path)  # weights_only=True
    hooks = [d for m in model.modules() for k, d in vars(m).items() if "hooks" in k and (d or vars(d))]
    torch.save(outputs(model, torch.load(path + ".val")), path + ".out")
    print("loaded", len(hooks))
print(sorted(name for name, module in sys.modules.items() if name.split(".")[0] == "tblog_hooks" and module))
"""


def test_checkpoints_load_with_weights_only_where_tblog_hooks_cannot_be_imported(tmp_path) -> None:
    job, expected = [], []
    for kind, build in MODELS.items():
        model = build()
        torch.save(model, tmp_path / f"{kind}-plain.pt")
        training, data = _Training(model), _data(2)
        # with every hook the logger places: on the model too, and one called on exceptions (attention=)
        with HookLogger(model, log_dir=tmp_path / kind, every=1, attention=True, spikes=True) as hooks:
            training.epoch(hooks, data[: BPTT + 1])
            training.backward(data, BPTT)  # mid-step: every hook of the logged step in place
            path = tmp_path / f"{kind}.pt"
            torch.save(model, path)
            torch.save(val := _data(1), f"{path}.val")
            expected.append(outputs(model, val))
        job.append((str(path), get_unsafe_globals_in_checkpoint(tmp_path / f"{kind}-plain.pt")))
    done = subprocess.run(
        [sys.executable, "-I", "-c", _LOAD_WITHOUT_TBLOG_HOOKS, str(Path(__file__).parent), json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["loaded 0", "loaded 0", "[]"]
    for (path, _), reference in zip(job, expected):
        assert torch.equal(torch.load(f"{path}.out"), reference)


def test_a_hook_registered_again_by_other_code_refuses_to_be_copied_saying_why(tmp_path) -> None:
    """As ``torch.ao.quantization``'s module swaps do: the hook is on a module whose copies do not know it."""
    model, other = nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2)
    with HookLogger(model, log_dir=tmp_path):
        for hook in model[0]._forward_hooks.values():
            other.register_forward_hook(hook)
        with pytest.raises(TypeError, match=r"ForwardHook is a hook of a HookLogger .* close\(\) the HookLogger"):
            copy.deepcopy(other)
        with pytest.raises(TypeError, match=r"ForwardHook is a hook of a HookLogger"):
            torch.save(other, tmp_path / "other.pt")
