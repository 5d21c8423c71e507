"""``numerics=``: every fraction equals casting the tensor with ``x.to(dtype)`` and counting, the
magnitudes equal plain torch, a logged step adds a bounded number of ops per watched tensor and
an unlogged one none, and the findings start on the pathologies they name."""

from __future__ import annotations

import math
import re
from collections import Counter, OrderedDict
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
from tblog_hooks.stats import numerics as numerics_module
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
        overflow = ~torch.isfinite(cast)
    out = {
        f"underflow_{fmt}": int(((x != 0) & (cast == 0)).sum()) / n,
        f"overflow_{fmt}": int(overflow.sum()) / n,
    }
    if not f.scaled:
        out[f"subnormal_{fmt}"] = int(((cast != 0) & (cast.abs() < info.smallest_normal)).sum()) / n
        out[f"floor_{fmt}"] = int((cast.abs() == info.smallest_normal * info.eps).sum()) / n
    return out


def magnitudes(x: Tensor) -> dict[str, float]:
    """amax, RMS and the non-centred excess kurtosis in float64."""
    d = x.double()
    m2, m4 = d.square().mean().item(), d.pow(4).mean().item()  # (float64: no overflow below 1e77)
    return {"amax": d.abs().max().item(), "rms": math.sqrt(m2), "kurtosis": m4 / m2**2 - 3}


#: The kinds of numerics, by the source they measure (an output's and an output gradient's numerics
#: are measures of their own kinds).
_RECIPE = Recipe.build(numerics=True)
NUMERIC = {**_RECIPE.numerics, **{s: _RECIPE[s] for s in (Source.OUTPUT, Source.OUTPUT_GRADIENT)}}


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


@pytest.mark.parametrize("together", [True, False], ids=["side by side", "one by one"])
def test_the_counts_side_by_side_or_one_by_one_are_the_casts(monkeypatch: pytest.MonkeyPatch, together: bool) -> None:
    """A small tensor's comparisons written side by side and summed by one op, or a large one's each
    summed as written (``numerics.Below``): both count every boundary as the cast does."""
    monkeypatch.setattr(numerics_module, "_SIDE_BY_SIDE", 1 << 40 if together else 0)
    for x in (_tensors()["wide"], _tensors()["finite"]):
        got = measured(NUMERIC[Source.OUTPUT_GRADIENT], x)
        for fmt in ALL:
            if not (FORMATS[fmt].scaled and not torch.isfinite(x).all()):
                for stat, want in reference(x, fmt).items():
                    assert got[stat] == pytest.approx(want, abs=1e-9), (stat, got[stat], want)


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


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_overflow_follows_round_to_nearest_past_max(fmt: str) -> None:
    """Magnitudes between ``max`` and the midpoint to the next step up round to ``max`` (finite,
    fp16's 65,510 becomes 65,504), the midpoint itself to inf, as ``x.to(dtype)`` does. (The
    float8 formats are scaled so that ``amax`` maps to ``max``: no finite element passes it.)"""
    f = FORMATS[fmt]
    bound, _ = f.finite
    between = torch.linspace(f.max, bound, 9, dtype=torch.float64).float()
    x = torch.cat([between, -between, torch.tensor([65510.0, 2 * f.max])])
    want = reference(x, fmt)[f"overflow_{fmt}"]
    assert measured(NUMERIC[Source.OUTPUT_GRADIENT], x)[f"overflow_{fmt}"] == pytest.approx(want, abs=1e-9)
    assert 0 < want < 0.25  # (the midpoints and 2 max: the rest, past max, stays finite)


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
    assert got["amax_channel"] == 7 and got["median_abs"] == x.abs().median().item()
    small = measured(NUMERIC[Source.OUTPUT], x[:, :7] * 1e-9)
    assert small["underflow_e4m3"] == 0 and small["underflow_fp16"] > 0.5  # unscaled fp16 flushes it


