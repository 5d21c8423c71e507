"""``numerics=``: every fraction equals casting the tensor with ``x.to(dtype)`` and counting, the
magnitudes equal plain torch, a logged step adds a bounded number of ops per watched tensor and
an unlogged one none, and the findings start on the pathologies they name."""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import OpCounter, needs_cuda, read_images, read_run, read_tensors
from models import train
from torch import Tensor, nn

from tblog_hooks import HookLogger, HookLoggerError
from tblog_hooks.diagnostics.numerics_rules import FORMATS as PICTURE_FORMATS
from tblog_hooks.diagnostics.numerics_rules import PICTURE_TAGS
from tblog_hooks.stats.formats import NAMES, SPECS
from tblog_hooks.stats.kinds import Kind
from tblog_hooks.stats.numerics import AMAX_FLOOR, FORMATS
from tblog_hooks.stats.recipe import Recipe, Source
from tblog_hooks.stats.tags import NUMERICS_TABLE_TAG, Lost, rows_tag

ALL = tuple(FORMATS)


# -- the reference: cast and count -----------------------------------------------------------------
def reference(x: Tensor, fmt: str) -> dict[str, float]:
    """Each fraction as the issue defines it, from ``x.to(dtype)``: fp16 and bf16 cast as they
    are, e4m3 and e5m2 after scaling by ``max_F / max(amax, 1e-12)`` (torchao's recipe)."""
    f = FORMATS[fmt]
    info, n = torch.finfo(f.dtype), x.numel()
    if f.scaled:
        amax = x.abs().amax().float().clamp(min=AMAX_FLOOR)
        cast = (x.float() * (info.max / amax)).to(f.dtype).float()
        overflow = ~torch.isfinite(cast)
    else:
        cast = x.to(f.dtype).float()
        overflow = (x.float().abs() > info.max) | ~torch.isfinite(cast)
    out = {
        f"underflow_{fmt}": int(((x != 0) & (cast == 0)).sum()) / n,
        f"overflow_{fmt}": int(overflow.sum()) / n,
    }
    if not f.scaled:
        out[f"subnormal_{fmt}"] = int(((cast != 0) & (cast.abs() < info.smallest_normal)).sum()) / n
    return out


def magnitudes(x: Tensor) -> dict[str, float]:
    """amax, RMS and the non-centred excess kurtosis in float64."""
    d = x.double()
    m2, m4 = d.square().mean().item(), d.pow(4).mean().item()  # (float64: no overflow below 1e77)
    return {"amax": d.abs().max().item(), "rms": math.sqrt(m2), "kurtosis": m4 / m2**2 - 3}


#: The numerics kinds, by the source they measure.
NUMERIC = Recipe.build(numerics=True).numerics


def measured(kind: Kind, x: Tensor, units: int = -1) -> dict[str, float]:
    """The scalars the logger derives from ``kind``'s device values of ``x`` (one record)."""
    named = kind.compute(x, units)
    values = {name: np.atleast_1d(t.double().cpu().numpy()) for name, t in named.items()}
    fields = {f.name: np.concatenate([values[part] for part in f.names]) for f in kind.fields}
    return kind.scalars(fields, x.numel())


def _near_boundaries() -> Tensor:
    """Magnitudes a few float32 ulps around every rounding boundary of every unscaled format
    (flush to zero, subnormal to normal, max, overflow), both signs."""
    points = []
    for f in FORMATS.values():
        bound, _ = f.finite
        for edge in (f.flushed, f.normal, f.tiny, f.max, bound):
            edge32 = torch.tensor(edge, dtype=torch.float32)
            below = above = edge32
            points.append(edge32)
            for _ in range(3):
                below, above = torch.nextafter(below, torch.tensor(0.0)), torch.nextafter(above, torch.tensor(math.inf))
                points += [below, above]
    magnitudes = torch.stack(points)
    return torch.cat([magnitudes, -magnitudes])


def _tensors() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    spread = 10 ** (torch.rand(20_000, generator=g) * 80 - 45)  # 1e-45 .. 1e35
    signs = torch.where(torch.rand(20_000, generator=g) < 0.5, -1.0, 1.0)
    special = torch.tensor([0.0] * 50 + [math.inf, -math.inf, math.nan])
    wide = torch.cat([spread * signs, _near_boundaries(), special])
    gradients = torch.randn(4096, generator=g) * 10 ** (torch.rand(4096, generator=g) * 14 - 12)
    outlier = torch.randn(64, 32, generator=g)
    outlier[:, 7] += 3e5  # one massive channel: the rest underflows in e4m3 scaled to it
    return {
        "wide": wide,
        "finite": wide[torch.isfinite(wide) & (wide.abs() < 1e30)],
        "gradients": gradients,
        "outlier": outlier,
        "fp16": gradients.half(),
        "bf16": gradients.bfloat16(),
        "zeros": torch.zeros(10),
    }


