"""Situations from real training loops that used to give no numbers, wrong numbers or silence."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import read_run, read_tags, spawn_ranks
from models import lightning_trainer, mlp, train
from torch import nn
from torch.nn.utils import parametrizations

from tblog_hooks import Histograms, HookLogger, HookLoggerError


def _losses(model: nn.Module, steps: int) -> Iterator[torch.Tensor]:
    return (model(torch.randn(8, 6)).square().mean() for _ in range(steps))


# -- torch.func inside a logged step ------------------------------------------------------------------
def test_torch_func_transforms_in_a_logged_step_are_skipped_and_logging_goes_on(tmp_path) -> None:
    model = mlp(6, 16, 16, 3, act=nn.ReLU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x[None],)).square().mean()

    x = torch.randn(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may be switched off
        with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt) as hooks:
            for _ in range(3):
                per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
                torch.func.vmap(model)(x[:, None])  # a forward through vmap(model)
                torch.func.jacrev(model)(x[0])
                with torch.no_grad():
                    expected = float(model[0](x).mean())  # the training pass's, as one process sees it
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                hooks.step()
    assert per_sample["0.weight"].shape == (8, 16, 6)
    run = read_run(tmp_path)
    assert set(run.scalars["activation/mean/0"]) == set(run.scalars["gradient/norm/4"]) == {0, 1, 2}
    assert run.scalar("activation/mean/0", 2) == pytest.approx(expected, rel=1e-5)


# -- parametrized layers ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "parametrize",
    [parametrizations.spectral_norm, parametrizations.weight_norm, parametrizations.orthogonal],
    ids=["spectral_norm", "weight_norm", "orthogonal"],
)
def test_parametrized_layers_are_watched_with_the_gradients_of_their_original_parameters(tmp_path, parametrize) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        parametrize(nn.Linear(6, 6)),
        nn.LeakyReLU(0.2),
        parametrize(nn.Linear(6, 6)),
        nn.LeakyReLU(0.2),
        nn.Linear(6, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt) as hooks:
        assert hooks.module_names == ("0", "2", "4")
        model(torch.randn(8, 6)).square().mean().backward()
        true_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
        named = {name: p.grad.norm() for name, p in model.named_parameters()}
        opt.step()
        hooks.step()
    run = read_run(tmp_path)
    assert run.scalar("param_grad/global_norm", 0) == pytest.approx(true_norm, rel=1e-5)
    if parametrize is parametrizations.weight_norm:  # magnitude and direction
        expected = {"0.weight.original0": "0.parametrizations.weight.original0"}
    else:
        expected = {"0.weight": "0.parametrizations.weight.original"}
    for tag, name in {**expected, "0.bias": "0.bias"}.items():
        assert run.scalar(f"param_grad/norm/{tag}", 0) == pytest.approx(float(named[name]), rel=1e-5)
    assert "activation/mean/2" in run.scalars


# -- dead units are the last dim, except for convolutions and their norms ------------------------------
def test_dead_units_of_a_transformer_mlp_are_on_the_last_dim(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 8))
    with torch.no_grad():
        model[0].bias[:30] = -100.0  # 30 of 32 hidden units never fire
    x = torch.randn(4, 10, 8)  # batch, sequence, features
    with HookLogger(model, log_dir=tmp_path, every=1, modules=["0", "1", "2", "3"]) as hooks:
        model(x).square().mean().backward()
        hooks.step()
        found = hooks.findings
    run = read_run(tmp_path)
    assert run.scalar("activation/dead_frac/1", 0) == pytest.approx(30 / 32)
    assert [(f.kind, f.module) for f in found if f.kind == "dead_units"] == [("dead_units", "0"), ("dead_units", "1")]


def test_dead_units_of_a_convolution_are_its_channels(tmp_path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 3, 6, 6))
    with torch.no_grad():
        model[0].bias[:3] = -100.0
        model[0].weight.mul_(0.01)
    x = torch.randn(2, 3, 6, 6)
    model.eval()  # batch norm with its running statistics: the conv's dead channels stay dead
    with HookLogger(model, log_dir=tmp_path, every=1, modules=["0", "1", "2"], eval_passes=True) as hooks:
        out = model(x)
        hooks.step()
    run = read_run(tmp_path)
    relu = model[2](model[1](model[0](x)))  # [N, C, H, W]: units on the last dim for a ReLU
    assert run.scalar("activation/dead_frac/0", 0) == 0.75
    assert run.scalar("activation/dead_frac/2", 0) == float((relu.amax(dim=(0, 1, 2)) <= 0).float().mean())
    assert out.shape == (2, 2)


# -- options that would do nothing -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (
            {"histograms": Histograms(kinds=("input", "activation"))},
            "asks for 'input' histograms, which need inputs=True",
        ),
        ({"gradients": False, "histograms": Histograms(kinds=["gradient_log10"])}, "need gradients=True"),
        ({"parameters": False, "histograms": Histograms(kinds=["param", "param_grad"])}, "need parameters=True"),
        ({"activations": False, "histograms": Histograms(kinds=["activation"])}, "need activations=True"),
    ],
)
def test_histogram_kinds_the_options_cannot_produce_are_an_error(tmp_path, options, fragment) -> None:
    model = mlp(6, 16, 16, 3, act=nn.ReLU)
    with pytest.raises(HookLoggerError, match=fragment):
        HookLogger(model, log_dir=tmp_path, **options)
    assert not model[0]._forward_hooks


def test_default_histogram_kinds_follow_the_options(tmp_path) -> None:
    model = mlp(6, 16, 16, 3, act=nn.ReLU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=tmp_path, every=1, histograms=Histograms(), inputs=True) as hooks:
        train(hooks, _losses(model, 1), opt)
    assert "input/0" in read_tags(tmp_path)["histograms"]


# -- wrappers --------------------------------------------------------------------------------------------
def test_data_parallel_is_unwrapped_like_ddp(tmp_path) -> None:
    model = mlp(6, 16, 16, 3, act=nn.ReLU)
    wrapped = nn.DataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(wrapped, log_dir=tmp_path, every=1) as hooks:
        assert hooks.module_names == ("0", "2", "4")
        train(hooks, _losses(wrapped, 1), opt)
    assert "gradient/norm/0" in read_run(tmp_path).scalars


@pytest.mark.parametrize("wrapper", [nn.DataParallel, lambda m: m], ids=["DataParallel", "plain"])
def test_a_compiled_model_is_refused_through_any_wrapper_with_the_order_to_use(tmp_path, wrapper) -> None:
    model = mlp(6, 16, 16, 3, act=nn.ReLU)
    compiled = torch.compile(model)
    with pytest.raises(HookLoggerError, match=r"already compiled.*HookLogger\(model, optimizer=opt\); model = torch"):
        HookLogger(wrapper(compiled), log_dir=tmp_path)
    assert not model[0]._forward_hooks


# -- a model left in eval mode -----------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", [False, True])
def test_training_in_eval_mode_warns_once_naming_the_fix(tmp_path, optimizer: bool) -> None:
    model = mlp(6, 16, 16, 3, act=nn.ReLU).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pytest.warns(
            RuntimeWarning, match=r"every forward pass .* eval mode.*model\.train\(\).*eval_passes=True"
        ) as caught,
        HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt if optimizer else None) as hooks,
    ):
        for loss in _losses(model, 3):  # step() called here, in this file: the warning must point at it
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    assert sum("eval mode" in str(w.message) for w in caught) == 1
    assert caught[0].filename == __file__  # it points at the user's step() call


def test_evaluation_in_a_logged_step_beside_training_does_not_warn(tmp_path) -> None:
    model = mlp(6, 16, 16, 3, act=nn.ReLU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
            for _ in range(2):
                model.eval()
                model(torch.randn(2, 6))  # an evaluation with gradients enabled
                model.train()
                model(torch.randn(8, 6)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                hooks.step()


# -- torch.compile prints no warning about the library ----------------------------------------------------
def test_compiling_prints_no_warning_about_the_library(tmp_path) -> None:
    model = mlp(6, 16, 16, 3, act=nn.ReLU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hooks = HookLogger(model, log_dir=tmp_path, every=1)
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            compiled(torch.randn(8, 6)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
        hooks.close()
    ours = [str(w.message) for w in caught if "tblog_hooks" in str(w.message) or "tblog_hooks" in w.filename]
    assert not ours, ours
    assert set(read_run(tmp_path).scalars["input/nonfinite/0"]) == {0, 1}


# -- framework callbacks ----------------------------------------------------------------------------------
def _lightning_module() -> object:
    """A LightningModule around the MLP (made here: Lightning is imported by its tests only)."""
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(6, 16, 16, 3, act=nn.ReLU)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Lit()


def _loader() -> torch.utils.data.DataLoader:
    data = torch.utils.data.TensorDataset(torch.randn(12, 6))
    return torch.utils.data.DataLoader(data, batch_size=2)


def _lightning_trainer(tmp_path: Path, **args: object) -> object:
    from tblog_hooks.integrations.lightning import HookLoggerCallback

    return lightning_trainer(tmp_path, [HookLoggerCallback()], **args)


def test_lightning_fit_after_another_stage_on_the_same_trainer_trains_and_logs(tmp_path) -> None:
    trainer = _lightning_trainer(tmp_path)
    module = _lightning_module()
    trainer.validate(module, _loader())  # type: ignore[attr-defined]  # closes the TensorBoard writer at its end
    trainer.fit(module, _loader())  # type: ignore[attr-defined]
    run = read_run(trainer.logger.log_dir)  # type: ignore[attr-defined]
    assert set(run.scalars["param_grad/global_norm"]) == set(range(6))


def test_lightning_fast_dev_run_writes_nothing_as_lightning_does(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    trainer = _lightning_trainer(tmp_path / "root", fast_dev_run=2)
    trainer.fit(_lightning_module(), _loader())  # type: ignore[attr-defined]
    assert trainer.global_step == 2  # type: ignore[attr-defined]
    assert not list(tmp_path.rglob("events.out.tfevents.*"))


def test_transformers_first_logged_step_has_histograms(tmp_path) -> None:
    import transformers

    from tblog_hooks.integrations.transformers import HookLoggerCallback

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(6, 16, 16, 3, act=nn.ReLU)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.net(x).square().mean()}

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": torch.randn(6, generator=torch.Generator().manual_seed(i))}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=16,
        logging_steps=4,
        save_strategy="no",
        use_cpu=True,
        report_to=["tensorboard"],
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=Net(), args=args, train_dataset=Samples(), callbacks=[HookLoggerCallback()])
    trainer.train()
    (run_dir,) = (tmp_path / "runs").iterdir()
    run = read_run(run_dir)
    assert sorted(run.scalars["param_grad/global_norm"]) == [4, 8, 12, 16]
    # The first logged step writes every default histogram, weights included.
    assert {"activation/net.0", "param_grad/net.0.weight", "param/net.0.weight"} <= set(run.histograms)
    assert set(run.histograms["activation/net.0"]) == {4} and set(run.histograms["param/net.0.weight"]) == {4}


# -- several ranks, the inner module of DDP passed ---------------------------------------------------------
def _inner_module_without_optimizer(rank: int, root: str) -> None:
    ddp = nn.parallel.DistributedDataParallel(mlp(6, 16, 16, 3, act=nn.ReLU))
    with pytest.raises(HookLoggerError, match=r"optimizer= is required for a model trained over 2 ranks.*optimizer="):
        HookLogger(ddp.module, log_dir=f"{root}/never{rank}")  # nanoGPT's raw_model
    with HookLogger(ddp.module, every=1, parameters=False, log_dir=f"{root}/run{rank}") as hooks:
        ddp(torch.randn(4, 6)).square().mean().backward()
        hooks.step()


def test_the_inner_module_of_ddp_without_optimizer_is_refused(tmp_path) -> None:
    spawn_ranks(_inner_module_without_optimizer, tmp_path, 2)
    assert not (tmp_path / "never0").exists()
    assert "activation/mean/0" in read_run(tmp_path / "run0").scalars