def test_the_median_of_a_large_output_is_that_of_a_bounded_sample_and_keeps_the_massive_finding(tmp_path) -> None:
    """Above ``SAMPLE_CAP`` elements the median |x| is taken of the histograms' jittered sample:
    no op of the logged step sorts or selects over more elements, the figure is within a few
    percentiles of the exact median, and an outlier channel is still a massive activation."""
    from tblog_hooks.stats.sampling import SAMPLE_CAP

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(proj=nn.Linear(64, 512)))
    with torch.no_grad():
        model.proj.bias[5] = 500.0
    x = torch.randn(64, 64)
    magnitudes = model(x).detach().abs().flatten().sort().values  # (64 x 512 elements)
    selected: list[int] = []

    class Selections(OpCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if str(func.overloadpacket) in ("aten.median", "aten.kthvalue", "aten.sort", "aten.topk"):
                selected.append(args[0].numel())
            return super().__torch_dispatch__(func, types, args, kwargs)

    with HookLogger(model, log_dir=tmp_path, every=1, numerics=("e4m3",), histograms=False) as hooks, Selections():
        train(hooks, [model(x).sum()])
    assert selected and max(selected) <= SAMPLE_CAP < magnitudes.numel()
    got = read_run(tmp_path).scalars["activation/median_abs/proj"][0]
    rank = torch.searchsorted(magnitudes, torch.tensor(got)).item() / magnitudes.numel()
    assert 0.47 < rank < 0.53, rank
    assert "massive_activation" in {f.kind for f in hooks.findings}


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


def test_numerics_true_writes_the_autocast_format_without_activations(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=True, activations=False, histograms=False) as hooks:
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


def test_parameter_gradients_unscaled_for_the_optimizer_are_judged_at_the_loss_scale(tmp_path) -> None:
    """With ``optimizer=`` the gradients are read after ``GradScaler.unscale_``: their fractions are
    those of the gradients backward made at the loss scale (kept by a post-accumulate hook), their
    amax that of the unscaled ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    kept = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: kept.__setitem__(name, p.grad.clone()))
    with HookLogger(
        model, log_dir=tmp_path, every=1, numerics=("fp16",), scaler=scaler, optimizer=opt, histograms=False
    ) as hooks:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(16, 8)).float().sum() * 1e-6
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        hooks.step()
    scalars = {t: v[0] for t, v in read_run(tmp_path).scalars.items()}
    for name, grad in kept.items():
        assert grad.count_nonzero() == grad.numel()  # nothing is lost at the scale
        for stat, want in reference(grad, "fp16").items():
            assert scalars[f"param_grad/{stat}/{name}"] == pytest.approx(want, abs=1e-6), (name, stat)
        assert scalars[f"param_grad/amax/{name}"] == pytest.approx(grad.abs().max().item() / 2.0**16, rel=1e-6)
    assert reference(kept["0.weight"] / 2.0**16, "fp16")["underflow_fp16"] > 0.05  # (unscaled, fp16 would lose them)


# -- options and cost -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("fp16", "a tuple: numerics=('fp16',)"),
        (("fp32",), "unknown format(s) ['fp32']"),
        (("fp16", "fp16"), "a format named twice"),
        ((), "a non-empty tuple"),
        ("off", "got 'off'"),
        (1, "got 1"),
    ],
)
def test_bad_numerics_is_refused_at_construction(tmp_path, value: object, said: str) -> None:
    with pytest.raises(HookLoggerError, match=r"numerics") as raised:
        HookLogger(nn.Linear(2, 2), log_dir=tmp_path, numerics=value)
    assert said in str(raised.value) and "'fp16', 'bf16', 'e4m3', 'e5m2'" in str(raised.value)


#: Aten ops a logged step may add per watched tensor (output, output gradient, parameter
#: gradient) of a small model with every format: a base for |x|, the amax, the powers, the
#: non-zero count (of an output: its median instead), the buffer the counts are written into
#: side by side and their one sum; one a count (a comparison into the buffer: 4 per unscaled
#: format, 2 per scaled one) and two a scaled format's scaling; and per fp8 cast of a Linear's
#: input or weight.
BASE_OPS, OPS_PER_COUNT, OPS_PER_SCALING, OPS_PER_CAST = 17, 1, 2, 13
COUNTS = sum(2 if f.scaled else 4 for f in FORMATS.values())


class _Overloads(OpCounter):
    """:class:`OpCounter` by overload (``aten.le.Scalar_out``), in ``overloads``."""

    def __init__(self) -> None:
        super().__init__()
        self.overloads: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.overloads[str(func)] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_ops_are_bounded_per_tensor_and_format_and_none_when_not_logged(tmp_path) -> None:
    """A bounded number of ops per watched tensor, and of the cheap kind: each count a comparison
    written into a float buffer and a sum, never a bool tensor counted with ``count_nonzero``
    (five times slower on a CPU, where a logged step with ``numerics=`` is to cost at most 1.5x
    one without: ``docs/benchmark.md``)."""
    model = nn.Sequential(OrderedDict((f"l{i}", nn.Linear(32, 32)) for i in range(6)))
    x = torch.randn(8, 32)

    def ops(hooks: HookLogger | None) -> _Overloads:
        with _Overloads() as counter:
            train(hooks, [model(x).square().mean()])
        return counter

    baseline = sum(ops(None).ops.values())
    counts = {}
    for numerics in (False, ALL):
        with HookLogger(model, log_dir=tmp_path / str(bool(numerics)), every=2, numerics=numerics) as hooks:
            counts[numerics] = (ops(hooks), ops(hooks), ops(hooks))  # logged, not logged, logged
        assert sum(counts[numerics][1].ops.values()) == baseline
    tensors = 6 * (1 + 1 + 2)  # per Linear: its output, its output gradient, its weight's and bias's gradients
    casts = 6 * 2  # per Linear: its input and weight, as fp8 training casts them
    scaled = sum(f.scaled for f in FORMATS.values())
    per_tensor = BASE_OPS + OPS_PER_COUNT * COUNTS + OPS_PER_SCALING * scaled
    for logged in (0, 2):
        added = counts[ALL][logged].overloads - counts[False][logged].overloads
        assert 0 < sum(added.values()) <= tensors * per_tensor + casts * OPS_PER_CAST, added
        compared = {op: n for op, n in added.items() if op.split(".")[1] in ("le", "lt", "ne", "eq", "gt", "ge")}
        assert set(compared) <= {"aten.le.Scalar_out", "aten.lt.Scalar_out", "aten.ne.Scalar_out"}, compared
        assert sum(compared.values()) == tensors * COUNTS + casts * 2 + (tensors - 6) + casts  # (+ non-zero counts)
        assert "aten.count_nonzero.default" not in added


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
    assert "use a loss scale of 2^" in message and "or train in bf16" in message
    largest = max(v[0] for t, v in scalars.items() if t.startswith(("gradient/amax/", "param_grad/amax/")))
    assert f"2^{math.floor(math.log2(65504 / largest)) - 1} " in message  # every gradient, a power of two spare
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


def test_massive_activation_names_the_module_and_channel(tmp_path) -> None:
    model = _outlier_model()
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=("e4m3", "e5m2"), histograms=False) as hooks:
        train(hooks, [model(torch.randn(32, 8)).sum()])
    by_kind = {(f.kind, f.module): f for f in hooks.findings}
    massive = by_kind[("massive_activation", "proj")]
    assert "channel 5" in massive.message and massive.value == pytest.approx(500.0, rel=1e-4)
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


# -- what fp16 loses, against a float32 twin -----------------------------------------------------------
def _relu_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def _relu_run(tmp_path, *, fp16: bool, shift: int) -> tuple[dict[str, float], list]:
    """One logged step of the ReLU MLP, under fp16 autocast or in float32, with the loss scaled by
    ``2^-shift`` (no scaler): its scalars and findings. The same weights and data either way."""
    model = _relu_mlp()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(2))
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=("fp16",), histograms=False) as hooks:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            out = model(x)
        train(hooks, [nn.functional.cross_entropy(out.float(), y) * 2.0**-shift])
    return {t: v[0] for t, v in read_run(tmp_path).scalars.items()}, hooks.findings


LINEARS = ("0", "2", "4")  # (the head's output gradient has no ReLU zeros)


def test_fp16_gradient_underflow_counts_what_the_cast_makes_zero_not_relu_zeros(tmp_path) -> None:
    """A float32 ReLU MLP naming fp16: half of each hidden gradient is zero (the ReLU's), the cast
    loses next to nothing of the rest at scale 1 (no finding), and at 2^-10 the finding's value is
    the cast's count itself."""
    scalars, findings = _relu_run(tmp_path / "1", fp16=False, shift=0)
    assert min(scalars[f"gradient/zero_frac/{m}"] for m in LINEARS) > 0.45
    assert max(scalars[f"gradient/underflow_fp16/{m}"] for m in LINEARS) < 1e-3
    assert [f for f in findings if f.kind == "fp16_gradient_underflow"] == []
    scalars, findings = _relu_run(tmp_path / "2", fp16=False, shift=10)
    named = {f.module: f.value for f in findings if f.kind == "fp16_gradient_underflow"}
    assert named and all(v == scalars[f"gradient/underflow_fp16/{m}"] for m, v in named.items())
    assert named["0"] > 0.05 and "estimated" not in next(f.message for f in findings if f.module == "0")


def test_an_fp16_run_shows_what_it_lost_against_its_float32_twin(tmp_path) -> None:
    """Under fp16 autocast the gradients are fp16 already: the cast loses nothing more, and what the
    run lost is its zeros beyond those of its float32 twin (same weights and data: the structural
    ones). The share at fp16's smallest subnormal (``gradient/floor_fp16``) moves with that loss,
    within 3x of it wherever 1% or more is lost, and the finding follows it."""
    previous = dict.fromkeys(LINEARS, -1.0)
    for shift in (0, 6, 10, 12):
        half, half_found = _relu_run(tmp_path / f"fp16-{shift}", fp16=True, shift=shift)
        full, _ = _relu_run(tmp_path / f"fp32-{shift}", fp16=False, shift=shift)
        named = {f.module: f for f in half_found if f.kind == "fp16_gradient_underflow"}
        for m in LINEARS:
            lost = half[f"gradient/zero_frac/{m}"] - full[f"gradient/zero_frac/{m}"]
            floor = half[f"gradient/floor_fp16/{m}"]
            assert half[f"gradient/underflow_fp16/{m}"] == 0
            if shift == 0:
                assert lost == floor == 0
            if lost >= 0.01:
                assert lost / 2 < floor < 3 * lost, (shift, m, lost, floor)
                assert m in named and named[m].value == floor and "estimated" in named[m].message
            assert floor >= previous[m]
            previous[m] = floor
        if shift == 0:
            assert named == {}
    assert half["gradient/zero_frac/0"] - full["gradient/zero_frac/0"] > 0.1  # (2^-12 loses a lot)


def _bias_heavy_run(tmp_path, scaler: torch.amp.GradScaler, steps: int) -> tuple[list, list[float]]:
    """An fp16 MLP on a batch of 512 whose loss is a mean: each bias gradient sums its output
    gradient over the batch, hundreds of times its largest element; the loss is scaled by 1e-3, so
    that its gradients underflow fp16 at scale 1. Returns the findings and the
    scale after each step (a skipped step halves it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(0)
    scales = []
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=True, scaler=scaler, optimizer=opt) as hooks:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(512, 16, generator=data)).float().mean() * 1e-3
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            hooks.step()
            scales.append(scaler.get_scale())
    return hooks.findings, scales


def test_the_loss_scale_advice_keeps_every_gradient_finite(tmp_path) -> None:
    """At scale 1 the output gradients underflow; following the advice, ``GradScaler(init_scale=...)``
    skips no step (the bias gradients stay finite) and the underflow is gone."""
    findings, _ = _bias_heavy_run(tmp_path / "1", torch.amp.GradScaler("cpu", init_scale=1.0), 1)
    (message,) = {f.message for f in findings if f.kind == "fp16_gradient_underflow" and f.module == "0"}
    advised = 2.0 ** int(re.search(r"loss scale (?:up to |of )2\^(\d+)", message).group(1))
    findings, scales = _bias_heavy_run(tmp_path / "advised", torch.amp.GradScaler("cpu", init_scale=advised), 8)
    assert scales == [advised] * 8, (advised, scales)
    assert [f for f in findings if f.kind == "fp16_gradient_underflow"] == []


# -- fp8: what the recipe casts, against torchao ----------------------------------------------------------
def _fp8_model() -> nn.Sequential:
    """Four Linears; ``l0``'s output (``l1``'s input) has one channel at 300, and ``l2``'s weight one
    element at 40: per-tensor e4m3 scaled to them flushes the small elements of those tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict((f"l{i}", nn.Linear(32, 32)) for i in range(4)))
    with torch.no_grad():
        model.l0.weight.mul_(1e-3)
        model.l0.bias.mul_(1e-3)
        model.l0.bias[5] = 300.0
        model.l2.weight.mul_(1e-4)
        model.l2.weight[3, 7] = 40.0
    return model