@pytest.mark.parametrize("name", list(_tensors()))
def test_every_fraction_equals_cast_and_count(name: str) -> None:
    x = _tensors()[name]
    got = measured(NUMERIC[Source.OUTPUT_GRADIENT], x)
    for fmt in ALL:
        if FORMATS[fmt].scaled and not torch.isfinite(x).all():
            continue  # (amax is inf: every finite element is scaled to 0, as in the reference)
        for stat, want in reference(x, fmt).items():
            assert got[stat] == pytest.approx(want, abs=1e-6), (stat, got[stat], want)
    assert got["zero_frac"] == pytest.approx(float((x == 0).sum()) / x.numel(), abs=1e-6)
    if torch.isfinite(x).all() and x.any():
        want = magnitudes(x)
        for stat in ("amax", "rms", "kurtosis"):
            assert got[stat] == pytest.approx(want[stat], rel=1e-5, abs=1e-6), stat


@needs_cuda
@pytest.mark.parametrize("name", list(_tensors()))
def test_every_fraction_equals_cast_and_count_on_cuda(name: str) -> None:
    """The same on the GPU, whose kernels must keep the float32 subnormals the bf16 boundaries are."""
    x = _tensors()[name].cuda()
    got = measured(NUMERIC[Source.OUTPUT_GRADIENT], x)
    for fmt in ALL:
        if not (FORMATS[fmt].scaled and not torch.isfinite(x).all()):
            for stat, want in reference(x, fmt).items():
                assert got[stat] == pytest.approx(want, abs=1e-6), (stat, got[stat], want)


def test_the_boundaries_are_exercised() -> None:
    """The boundary tensor has elements on both sides of every fp16 and bf16 boundary (so a
    comparison off by one ulp would fail the reference test)."""
    x = _near_boundaries()
    for fmt in ("fp16", "bf16"):
        ref = reference(x, fmt)
        assert ref[f"underflow_{fmt}"] > 0 and ref[f"subnormal_{fmt}"] > 0 and 0 < ref[f"overflow_{fmt}"] < 1


def test_torchtitan_test_vector() -> None:
    got = measured(NUMERIC[Source.OUTPUT_GRADIENT], torch.tensor([0.0, 1.0, -2.0, 3.0]))
    assert got["rms"] == pytest.approx(math.sqrt(3.5), rel=1e-7)
    assert got["kurtosis"] == pytest.approx(-1.0, abs=1e-7)
    assert got["amax"] == 3.0


def test_scaled_formats_scale_each_tensor_to_its_own_amax() -> None:
    """e4m3 of an outlier channel: the rest is flushed; scaling is what keeps a small tensor whole."""
    x = _tensors()["outlier"]
    got = measured(NUMERIC[Source.OUTPUT], x)
    assert got["underflow_e4m3"] > 0.1 and got["overflow_e4m3"] == 0
    assert got["amax_channel"] == 7 and got["median_abs"] == pytest.approx(x.abs().median().item())
    small = measured(NUMERIC[Source.OUTPUT], x[:, :7] * 1e-9)
    assert small["underflow_e4m3"] == 0 and small["underflow_fp16"] > 0.5  # unscaled fp16 flushes it


# -- through a run, read back ------------------------------------------------------------------------
def _captured(model: nn.Module, names: list[str]) -> tuple[dict[str, Tensor], Callable[[], None]]:
    """Hooks that keep each module's output and output gradient; returns them and a remover."""
    kept: dict[str, Tensor] = {}
    handles = []

    def keep(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: object, out: Tensor) -> None:
            kept[f"activation/{name}"] = out.detach().clone()
            out.register_hook(lambda g: kept.__setitem__(f"gradient/{name}", g.detach().clone()))

        return hook

    modules = dict(model.named_modules())
    for name in names:
        handles.append(modules[name].register_forward_hook(keep(name)))
    return kept, lambda: [h.remove() for h in handles]


