"""A statistic is declared once (``stats/kinds.py``) and added to one logger's recipe
(``measures=``): a test declares two here, each in one place, and sees it logged, pooled over two
calls of a module and over two ranks, and, when it does not scale with the loss, left alone by the
``GradScaler``'s unscaling; another logger in the same process does not record it."""

from __future__ import annotations

import dataclasses
import datetime
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import read_run, spawn_ranks
from torch import nn

from tblog_hooks import HookLogger, HookLoggerError
from tblog_hooks.kernels import outputs
from tblog_hooks.stats.kinds import MAX, MOMENTS, NORM, SUM, Field, Kind, Measure

#: max|g| / ||g|| of an output gradient: does not scale with the loss.
PEAK_RATIO = Measure(
    name="peak ratio",
    fields=(Field(name="absmax", pool=MAX), Field(name="l2", pool=NORM)),
    stats=("peak_ratio",),
    scalars=lambda v, n: {"peak_ratio": float(v["absmax"][0] / v["l2"][0])},
    compute=lambda g, units, given: {"absmax": g.abs().amax().float(), "l2": torch.linalg.vector_norm(g.float())},
)


def _central(x: torch.Tensor, units: int, given: object) -> dict[str, torch.Tensor]:
    x = x.double()
    mean = x.mean()
    c = x - mean
    return {"k_mean": mean, "k_norm": torch.linalg.vector_norm(c), "k_m3": c.pow(3).sum(), "k_m4": c.pow(4).sum()}


def _kurtosis(v: dict, n: int) -> dict[str, float]:  # type: ignore[type-arg]
    _, norm, _, m4 = v["central"]
    return {"kurtosis": float(n * m4 / norm**4 - 3)}


#: Excess kurtosis of an activation or output gradient, from central moments up to the fourth
#: pooled pairwise (over the records' element counts: an output gradient's carried on the device).
KURTOSIS = Measure(
    name="kurtosis",
    fields=(Field(name="central", pool=MOMENTS, parts=("k_mean", "k_norm", "k_m3", "k_m4")),),
    stats=("kurtosis",),
    scalars=_kurtosis,
    compute=_central,
    needs_numel=True,
)


def _reference_kurtosis(x: torch.Tensor) -> float:
    x = x.double().reshape(-1)
    c = x - x.mean()
    return float(c.pow(4).mean() / c.pow(2).mean() ** 2 - 3)


#: Both statistics, added to a logger's recipe.
MEASURES = {"output_gradient": [PEAK_RATIO, KURTOSIS], "output": [KURTOSIS]}


class Twice(nn.Module):
    """One module called twice in a forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


def test_a_declared_statistic_is_logged_pooled_over_calls_and_left_alone_by_unscale(tmp_path: Path) -> None:
    model = Twice()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(16, 6)
    outputs, grads = [], []

    def keep(module: nn.Module, args: object, out: torch.Tensor) -> None:
        outputs.append(out.detach().clone())
        out.register_hook(lambda g: grads.append(g.detach().clone() / 2.0**10))  # as unscaled

    handle = model.shared.register_forward_hook(keep)
    with HookLogger(
        model, log_dir=tmp_path, every=1, modules=["shared"], optimizer=opt, scaler=scaler, measures=MEASURES
    ) as hooks:
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        hooks.step()
    handle.remove()
    run = read_run(tmp_path)
    both = torch.cat([g.reshape(-1) for g in grads])
    assert run.scalar("gradient/peak_ratio/shared", 0) == pytest.approx(
        float(both.abs().max() / both.norm()), rel=1e-5
    )  # the ratio of scaled gradients is that of the true ones: not divided by the scale
    assert run.scalar("gradient/norm/shared", 0) == pytest.approx(float(both.norm()), rel=1e-5)  # divided
    assert run.scalar("activation/kurtosis/shared", 0) == pytest.approx(
        _reference_kurtosis(torch.cat(outputs)), rel=1e-6
    )
    assert run.scalar("gradient/kurtosis/shared", 0) == pytest.approx(_reference_kurtosis(both), rel=1e-6)


def test_a_second_logger_in_the_process_is_untouched(tmp_path: Path) -> None:
    """Two loggers alive at once, one with the measures: only its run has their tags, and the
    other's tags are those of a logger made alone."""
    x = torch.randn(16, 6)

    def run(log_dir: Path, **options: object) -> HookLogger:
        torch.manual_seed(0)
        model = Twice()
        hooks = HookLogger(model, log_dir=log_dir, every=1, modules=["shared"], **options)
        model(x).square().mean().backward()
        return hooks

    alone = run(tmp_path / "alone")
    alone.step()
    alone.close()
    extended, plain = run(tmp_path / "extended", measures=MEASURES), run(tmp_path / "plain")
    for hooks in (extended, plain):
        hooks.step()
        hooks.close()
    assert {"activation/kurtosis/shared", "gradient/peak_ratio/shared"} <= set(read_run(tmp_path / "extended").scalars)
    assert read_run(tmp_path / "plain").scalars == read_run(tmp_path / "alone").scalars