@pytest.mark.parametrize("named", [("e4m3", "e5m2"), ("e4m3",), ("e5m2",)], ids="+".join)
def test_fp8_judges_each_linears_input_weight_and_output_gradient_as_torchao_casts_them(tmp_path, named) -> None:
    """The fractions are those of torchao's own cast (``hp_tensor_to_float8_dynamic``, the function
    its ``Float8Linear`` casts with, per-tensor e4m3 for the input and weight, e5m2 for the output
    gradient), and the finding names the Linear that casts the tensor (``l1``, whose input holds
    ``l0``'s outlier; ``l2``, whose weight holds one), not ``l0``, whose output holds it. Each
    fraction is checked against torchao's cast, whichever float8 format ``numerics=`` names (the
    recipe casts to both)."""
    scaling = pytest.importorskip("torchao.float8.float8_scaling_utils")
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    def torchao_lost(t: Tensor, dtype: torch.dtype, role: GemmInputRole) -> float:
        cast = scaling.hp_tensor_to_float8_dynamic(t, dtype, LinearMMConfig(), gemm_input_role=role)
        return float(((t != 0) & (cast._data.float() == 0)).sum()) / t.numel()

    model = _fp8_model()
    inputs: dict[str, Tensor] = {}
    for name, module in model.named_children():
        module.register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(name, args[0].detach().clone()))
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=named, histograms=False) as hooks:
        kept, remove = _captured(model, list(hooks.module_names))
        train(hooks, [model(torch.randn(64, 32)).square().mean()])
        remove()
    scalars = {t: v[0] for t, v in read_run(tmp_path).scalars.items()}
    e4m3, e5m2, role = torch.float8_e4m3fn, torch.float8_e5m2, GemmInputRole
    for name, module in model.named_children():
        pairs = [
            (f"input/underflow_e4m3/{name}", torchao_lost(inputs[name], e4m3, role.INPUT)),
            (f"param/underflow_e4m3/{name}.weight", torchao_lost(module.weight.detach(), e4m3, role.WEIGHT)),
            (f"gradient/underflow_e5m2/{name}", torchao_lost(kept[f"gradient/{name}"], e5m2, role.GRAD_OUTPUT)),
        ]
        for key, want in pairs:
            assert scalars[key] == pytest.approx(want, abs=1e-9), key
    assert scalars["input/underflow_e4m3/l1"] > 0.1 and scalars["param/underflow_e4m3/l2.weight"] > 0.1
    if "e4m3" in named:  # (the output holding the outlier, which no recipe casts: a format's picture only)
        assert scalars["activation/underflow_e4m3/l0"] > 0.1
    else:
        assert "activation/underflow_e4m3/l0" not in scalars and "gradient/underflow_e4m3/l0" not in scalars
    named = {f.module: f.message for f in hooks.findings if f.kind == "fp8_underflow"}
    assert {"l1", "l2"} <= set(named) and "l0" not in named, named  # (l3's input holds l2's outlier output)
    assert "of the input of l1" in named["l1"] and "of the weight of l2" in named["l2"]