def test_a_run_writes_the_reference_values(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=ALL, histograms=False) as hooks:
        kept, remove = _captured(model, list(hooks.module_names))
        x = torch.randn(32, 16) * 1e5  # the first layer's output overflows fp16
        loss = model(x).mean() * 1e-4  # its gradients underflow fp16
        train(hooks, [loss])  # (no optimizer: the gradients stay to compare)
        grads = {f"param_grad/{n}": p.grad.clone() for n, p in model.named_parameters()}
        remove()
    scalars = {t: v[0] for t, v in read_run(tmp_path).scalars.items()}
    checked = 0
    for key, t in {**kept, **grads}.items():
        root, name = key.split("/")
        for fmt in ALL:
            for stat, want in reference(t, fmt).items():
                assert scalars[f"{root}/{stat}/{name}"] == pytest.approx(want, abs=1e-6), (key, stat)
                checked += want > 0
        for stat, want in magnitudes(t).items():
            assert scalars[f"{root}/{stat}/{name}"] == pytest.approx(want, rel=1e-5, abs=1e-6), (key, stat)
    assert checked >= 8  # nonzero fractions among them: overflow and underflow happened
    assert scalars["activation/overflow_fp16/0"] > 0 and scalars["gradient/underflow_fp16/0"] > 0


def test_the_value_table_holds_every_format_of_every_module(tmp_path) -> None:
    """``health/numerics`` (what the dashboard draws) is the reference of every format, those not
    written as tags included, in forward order; the written format's cells are its scalars."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=("bf16",), histograms=False) as hooks:
        kept, remove = _captured(model, list(hooks.module_names))
        train(hooks, [model(torch.randn(32, 16) * 1e5).mean() * 1e-4])  # fp16 overflow and underflow
        remove()
    (table,) = read_tensors(tmp_path, NUMERICS_TABLE_TAG).values()
    (names,) = read_tensors(tmp_path, rows_tag(NUMERICS_TABLE_TAG)).values()
    assert [n.decode() for n in names] == ["0", "2"] and table.shape == (2, 2, len(ALL), len(Lost))
    assert table.dtype == np.float32
    scalars = {t: v[0] for t, v in read_run(tmp_path).scalars.items()}
    for r, root in enumerate(("activation", "gradient")):
        for m, name in enumerate(("0", "2")):
            for f, fmt in enumerate(ALL):
                want = reference(kept[f"{root}/{name}"], fmt)
                for q, lost in enumerate(Lost):
                    cell = float(table[r, m, f, q])
                    if f"{lost}_{fmt}" not in want:  # fp8 has no subnormals (scaled)
                        assert math.isnan(cell)
                        continue
                    assert cell == pytest.approx(want[f"{lost}_{fmt}"], abs=1e-6), (root, name, fmt, lost)
                    assert scalars.get(f"{root}/{lost}_{fmt}/{name}", cell) == cell  # bf16's: the scalar
    assert table[0, 0, ALL.index("fp16"), 1] > 0 and table[1, 0, ALL.index("fp16"), 0] > 0  # not all zeros


def test_only_the_named_formats_are_tags_and_every_format_is_pictured(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=True, histograms=False) as hooks:
        train(hooks, [model(torch.randn(8, 4)).sum()])
    tags = set(read_run(tmp_path).scalars)
    assert "activation/underflow_bf16/0" in tags and "param_grad/overflow_bf16/2.weight" in tags
    assert not {t for t in tags if t.split("/")[1].endswith(("_fp16", "_e4m3", "_e5m2"))}
    for tag in PICTURE_TAGS.values():
        assert read_images(tmp_path, tag)[0].shape[2] == 3


def test_numerics_true_writes_the_autocast_format(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=True, histograms=False) as hooks:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 4)).float().sum()
        train(hooks, [loss])
    tags = set(read_run(tmp_path).scalars)
    assert "gradient/underflow_fp16/0" in tags and "gradient/underflow_bf16/0" not in tags


def test_amax_and_rms_of_gradients_are_unscaled_and_fractions_judged_at_the_scale(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=("fp16",), scaler=scaler, histograms=False) as hooks:
        kept, remove = _captured(model, ["0"])
        loss = model(torch.randn(4, 8)).sum() * 1e-9
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        hooks.step()
        remove()
    scalars = {t: v[0] for t, v in read_run(tmp_path).scalars.items()}
    scaled = kept["gradient/0"]  # as backward made it: scaled by 2^20
    assert scalars["gradient/amax/0"] == pytest.approx(scaled.abs().max().item() / 2.0**20, rel=1e-6)
    assert scalars["gradient/underflow_fp16/0"] == pytest.approx(reference(scaled, "fp16")["underflow_fp16"])


# -- options and cost -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("fp16", "a tuple: numerics=('fp16',)"),
        (("fp32",), "unknown format(s) ['fp32']"),
        (("fp16", "fp16"), "a format named twice"),
        ((), "a non-empty tuple"),
        (None, "got None"),
        (1, "got 1"),
    ],
)
def test_bad_numerics_is_refused_at_construction(tmp_path, value: object, said: str) -> None:
    with pytest.raises(HookLoggerError, match=r"numerics") as raised:
        HookLogger(nn.Linear(2, 2), log_dir=tmp_path, numerics=value)
    assert said in str(raised.value) and "'fp16', 'bf16', 'e4m3', 'e5m2'" in str(raised.value)


#: Aten ops a logged step may add per watched tensor (output, output gradient, parameter
#: gradient) with every format: a base for the magnitudes, and per format.
BASE_OPS, OPS_PER_FORMAT = 12, 7


def test_ops_are_bounded_per_tensor_and_format_and_none_when_not_logged(tmp_path) -> None:
    model = nn.Sequential(OrderedDict((f"l{i}", nn.Linear(32, 32)) for i in range(6)))
    x = torch.randn(8, 32)

    def ops(hooks: HookLogger | None) -> int:
        with OpCounter() as counter:
            train(hooks, [model(x).square().mean()])
        return sum(counter.ops.values())

    baseline = ops(None)
    counts = {}
    for numerics in (False, ALL):
        with HookLogger(model, log_dir=tmp_path / str(bool(numerics)), every=2, numerics=numerics) as hooks:
            counts[numerics] = (ops(hooks), ops(hooks), ops(hooks))  # logged, not logged, logged
        assert counts[numerics][1] == baseline
    tensors = 6 * (1 + 1 + 2)  # per Linear: its output, its output gradient, its weight's and bias's gradients
    for logged in (0, 2):
        added = counts[ALL][logged] - counts[False][logged]
        assert 0 < added <= tensors * (BASE_OPS + OPS_PER_FORMAT * len(ALL)), added / tensors


# -- findings -----------------------------------------------------------------------------------------
def _shrinking_sigmoid_mlp(depth: int = 6, width: int = 32) -> nn.Sequential:
    """Linear-Sigmoid layers whose output gradients shrink tenfold per layer towards the input:
    orthogonal weights of gain 0.4 times sigmoid's slope 1/4 at 0."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        linear = nn.Linear(width, width)
        nn.init.orthogonal_(linear.weight, gain=0.4)
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.Sigmoid()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def _fp16_run(tmp_path, scaler: torch.amp.GradScaler | None) -> tuple[list, dict[str, dict[int, float]]]:
    model = _shrinking_sigmoid_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=True, scaler=scaler, histograms=False) as hooks:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(64, 32)).float().mean() * 1e-3
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            hooks.step()
    return hooks.findings, read_run(tmp_path).scalars