def test_a_measure_a_source_cannot_take_is_refused_at_construction() -> None:
    model = Twice()
    with pytest.raises(HookLoggerError, match="element count"):  # (the recipe puts ELEMENTS before it)
        Kind(name="gradient", host_knows_numel=False, measures=(KURTOSIS,))
    twice = Measure(name="my min", fields=(Field(name="min", pool=MAX),), scalars=lambda v, n: {}, compute=_central)
    with pytest.raises(HookLoggerError, match=r"my min.*extremes|extremes.*my min"):
        HookLogger(model, measures={"output": [twice]})
    with pytest.raises(HookLoggerError, match=r"kurtosis.*kurtosis"):
        HookLogger(model, measures={"output": [KURTOSIS, KURTOSIS]})
    for source in ("param_grad", "update"):  # (records built by the logger, not by a measure)
        with pytest.raises(HookLoggerError, match=f"cannot be added to '{source}'.*output, input, output_gradient"):
            HookLogger(model, measures={source: [PEAK_RATIO]})
    with pytest.raises(HookLoggerError, match="inputs=True"):
        HookLogger(model, measures={"input": [KURTOSIS]})
    with pytest.raises(HookLoggerError, match=r"'activations'.*none"):
        HookLogger(model, measures={"activations": [KURTOSIS]})