def test_fp8_rowwise_counts_each_linears_input_and_weight_as_torchaos_rowwise_recipe(tmp_path) -> None:
    """With ``fp8_scaling="rowwise"``, the input and weight fractions are those of torchao's
    rowwise cast (``hp_tensor_to_float8_dynamic`` with axiswise granularity, as its ``Float8Linear``
    calls it under ``Float8LinearConfig.from_recipe_name("rowwise")``: the input per token, the
    weight per output feature, power-of-two scales). ``l2``'s one large weight costs its own row
    only (at most 1/32 of the weight, against over 10% per tensor); ``l0``'s outlier channel is in
    every token of ``l1``'s input, which still loses its small elements."""
    scaling = pytest.importorskip("torchao.float8.float8_scaling_utils")
    from torchao.float8.config import Float8LinearConfig, ScalingGranularity
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    config = Float8LinearConfig.from_recipe_name("rowwise")
    assert config.round_scales_to_power_of_2 and config.cast_config_input.target_dtype == torch.float8_e4m3fn

    def torchao_lost(t: Tensor, role: GemmInputRole, dim: int) -> float:
        cast = scaling.hp_tensor_to_float8_dynamic(
            t, torch.float8_e4m3fn, LinearMMConfig(), gemm_input_role=role,
            scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim, round_scales_to_power_of_2=True,
        )  # fmt: skip
        return float(((t != 0) & (cast._data.float() == 0)).sum()) / t.numel()

    model = _fp8_model()
    inputs: dict[str, Tensor] = {}
    for name, module in model.named_children():
        module.register_forward_pre_hook(lambda m, args, name=name: inputs.__setitem__(name, args[0].detach().clone()))
    options = dict(every=1, numerics=("e4m3",), fp8_scaling="rowwise", histograms=False)
    with HookLogger(model, log_dir=tmp_path, **options) as hooks:  # type: ignore[arg-type]
        train(hooks, [model(torch.randn(64, 32)).square().mean()])
    scalars = {t: v[0] for t, v in read_run(tmp_path).scalars.items()}
    for name, module in model.named_children():
        want_input = torchao_lost(inputs[name], GemmInputRole.INPUT, -1)  # (Float8Linear: axiswise_dim -1 ...)
        want_weight = torchao_lost(module.weight.detach().t(), GemmInputRole.WEIGHT, 0)  # (... and 0 of weight.t())
        assert scalars[f"input/underflow_e4m3/{name}"] == pytest.approx(want_input, abs=1e-9), name
        assert scalars[f"param/underflow_e4m3/{name}.weight"] == pytest.approx(want_weight, abs=1e-9), name
    assert scalars["input/underflow_e4m3/l1"] > 0.1 and 0 < scalars["param/underflow_e4m3/l2.weight"] <= 1 / 32
    named = {f.module: f.message for f in hooks.findings if f.kind == "fp8_underflow"}
    assert "of the input of l3" in named["l3"] and "(per row)" in named["l3"]  # (l2's outlier output, per token)