def test_fp16_gradient_underflow_names_the_first_layers_and_a_large_loss_scale_ends_it(tmp_path) -> None:
    findings, scalars = _fp16_run(tmp_path / "plain", None)
    underflow = [f for f in findings if f.kind == "fp16_gradient_underflow"]
    named = {f.module for f in underflow}
    assert {"0", "2"} <= named and "12" not in named, named  # the input side, not the head
    norms = [scalars[f"gradient/rms/{m}"][0] for m in ("10", "8", "6")]
    assert norms[0] > 5 * norms[1] > 25 * norms[2]  # (the gradients do shrink about tenfold per layer)
    message = underflow[0].message
    assert "loss scale up to 2^" in message and "or train in bf16" in message
    largest = max(v[0] for t, v in scalars.items() if t.startswith("gradient/amax/"))
    assert f"2^{math.floor(math.log2(65504 / largest))} " in message
    scaled, _ = _fp16_run(tmp_path / "scaled", torch.amp.GradScaler("cpu", init_scale=2.0**24))
    assert [f for f in scaled if f.kind == "fp16_gradient_underflow"] == []


def _outlier_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(proj=nn.Linear(8, 16), act=nn.Tanh(), head=nn.Linear(16, 2)))
    with torch.no_grad():
        model.proj.weight.mul_(1e-4)
        model.proj.bias.zero_()
        model.proj.bias[5] = 500.0
    return model


def test_massive_activation_names_the_module_and_channel_and_fp8_underflow_follows(tmp_path) -> None:
    model = _outlier_model()
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=("e4m3", "e5m2"), histograms=False) as hooks:
        train(hooks, [model(torch.randn(32, 8)).sum()])
    by_kind = {(f.kind, f.module): f for f in hooks.findings}
    massive = by_kind[("massive_activation", "proj")]
    assert "channel 5" in massive.message and massive.value == pytest.approx(500.0, rel=1e-4)
    assert ("fp8_underflow", "proj") in by_kind
    assert {m for k, m in by_kind if k == "massive_activation"} == {"proj"}


