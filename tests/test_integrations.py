"""The Lightning and Hugging Face Trainer callbacks, run with the real frameworks on the CPU."""

from __future__ import annotations

import copy
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_same_weights, hook_dicts, read_run
from models import lightning_trainer, mlp
from torch import nn

from tblog_hooks import HookLoggerError

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

from tblog_hooks.integrations import lightning as lightning_hooks  # noqa: E402
from tblog_hooks.integrations import transformers as transformers_hooks  # noqa: E402

X, Y = torch.randn(24, 4, generator=torch.Generator().manual_seed(1)), torch.randn(24, 1)


def _total_norm(module: nn.Module) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in module.parameters()]))


# -- without the frameworks -------------------------------------------------------------------------


def test_import_tblog_hooks_imports_no_framework() -> None:
    code = (
        "import sys, tblog_hooks, tblog_hooks.integrations;"
        "print(sorted({'lightning', 'pytorch_lightning', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("extra", ["lightning", "transformers"])
def test_callback_without_its_framework_names_the_extra(monkeypatch, extra: str) -> None:
    monkeypatch.setitem(sys.modules, extra, None)  # import lightning / transformers now fails
    monkeypatch.delitem(sys.modules, f"tblog_hooks.integrations.{extra}")
    with pytest.raises(HookLoggerError, match=rf"pip install 'tblog-hooks\[{extra}\]'"):
        importlib.import_module(f"tblog_hooks.integrations.{extra}")


@pytest.mark.parametrize("integration", [lightning_hooks, transformers_hooks])
def test_options_the_framework_supplies_or_that_do_not_exist_are_rejected(integration) -> None:
    with pytest.raises(HookLoggerError, match=r"supplies 'writer', 'optimizer'.*leave them out"):
        integration.HookLoggerCallback(writer=None, optimizer=None)
    with pytest.raises(HookLoggerError, match=r"'evry' \(did you mean 'every'\?\)"):
        integration.HookLoggerCallback(evry=5)


# -- Lightning -----------------------------------------------------------------------------------------


class _LitNet(pl.LightningModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.net = mlp(4, 8, 1, act=nn.ReLU)
        self.fail_at = fail_at

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fail_at:
            raise RuntimeError("failed on purpose")
        x, y = batch
        return (self.net(x) - y).pow(2).mean()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log("total_norm", _total_norm(self))  # Lightning's own scalar of the step's gradient

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path: Path, module: _LitNet, callbacks: list, ckpt_path: Path | None = None, **args) -> pl.Trainer:
    """Two epochs of 12 batches of 2; with accumulate_grad_batches=3, 8 optimizer steps."""
    trainer: pl.Trainer = lightning_trainer(
        tmp_path, callbacks, **{"max_epochs": 2, "accumulate_grad_batches": 3, **args}
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=2)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def test_lightning_logs_each_optimizer_step_at_lightnings_step_in_its_run(tmp_path) -> None:
    module = _LitNet()
    first = copy.deepcopy(module.net)
    trainer = _fit(tmp_path, module, [lightning_hooks.HookLoggerCallback()])  # every=log_every_n_steps=1
    assert trainer.global_step == 8
    run = read_run(trainer.logger.log_dir)  # the TensorBoardLogger's run holds both
    # Lightning shows the i-th optimizer step (0-based) at step i, as the logger does: equal values.
    assert sorted(run.scalars["total_norm"]) == list(range(8))
    assert run.scalars["param_grad/global_norm"] == pytest.approx(run.scalars["total_norm"], rel=1e-6)
    # Step 0 pools its three micro-batches (the first 6 samples).
    assert run.scalar("activation/mean/net.2", 0) == pytest.approx(first(X[:6]).mean().item(), rel=1e-5)


def test_lightning_takes_the_scaler_of_the_precision_plugin(tmp_path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    amp = pl.plugins.precision.MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = _fit(tmp_path, _LitNet(), [lightning_hooks.HookLoggerCallback(every=1)], plugins=[amp])
    run = read_run(trainer.logger.log_dir)
    assert run.scalars["amp/loss_scale"] == dict.fromkeys(range(8), 1024.0)
    # Unscaled: the gradients Lightning's on_before_optimizer_step sees (after scaler.unscale_).
    assert run.scalars["param_grad/global_norm"] == pytest.approx(run.scalars["total_norm"], rel=1e-6)


def test_lightning_every_defaults_to_log_every_n_steps_and_writes_to_log_dir_without_tensorboard_logger(
    tmp_path,
) -> None:
    trainer = _fit(tmp_path, _LitNet(), [lightning_hooks.HookLoggerCallback()], log_every_n_steps=4, logger=False)
    assert trainer.log_dir == str(tmp_path)
    assert sorted(read_run(tmp_path).scalars["param_grad/global_norm"]) == [0, 4]


class _TwoOptimizers(_LitNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.net[0].parameters(), lr=0.1), torch.optim.SGD(self.net[2].parameters(), lr=0.1)]


def test_lightning_with_several_optimizers_is_a_clear_error(tmp_path) -> None:
    module = _TwoOptimizers()
    with pytest.raises(HookLoggerError, match=r"exactly one optimizer .* the Trainer has 2"):
        _fit(tmp_path, module, [lightning_hooks.HookLoggerCallback()], accumulate_grad_batches=1)
    assert not any(hook_dicts(module))


def test_lightning_resumed_fit_continues_the_step_numbers(tmp_path) -> None:
    trainer = _fit(tmp_path, _LitNet(), [])
    trainer.save_checkpoint(tmp_path / "8.ckpt")
    callback = lightning_hooks.HookLoggerCallback(every=2)
    resumed = _fit(tmp_path, _LitNet(), [callback], ckpt_path=tmp_path / "8.ckpt", max_epochs=3)
    assert resumed.global_step == 12
    assert sorted(read_run(resumed.logger.log_dir).scalars["param_grad/global_norm"]) == [8, 10]


def test_lightning_training_is_unchanged_bit_for_bit(tmp_path) -> None:
    plain, logged = _LitNet(), _LitNet()
    logged.load_state_dict(plain.state_dict())
    _fit(tmp_path / "plain", plain, [])
    _fit(tmp_path / "logged", logged, [lightning_hooks.HookLoggerCallback(every=1)])
    assert_same_weights(plain, logged)


def test_lightning_leaves_no_hook_after_fit_and_after_an_exception(tmp_path) -> None:
    module, callback = _LitNet(), lightning_hooks.HookLoggerCallback(every=1)
    trainer = _fit(tmp_path / "ok", module, [callback])
    assert callback.hooks is None
    assert not any(hook_dicts(module, trainer.optimizers[0]))

    module, callback = _LitNet(fail_at=7), lightning_hooks.HookLoggerCallback(every=1)
    with pytest.raises(RuntimeError, match="failed on purpose"):
        _fit(tmp_path / "failed", module, [callback])
    assert callback.hooks is None
    assert not any(hook_dicts(module, module.optimizers().optimizer))
    # Batches 0-5 made optimizer steps 0 and 1; both were written before the hooks came off.
    run = read_run(tmp_path / "failed" / "lightning_logs" / "version_0")
    assert sorted(run.scalars["param_grad/global_norm"]) == [0, 1]


# -- Hugging Face Trainer --------------------------------------------------------------------------------


class _HFNet(nn.Module):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.net = mlp(4, 8, 1, act=nn.ReLU)
        self.calls, self.fail_at = 0, fail_at

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError("failed on purpose")
        out = self.net(x)
        return {"loss": (out - labels).pow(2).mean(), "logits": out}


class _Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": X[i], "labels": Y[i]}


def _trainer(tmp_path: Path, model: _HFNet, callbacks: list, **args) -> transformers.Trainer:
    """Two epochs of 12 batches of 2; with gradient_accumulation_steps=3, 8 optimizer steps."""
    training_args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        num_train_epochs=2,
        learning_rate=0.1,
        max_grad_norm=0,  # the Trainer's grad_norm is then the unclipped norm the optimizer sees
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **{"report_to": ["tensorboard"], **args},
    )
    return transformers.Trainer(model=model, args=training_args, train_dataset=_Samples(), callbacks=callbacks)