def _torchao_rowwise_gradient(g: Tensor) -> dict[str, float]:
    """The fractions of ``g``, a Linear's output gradient, that torchao's rowwise recipe loses to
    zero and makes NaN/Inf in its two casts of it, cast by torchao itself: its
    ``Float8LinearConfig.from_recipe_name("rowwise")``'s casts of the gradient for grad_input and
    grad_weight, made as ``matmul_with_hp_or_float8_args.backward`` makes them (the 2-d view,
    ``get_maybe_axiswise_dim(-1 | 0, ...)``, the recipe's power-of-two rounding)."""
    scaling = pytest.importorskip("torchao.float8.float8_scaling_utils")
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    config = Float8LinearConfig.from_recipe_name("rowwise")
    reshaped = g.reshape(-1, g.shape[-1])
    out = {}
    for axis, dim, cast in (
        ("rows", -1, config.cast_config_grad_output),
        ("columns", 0, config.cast_config_grad_output_for_grad_weight),
    ):
        assert cast.target_dtype == torch.float8_e4m3fn
        bits = scaling.hp_tensor_to_float8_dynamic(
            reshaped, cast.target_dtype, LinearMMConfig(), gemm_input_role=GemmInputRole.GRAD_OUTPUT,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=scaling.get_maybe_axiswise_dim(dim, cast.scaling_granularity),
            round_scales_to_power_of_2=config.round_scales_to_power_of_2,
        )._data.float()  # fmt: skip
        out[f"underflow_e4m3_{axis}"] = float(((reshaped != 0) & (bits == 0)).sum()) / g.numel()
        out[f"overflow_e4m3_{axis}"] = float((~bits.isfinite()).sum()) / g.numel()
    return out