def test_a_fused_measure_of_a_value_the_kernels_do_not_give_is_refused_where_declared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fused=True`` says the Triton kernels give a measure's values on their path (CUDA): one of
    a value they do not give (an outlier fraction) would switch every module's logging off there
    alone. It is refused where it is declared, naming it and what the kernels give, without
    Triton (as on a machine without a GPU, which never runs them)."""
    monkeypatch.setitem(sys.modules, "triton", None)  # (an import of Triton fails)
    monkeypatch.delitem(sys.modules, "tblog_hooks.kernels.fused", raising=False)
    given = ", ".join(outputs.OUTPUTS)
    with pytest.raises(HookLoggerError) as refused:
        Measure(
            name="outlier fraction",
            fields=(Field(name="outliers", pool=SUM),),
            stats=("outlier_frac",),
            scalars=lambda v, n: {"outlier_frac": float(v["outliers"][0]) / n},
            compute=lambda x, units, given: {"outliers": (x.abs() > 6 * x.std()).sum()},
            needs_numel=True,
            fused=True,
        )
    said = str(refused.value)
    assert said.startswith("outlier fraction is declared fused=True, but the fused kernels do not give ['outliers']")
    assert f"they give {given} (tblog_hooks/kernels/outputs.py)" in said
    assert {"mean", "min", "max", "norm", "format_counts", "peak"} <= set(outputs.OUTPUTS)


def _span(x: torch.Tensor, units: int, given: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"span": given["max"] - given["min"]}  # (the extremes the output's statistics took)


#: The range of an output, from the extremes its statistics compute: ``uses`` shares them.
SPAN = Measure(
    name="span",
    fields=(Field(name="span", pool=MAX),),
    stats=("span",),
    scalars=lambda v, n: {"span": float(v["span"][0])},
    compute=_span,
    uses=("min", "max"),
)


def test_a_measure_uses_what_the_measures_before_it_computed(tmp_path: Path) -> None:
    """A measure's ``uses`` hands it the device values of the measures before it (computed once),
    and a name none of them gives is refused at construction, naming it and those given."""
    model = nn.Sequential(nn.Linear(6, 3))
    x = torch.randn(16, 6)
    with HookLogger(model, log_dir=tmp_path, every=1, measures={"output": [SPAN]}) as hooks:
        model(x).sum().backward()
        hooks.step()
    out = model(x).detach()
    assert read_run(tmp_path).scalar("activation/span/0", 0) == pytest.approx(float(out.max() - out.min()), rel=1e-6)
    unknown = Measure(
        name="lost", fields=(Field(name="l", pool=MAX),), scalars=lambda v, n: {}, compute=_span, uses=("amax",)
    )
    with pytest.raises(HookLoggerError, match=r"lost uses \['amax'\].*'max', 'mean', 'min'"):
        HookLogger(model, measures={"output": [unknown]})


def _tiny_frac(x: torch.Tensor, units: int, given: object) -> dict[str, torch.Tensor]:
    return {"tiny": (x.abs() < 0.1).sum()}


#: A statistic of one's own whose name reads like a per-format one (``underflow_fp16``): its own
#: meaning (the share of elements below 0.1 in magnitude), not fp16's.
NAMED_LIKE_A_FORMAT = Measure(
    name="below 0.1",
    fields=(Field(name="tiny", pool=SUM),),
    stats=("underflow_fp16",),
    scalars=lambda v, n: {"underflow_fp16": float(v["tiny"][0]) / n},
    compute=_tiny_frac,
    needs_numel=True,
)


@pytest.mark.parametrize("numerics", [True, ("e4m3",)])
def test_a_declared_statistic_named_like_a_format_is_written_as_declared(tmp_path: Path, numerics: object) -> None:
    """Which format a statistic belongs to is the recipe's to say, not its name's: a measure of
    one's own on the inputs named ``underflow_fp16`` is written, with its value, under a
    ``numerics=`` that leaves fp16 out (bf16, the run's own; e4m3), which drops the built-in fp16 scalars."""
    model = nn.Sequential(nn.Linear(6, 3))
    x = torch.randn(64, 6)
    with HookLogger(
        model, log_dir=tmp_path, every=1, inputs=True, numerics=numerics, measures={"input": [NAMED_LIKE_A_FORMAT]}
    ) as hooks:
        model(x).sum().backward()
        hooks.step()
    run = read_run(tmp_path)
    assert run.scalar("input/underflow_fp16/0", 0) == pytest.approx(float((x.abs() < 0.1).double().mean()), rel=1e-6)
    assert "activation/underflow_fp16/0" not in run.scalars  # (the built-in one: fp16 is not written)


def test_the_old_spellings_of_a_measure_keep_working_with_a_deprecation_warning(tmp_path: Path) -> None:
    """``counted=`` is the old name of ``needs_numel=``, and a ``compute(t, units)`` the old calling
    convention: each still declares the same measure, with a ``DeprecationWarning`` naming the new
    spelling; the logged values are those of the new spellings."""
    fields, stats = (Field(name="l2", pool=NORM),), ("root_mean_square",)

    def scalars(v: dict, n: int) -> dict[str, float]:  # type: ignore[type-arg]
        return {"root_mean_square": float(v["l2"][0]) / n**0.5}

    with pytest.warns(DeprecationWarning) as caught:
        old = Measure(
            name="rms",
            fields=fields,
            stats=stats,
            scalars=scalars,
            compute=lambda x, units: {"l2": torch.linalg.vector_norm(x.double())},
            counted=True,
        )
    said = [str(w.message) for w in caught]
    assert any("Measure(counted=...) is deprecated" in m and "use needs_numel=" in m for m in said), said
    assert any("compute taking (t, units) is deprecated" in m and "(t, units, given)" in m for m in said), said
    new = Measure(
        name="rms",
        fields=fields,
        stats=stats,
        scalars=scalars,
        compute=lambda x, units, given: {"l2": torch.linalg.vector_norm(x.double())},
        needs_numel=True,
    )
    assert old.needs_numel and new.needs_numel
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dataclasses.replace(old, name="root mean square")  # (its compute called the new way: no warning)
    with pytest.warns(DeprecationWarning, match=r"Measure\.counted is deprecated.*Measure\.needs_numel"):
        assert old.counted is True  # type: ignore[attr-defined]
    with pytest.raises(HookLoggerError, match="both counted= and needs_numel="):
        Measure(name="rms", fields=fields, scalars=scalars, counted=True, needs_numel=True)  # type: ignore[call-arg]
    x = torch.randn(16, 6)
    for measure, run in ((old, "old"), (new, "new")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 3))
        with HookLogger(model, log_dir=tmp_path / run, every=1, measures={"output": [measure]}) as hooks:
            model(x).sum().backward()
            hooks.step()
    out = model(x).detach().double()
    expected = float(out.square().mean().sqrt())
    for run in ("old", "new"):
        assert read_run(tmp_path / run).scalar("activation/root_mean_square/0", 0) == pytest.approx(expected, rel=1e-6)


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(rank)) * (1 + rank)


def _worker(rank: int, root: str) -> None:
    torch.manual_seed(0)
    model = Twice()
    with HookLogger(
        model,
        log_dir=f"{root}/run",
        every=1,
        modules=["shared"],
        reduce_ranks=True,
        parameters=False,
        measures={"output": [KURTOSIS]},
    ) as hooks:
        model(_batch(rank)).sum().backward()
        hooks.step()


def test_a_declared_statistic_is_pooled_over_ranks(tmp_path: Path) -> None:
    spawn_ranks(_worker, tmp_path, 2, datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = Twice()
    outputs: list[torch.Tensor] = []
    model.shared.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    with torch.no_grad():
        for rank in range(2):
            model(_batch(rank))
    expected = _reference_kurtosis(torch.cat(outputs))
    assert read_run(tmp_path / "run").scalar("activation/kurtosis/shared", 0) == pytest.approx(expected, rel=1e-6)