def _train(tmp_path: Path, model: _HFNet, callbacks: list, **args) -> transformers.Trainer:
    trainer = _trainer(tmp_path, model, callbacks, **args)
    trainer.train()
    return trainer


def _one_run(output_dir: Path) -> Path:
    (run,) = (output_dir / "runs").iterdir()
    return run


def test_transformers_logs_each_optimizer_step_at_the_trainers_global_step_in_its_run(tmp_path) -> None:
    trainer = _train(tmp_path, _HFNet(), [transformers_hooks.HookLoggerCallback()], logging_steps=2)
    assert trainer.state.global_step == 8
    run = read_run(_one_run(tmp_path))  # the TensorBoardCallback's run directory holds both
    # The Trainer shows an optimizer step at the global_step it ends with (1..8), as the callback does.
    assert sorted(run.scalars["train/loss"]) == [2, 4, 6, 8]
    assert run.scalars["param_grad/global_norm"] == pytest.approx(run.scalars["train/grad_norm"], rel=1e-6)


def test_transformers_honours_tensorboard_logging_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    _train(tmp_path / "out", _HFNet(), [transformers_hooks.HookLoggerCallback()], logging_steps=4)
    scalars = read_run(tmp_path / "tb").scalars
    assert sorted(scalars["train/loss"]) == sorted(scalars["param_grad/global_norm"]) == [4, 8]


def test_transformers_without_tensorboard_reporting_writes_where_the_trainer_would(tmp_path) -> None:
    _train(tmp_path, _HFNet(), [transformers_hooks.HookLoggerCallback()], logging_steps=4, report_to=[])
    assert sorted(read_run(_one_run(tmp_path)).scalars["param_grad/global_norm"]) == [4, 8]


def test_transformers_training_is_unchanged_bit_for_bit(tmp_path) -> None:
    plain, logged = _HFNet(), _HFNet()
    logged.load_state_dict(plain.state_dict())
    _train(tmp_path / "plain", plain, [])
    _train(tmp_path / "logged", logged, [transformers_hooks.HookLoggerCallback(every=1)])
    assert_same_weights(plain, logged)


def test_transformers_leaves_no_hook_after_train_and_after_an_exception(tmp_path) -> None:
    model, callback = _HFNet(), transformers_hooks.HookLoggerCallback(every=1)
    trainer = _train(tmp_path / "ok", model, [callback])
    assert callback.hooks is None
    assert not any(hook_dicts(model, trainer.optimizer.optimizer))

    model, callback = _HFNet(fail_at=8), transformers_hooks.HookLoggerCallback(every=1)
    trainer = _trainer(tmp_path / "failed", model, [callback])
    with pytest.raises(RuntimeError, match="failed on purpose"):
        trainer.train()
    # The Trainer tells callbacks of no exception: close() in a finally (or the next train()) removes them.
    callback.close()
    assert not any(hook_dicts(model))
    trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)  # its own writer too
    assert sorted(read_run(_one_run(tmp_path / "failed")).scalars["param_grad/global_norm"]) == [1, 2]