def _rowwise_gradient_run(tmp_path, token: float | None = None, element: float | None = None):  # type: ignore[no-untyped-def]
    """``_fp8_model`` trained one step on (batch, tokens, features) inputs with ``fp8_scaling="rowwise"``,
    its loss weighted ``token`` on one token or ``element`` on one element of its output; the
    scalars, the findings and each Linear's output gradient (kept by a tensor hook of the test)."""
    model = _fp8_model()
    options = dict(every=1, numerics=("e4m3",), fp8_scaling="rowwise", histograms=False)
    with HookLogger(model, log_dir=tmp_path, **options) as hooks:  # type: ignore[arg-type]
        kept, remove = _captured(model, list(hooks.module_names))
        weight = torch.ones(4, 16, 32)
        if token is not None:
            weight[2, 5] = token
        if element is not None:
            weight[1, 3, 4] = element
        train(hooks, [(model(torch.randn(4, 16, 32)).square() * weight).mean()])
        remove()
    scalars = {t: v[0] for t, v in read_run(tmp_path).scalars.items()}
    return scalars, hooks.findings, {name: kept[f"gradient/{name}"] for name, _ in model.named_children()}


@pytest.mark.parametrize("outlier", ["weight", "token", "inf"])
def test_fp8_rowwise_counts_each_linears_output_gradient_as_torchaos_two_casts(tmp_path, outlier: str) -> None:
    """With ``fp8_scaling="rowwise"``, every Linear's output gradient is counted as torchao's
    rowwise recipe casts it, to e4m3 per row (for grad_input) and per column (for grad_weight),
    every fraction equal to torchao's own casts of the same (3-d) gradient. ``l2``'s weight
    outlier puts one large feature in every row of ``l1``'s gradient: the row cast loses the rest
    of each row, the column cast nothing; a token weighted 1e7 in the loss is one large row in
    every gradient: the column cast loses the rest of each column, the row cast nothing more; an
    Inf spoils its own row in one cast and its own column in the other."""
    runs = {"weight": {}, "token": {"token": 1e7}, "inf": {"element": math.inf}}
    scalars, _, gradients = _rowwise_gradient_run(tmp_path, **runs[outlier])  # type: ignore[arg-type]
    for name, g in gradients.items():
        assert g.dim() == 3
        for stat, want in _torchao_rowwise_gradient(g).items():
            assert scalars[f"gradient/{stat}/{name}"] == pytest.approx(want, abs=1e-9), (name, stat)
    rows, columns = (scalars[f"gradient/underflow_e4m3_{axis}/l1"] for axis in ("rows", "columns"))
    if outlier == "weight":
        assert rows == pytest.approx(31 / 32) and columns == 0
    elif outlier == "token":
        assert columns > 0.9 and scalars["gradient/underflow_e4m3_rows/l3"] == 0
        assert scalars["gradient/underflow_e4m3_columns/l3"] == pytest.approx(63 / 64)
    else:
        n = 4 * 16 * 32
        assert scalars["gradient/overflow_e4m3_rows/l3"] == scalars["gradient/overflow_e4m3_columns/l3"] == 1 / n
        assert scalars["gradient/underflow_e4m3_rows/l3"] == 31 / n
        assert scalars["gradient/underflow_e4m3_columns/l3"] == 63 / n