def test_fp8_overflow_starts_where_a_cast_makes_nan(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=("e4m3",), histograms=False) as hooks:
        x = torch.randn(8, 4)
        x[0, 0] = math.inf
        train(hooks, [model(x).sum()])
    assert ("fp8_overflow", "0") in {(f.kind, f.module) for f in hooks.findings}


def test_the_pictures_get_every_format_and_the_tags_only_those_written(tmp_path, monkeypatch) -> None:
    from tblog_hooks.diagnostics import per_step

    drawn: list[dict[str, float]] = []
    draw = per_step.numerics_pictures
    monkeypatch.setattr(per_step, "numerics_pictures", lambda order, every: drawn.append(every) or draw(order, every))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=("bf16",), histograms=False) as hooks:
        train(hooks, [(model(torch.randn(8, 4) * 1e5)).sum() for _ in range(12)])
    assert len(drawn) == 3  # logged steps 0 and 10, and the last one at close
    assert {f"gradient/underflow_{fmt}/2" for fmt in ALL} <= set(drawn[0])
    assert drawn[0]["activation/overflow_bf16/0"] == 0 < drawn[0]["activation/overflow_fp16/0"]  # pictured, not written
    tags = set(read_run(tmp_path).scalars)
    assert "activation/overflow_bf16/0" in tags and "activation/overflow_fp16/0" not in tags


def test_massive_activation_is_not_judged_on_a_mostly_zero_output(tmp_path) -> None:
    model = nn.Sequential(OrderedDict(proj=nn.Linear(8, 16), act=nn.ReLU()))
    with torch.no_grad():
        model.proj.weight.zero_()
        model.proj.bias.fill_(-1.0)
        model.proj.bias[5] = 500.0  # one unit at 500, the rest 0 after the ReLU: its median is 0
    with HookLogger(model, log_dir=tmp_path, every=1, modules=["proj", "act"], numerics=True) as hooks:
        train(hooks, [model(torch.randn(32, 8)).sum()])
    assert {f.module for f in hooks.findings if f.kind == "massive_activation"} == set()


def test_the_docs_constants_are_torch_finfo() -> None:
    """docs/numerics.md's table of the formats: each row's dtype, max, smallest normal and
    subnormal (as powers of two) are ``torch.finfo``'s."""
    from pathlib import Path

    superscript = str.maketrans("⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "-0123456789")
    text = (Path(__file__).parents[1] / "docs" / "numerics.md").read_text()
    rows = re.findall(r"^\| (\w+) \| `torch\.(\w+)` \| ([\d.e]+) \| [^|]*\(2(\S+)\) \| [^|]*\(2(\S+)\) \|", text, re.M)
    assert [r[0] for r in rows] == list(FORMATS)
    for name, dtype, largest, normal, subnormal in rows:
        info = torch.finfo(getattr(torch, dtype))
        assert FORMATS[name].dtype == getattr(torch, dtype)
        assert float(largest) == pytest.approx(info.max, rel=1e-2)
        assert 2.0 ** int(normal.translate(superscript)) == info.smallest_normal
        assert 2.0 ** int(subnormal.translate(superscript)) == info.smallest_normal * info.eps


def test_fp16_gradient_underflow_of_a_float32_run_that_names_fp16(tmp_path) -> None:
    """In float32 the gradients are whole, and their fp16 underflow fraction is what a cast would lose."""
    model = _shrinking_sigmoid_mlp()
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=("fp16",), histograms=False) as hooks:
        train(hooks, [model(torch.randn(64, 32)).mean() * 1e-3])
    scalars = {t: v[0] for t, v in read_run(tmp_path).scalars.items()}
    named = {f.module: f.value for f in hooks.findings if f.kind == "fp16_gradient_underflow"}
    assert {"0", "2"} <= set(named) and "12" not in named, named
    assert named["2"] == pytest.approx(scalars["gradient/underflow_fp16/2"], abs=1e-6)  # the cast's loss itself
    assert scalars["gradient/zero_frac/2"] == 0  # (nothing is zero in float32)


def test_the_formats_constants_are_torchs() -> None:
    """``stats/formats.py`` types each format's constants once, without torch: they are ``torch.finfo``'s."""
    for spec in SPECS.values():
        info = torch.finfo(getattr(torch, spec.dtype))
        assert (spec.max, spec.tiny) == (float(info.max), float(info.smallest_normal)), spec.name
        assert spec.mantissa_bits == round(-math.log2(info.eps)), spec.name
    assert tuple(FORMATS) == NAMES and PICTURE_FORMATS == NAMES