def test_fp8_rowwise_findings_name_the_linear_and_the_cast_of_its_output_gradient(tmp_path) -> None:
    """The rowwise gradient casts are judged instead of the per-tensor e5m2 one: ``l1``, whose
    gradient's rows hold ``l2``'s outlier feature, is named for its grad_input cast; with one token
    weighted 1e7, ``l0`` (whose input and weight lose nothing) for its grad_weight cast; an Inf in
    the gradient is fp8_overflow in both."""
    _, findings, _ = _rowwise_gradient_run(tmp_path / "weight")
    named = {f.module: f for f in findings if f.kind == "fp8_underflow"}
    assert named["l1"].value == pytest.approx(31 / 32)
    assert "of the output gradient of l1 is lost to zero in e4m3" in named["l1"].message
    assert "per row, for grad_input" in named["l1"].message and "l0" not in named
    _, findings, _ = _rowwise_gradient_run(tmp_path / "token", token=1e7)
    named = {f.module: f for f in findings if f.kind == "fp8_underflow"}
    assert "of the output gradient of l0" in named["l0"].message and "per column" in named["l0"].message
    assert "for grad_weight" in named["l0"].message
    _, findings, _ = _rowwise_gradient_run(tmp_path / "inf", element=math.inf)
    overflow = {f.module: f.message for f in findings if f.kind == "fp8_overflow"}
    assert "of the output gradient of l3 is NaN/Inf in e4m3" in overflow["l3"]


#: Aten ops a logged step may add per Linear with ``fp8_scaling="rowwise"`` over the tensorwise
#: recipe: its output gradient's two casts (|g|, the buffer, its non-zero count, per cast the
#: amaxes, their power-of-two scales, the scaled magnitudes and two comparisons, and the one sum),
#: and the per-row scales of its input and weight (4 ops more each than one per tensor).
OPS_PER_ROWWISE_LINEAR = 48


def test_fp8_rowwise_gradient_casts_are_of_linears_on_logged_steps_only_and_bounded(tmp_path) -> None:
    """The gradient casts add a bounded number of ops per Linear (five comparisons: the non-zero
    count, and per cast what it makes zero and keeps finite), none on a step not logged, and
    none for a module that is not a Linear (the recipe casts only those)."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(l0=nn.Linear(32, 32), norm=nn.LayerNorm(32), l1=nn.Linear(32, 32)))
    x = torch.randn(8, 32)

    def ops(hooks: HookLogger | None) -> _Overloads:
        with _Overloads() as counter:
            train(hooks, [model(x).square().mean()])
        return counter

    counts = {}
    for scaling in ("tensorwise", "rowwise"):
        options = dict(every=2, numerics=("e4m3",), fp8_scaling=scaling, histograms=False)
        with HookLogger(model, log_dir=tmp_path / scaling, **options) as hooks:  # type: ignore[arg-type]
            counts[scaling] = (ops(hooks).overloads, ops(hooks).overloads)  # logged, not logged
    assert counts["rowwise"][1] == counts["tensorwise"][1]  # (a step not logged adds nothing to either)
    added = counts["rowwise"][0] - counts["tensorwise"][0]
    compared = {op: n for op, n in added.items() if op.split(".")[1] in ("le", "lt", "ne", "eq", "gt", "ge")}
    assert compared == {"aten.le.Scalar_out": 2 * 4, "aten.ne.Scalar_out": 2}, compared
    assert sum(added.values()) <= 2 * OPS_PER_ROWWISE_LINEAR, added
    written = {t for t in read_run(tmp_path / "rowwise").scalars if "_e4m3_rows/" in t or "_e4m3_columns/" in t}
    assert {t.rsplit("/", 1)[1] for t in written} == {"l0", "l1"} and len(written) == 2 * 4


def test_fp8_tensorwise_counts_no_rowwise_gradient_casts(tmp_path) -> None:
    """With the default tensorwise recipe the output gradient is judged per tensor in e5m2 alone."""
    model = _fp8_model()
    with HookLogger(model, log_dir=tmp_path, every=1, numerics=("e4m3", "e5m2"), histograms=False) as hooks:
        train(hooks, [model(torch.randn(64, 32)).square().mean()])
    scalars = read_run(tmp_path).scalars
    assert "gradient/underflow_e5m2/l1" in scalars
    assert not [t for t in scalars if "_rows/" in t or "_columns/" in t]


def test_fp8_scaling_needs_a_float8_format_and_a_recipe_name(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(HookLoggerError, match="only with e4m3 or e5m2 in numerics="):
        HookLogger(model, log_dir=tmp_path, numerics=("bf16",), fp8_scaling="rowwise")
    with pytest.raises(HookLoggerError, match="'tensorwise', 'rowwise'"):
        HookLogger(model, log_dir=tmp_path, numerics=("e4m3",), fp8_scaling="blockwise")  # type: ignore[arg-type]
