"""The fused Triton kernels (``tblog_hooks/kernels/fused.py``) against the torch reductions, in
Triton's interpreter on CPU tensors (``conftest`` sets ``TRITON_INTERPRET=1`` without a GPU).

Counts, extremes, amax and per-unit peaks equal torch's exactly; the moments (mean, centred norm,
norm, the powers behind RMS and kurtosis) to float32 rounding: within ``1e-5`` relative (``1e-12``
for float64 tensors) plus, for the mean, ``1e-6`` of the tensor's RMS (a mean near 0 is the
difference of large sums, rounded in another order). Every run gives the same bits, deterministic
algorithms or not (no float atomics). The tensors are small: the interpreter runs each program
as Python.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import both_paths
import pytest
import torch
from conftest import OpCounter, needs_cuda, read_run
from models import conv_net, mlp, train
from test_numerics import _tensors
from test_zoo import CASES as ZOO
from test_zoo import _train as train_zoo_model
from torch import Tensor, nn

from tblog_hooks import Histograms, HookLogger, HookLoggerError
from tblog_hooks.kernels import VARIABLE, Kernels, outputs
from tblog_hooks.stats import numerics, reductions, sampling
from tblog_hooks.stats.kinds import NORM, SUM, Field, Measure
from tblog_hooks.stats.sampling import SAMPLE_CAP
from tblog_hooks.stats.tags import HISTOGRAM_KINDS

fused = pytest.importorskip("tblog_hooks.kernels.fused", reason="Triton is not importable")
pytestmark = [
    pytest.mark.skipif(not (torch.cuda.is_available() or fused.INTERPRETED), reason="no GPU, no Triton interpreter"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning:numpy"),  # (the interpreter's NaN/Inf arithmetic)
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton"),
]

#: Where the kernels run: CPU tensors in the interpreter, else CUDA tensors.
DEVICE = torch.device("cpu" if fused.INTERPRETED else "cuda")
#: Whole training runs on the CPU through the kernels: in the interpreter only (a GPU runs
#: ``test_both_paths_write_the_same_run_on_cuda``).
interpreted = pytest.mark.skipif(not fused.INTERPRETED, reason="CPU models through the kernels: TRITON_INTERPRET=1")

#: Values a kernel must give exactly (the rest are sums, rounded in another order).
EXACT = {*outputs.COUNTS, numerics.COUNTS, "min", "max", "amax", "ref", "peak", "unit_amax"}


def reference(x: Tensor, units: int, *, per_unit: bool, with_numerics: bool) -> dict[str, Tensor]:
    """The torch reductions' values of ``x``, by the names the kernels give them."""
    out = {
        **reductions.mean_and_centred_norm(x, units),
        **reductions.extremes(x, units),
        "nonzero": torch.count_nonzero(x),
        "finite": reductions.finite(x),
        "nonfinite": reductions.nonfinite(x),
        "norm": reductions.norm(x),
    }
    if per_unit:
        out.update(reductions.unit_peaks(x, units))
    if with_numerics:
        measured = numerics.measure(x, units, channels=per_unit)
        # (its own non-zero count is a vector of one, split from the counts it is summed with)
        assert measured.pop("nonzero").reshape(()) == out["nonzero"]
        out.update(measured)
    return out


def assert_same(got: dict[str, Tensor], x: Tensor, want: dict[str, Tensor]) -> None:
    rtol = 1e-12 if x.dtype == torch.float64 else 1e-5
    rms = x.double().square().mean().sqrt().item()
    for name, w in want.items():
        g, w = got[name].double(), w.double()
        assert g.shape == w.shape, name
        if name in EXACT:
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=name)
        else:
            atol = 1e-6 * rms if name == "mean" and math.isfinite(rms) else 0.0
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True, msg=name)


def _check(x: Tensor, units: int = -1) -> None:
    x = x.to(DEVICE)
    for per_unit, with_numerics in ((False, False), (True, True)):
        got = fused.statistics(x, units, per_unit=per_unit, numerics=with_numerics)
        assert_same(got, x, reference(x, units, per_unit=per_unit, with_numerics=with_numerics))


def test_the_kernels_give_every_value_they_name_and_no_other() -> None:
    """``outputs.OUTPUTS`` (what a ``fused=True`` measure may have, checked where it is declared)
    is what a call of the kernels gives, each value equal to the torch reductions' of that name
    (:func:`reference`: every name of it but the per-format counts' own)."""
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    got = fused.statistics(x, -1, per_unit=True, numerics=True)
    assert tuple(got) == outputs.OUTPUTS
    want = reference(x, -1, per_unit=True, with_numerics=True)
    assert set(got) <= set(want)
    assert_same(got, x, want)
    assert set(fused.statistics(x, -1, per_unit=False, numerics=False)) == set(outputs.OUTPUTS) - set(outputs.PER_UNIT)


SHAPES = {"one": ((1,), -1), "vector": ((1000,), -1), "rows": ((16, 300), -1), "channels first": ((4, 70, 5, 3), 1)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_random_tensors_equal_torch(shape: str, dtype: torch.dtype) -> None:
    size, units = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    _check((torch.randn(size, generator=g) * 3 + 1).to(dtype), units)


def _special() -> dict[str, Tensor]:
    nan, inf = math.nan, math.inf
    g = torch.Generator().manual_seed(1)
    one_unit_nan = torch.randn(5, 4, generator=g)
    one_unit_nan[2, 1] = nan
    return {
        "nan": torch.tensor([[nan, 1.0, -2.0], [0.0, 3.0, 4.0]]),
        "inf": torch.tensor([[inf, 1.0], [-2.0, 0.0]]),
        "both infinities": torch.tensor([-inf, inf, 1.0]),
        "all nan": torch.full((2, 3), nan),
        "zero": torch.zeros(1),
        "float32 subnormals": torch.tensor([[1e-40, -1e-41, 0.0], [1e-45, 2e-38, -3e-39]]),
        "large mean": 1e4 + torch.randn(64, 8, generator=g),
        "loss-scaled": 2.0**100 * torch.randn(64, 8, generator=g),  # (a square overflows float32)
        "tiny": 1e-30 * torch.randn(64, 8, generator=g),  # (a square underflows float32)
        "nan in one unit": one_unit_nan,
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_special()))
def test_special_values_equal_torch(name: str) -> None:
    _check(_special()[name])


@pytest.mark.parametrize("name", list(_tensors()))
def test_the_numerics_boundary_tensors_equal_torch(name: str) -> None:
    """``test_numerics``' tensors: magnitudes a few ulps around every format's rounding
    boundaries, 1e-45 to 1e35, NaN/Inf, 16-bit gradients, a massive channel."""
    x = _tensors()[name]
    _check(x.reshape(-1, 32) if x.numel() % 32 == 0 else x)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 64 elements and 4 units, 4 partials combined at a time: every loop and lane of
    the combining runs."""
    for name, value in (("BLOCK", 64), ("TILE_UNITS", 4), ("CHUNK", 4), ("UNIT_CHUNK", 4)):
        monkeypatch.setattr(fused, name, value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_tiles_combine_as_one(small_blocks: None, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 10, 13, generator=g) * 2 - 5).to(dtype)
    x[1, 3, 4] = 0.0
    _check(x, 1)
    _check(x, -1)


def test_many_tiles_with_nan_and_inf(small_blocks: None) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 30, generator=g)
    x[7, 5], x[11, 29] = math.nan, math.inf
    _check(x)


def test_the_same_bits_on_every_run_and_under_deterministic_algorithms(small_blocks: None) -> None:
    x = (torch.randn(24, 40, generator=torch.Generator().manual_seed(4)) * 1e3).to(DEVICE)
    first = fused.statistics(x, -1, per_unit=True, numerics=True)
    torch.use_deterministic_algorithms(True)
    try:
        again = fused.statistics(x, -1, per_unit=True, numerics=True)
    finally:
        torch.use_deterministic_algorithms(False)
    for name, value in first.items():
        assert torch.equal(value, again[name]) or (value.isnan().all() and again[name].isnan().all()), name


def test_bucket_counts_equal_histc_and_the_deterministic_count() -> None:
    """The step's histogram counts: each value's bucket in its row, as ``binning.bin_rows``
    positions it, counted as ``histc`` and the sort-and-search of deterministic mode count."""
    from tblog_hooks.stats.binning import BINS, _counts

    g = torch.Generator().manual_seed(5)
    values = torch.randn(3000, generator=g) * 4
    values[2000:] = 0.5  # a constant row
    values[::97] = math.nan
    values[5], values[6] = math.inf, -math.inf
    rows = torch.arange(3).repeat_interleave(1000)
    finite = values.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).view(3, 1000)
    lo, hi = finite.amin(1), finite.amax(1)  # (as bin_rows ranges its rows: every value is inside)
    half_span = torch.where(hi > lo, (hi / 2 - lo / 2), 0.5)
    start = torch.where(hi > lo, lo, lo - 0.5)
    scale = BINS * (1 - 2**-16) / half_span
    position = (values * 0.5 - (start / 2)[rows]) * scale[rows]
    position = position.floor() + (rows * BINS + 0.5)
    got = fused.bucket_counts(*(t.to(DEVICE) for t in (values, rows, start / 2, scale)), BINS).cpu()
    assert got.dtype == torch.int32 and got.shape == (3, BINS)
    want = _counts(position, 3 * BINS).view(3, BINS)
    assert torch.equal(got.double(), want.double())
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.equal(got.double(), _counts(position, 3 * BINS).view(3, BINS).double())
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("numel", [1, 37, SAMPLE_CAP, SAMPLE_CAP + 1, 100_003, 1 << 20], ids=str)
def test_the_kernels_copy_the_histogram_samples_torch_takes(numel: int) -> None:
    """A tensor's histogram sample, copied by its second launch and by the one launch of many
    tensors: the elements ``sampling.sample`` takes (every one up to ``SAMPLE_CAP``, a hashed one
    per stretch beyond), bit for bit, for every element size (NaN payloads too); the programs
    share the copy (blocks of 512 elements, taken in turn)."""
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g)
    x[numel // 3] = math.nan
    cache = sampling.IndexCache()
    tensors = [x, x.view(torch.int32).bitwise_or(0x7FC00001).view(torch.float32)]  # (NaNs with payloads)
    tensors += [x.bfloat16(), x.half(), x.double(), x.to(torch.float8_e4m3fn)]
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # (take has no float8 kernel)
    want = [sampling.sample(t.view(ints[t.element_size()]), cache) for t in tensors]
    on = [t.to(DEVICE) for t in tensors]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused, "SAMPLE_BLOCK", 512)
        patch.setattr(fused, "UNIT_CHUNK", 1)  # (a program a unit)
        got = fused.histogram_samples(on)
        for t, w in zip(on[:5], want):  # (per unit, of two units where it can: two programs copy)
            by_unit = t.view(-1, 1) if numel % 2 else t.view(-1, 2)
            taken = fused.statistics(by_unit, -1, per_unit=True, numerics=False, sample=True).sample
            assert taken is not None and _bits(taken) == _bits(w)
    assert [_bits(t) for t in got] == [_bits(w) for w in want]


def _bits(t: Tensor) -> bytes:
    return t.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def test_compiled_code_traces_the_kernels_as_one_op() -> None:
    """Under ``torch.compile`` (fullgraph: no graph break) the custom op's fake implementation
    gives the shapes, and the compiled call gives the eager values."""
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def stats(t: Tensor) -> dict[str, Tensor]:
        return fused.statistics(t, -1, per_unit=True, numerics=True)

    compiled = torch.compile(stats, fullgraph=True, backend="aot_eager")
    got, want = compiled(x), stats(x)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, equal_nan=True, msg=name)


# -- the switch --------------------------------------------------------------------------------------
def test_the_switch_refuses_an_unknown_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VARIABLE, "cuda")
    with pytest.raises(HookLoggerError, match=r"TBLOG_HOOKS_KERNELS='cuda' .*'auto', 'triton', 'torch'"):
        Kernels.from_environment()


def test_the_switch_says_which_tensors_the_kernels_take(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(3)
    for choice, takes in (("torch", False), ("auto", False), ("triton", fused.INTERPRETED)):
        monkeypatch.setenv(VARIABLE, choice)
        assert Kernels.from_environment().takes(cpu) is takes, choice
    monkeypatch.delenv(VARIABLE)
    assert Kernels.from_environment().choice == "auto"


def test_triton_without_triton_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import tblog_hooks.kernels

    monkeypatch.delattr(tblog_hooks.kernels, "fused")
    monkeypatch.setitem(sys.modules, "tblog_hooks.kernels.fused", None)  # (an import of it fails)
    with pytest.raises(HookLoggerError, match="TBLOG_HOOKS_KERNELS=triton, but Triton is not importable"):
        Kernels("triton")


# -- on a GPU ----------------------------------------------------------------------------------------
_COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from tblog_hooks.kernels import fused as f

def compile(fn, signature, constants):
    signature = dict(signature, **{name: "constexpr" for name in constants})
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constants)
    assert "cubin" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm

for x, acc in (("*bf16", tl.float32), ("*fp64", tl.float64)):
    a = "*fp64" if acc == tl.float64 else "*fp32"
    sizes = {"R": "i64", "U": "i32", "INNER": "i32", "PU": "i32", "PR": "i32"}
    for numerics in (True, False):
        common = dict(ACC=acc, UNITS=numerics, NUMERICS=numerics)
        compile(f._partials, {"x_ptr": x, "part_ptr": "*fp64", "count_ptr": "*i32", "unit_ptr": a, "const_ptr": a,
                              **sizes}, dict(BR=64, BU=64, **common))
        compile(f._combine, {"part_ptr": "*fp64", "count_ptr": "*i32", "unit_ptr": a, "out_ptr": "*fp64",
                             "x_ptr": x, "sample_ptr": x, "P": "i32", "PR": "i32", "U": "i32", "NUMEL": "i64",
                             "K": "i32"}, dict(C=1024, CN=64, CR=32, CU=32, SAMPLE=numerics, SB=1024, **common))
    compile(f._scaled_counts, {"x_ptr": x, "out_ptr": "*fp64", "const_ptr": a, "NUMEL": "i64"},
            dict(BLOCK=4096, ACC=acc))
    compile(f._buckets, {"v_ptr": a, "row_ptr": "*i64", "half_start_ptr": a, "scale_ptr": a, "count_ptr": "*i32",
                         "N": "i64"}, dict(BINS=32, BLOCK=4096))
for bits in f._BITS.values():
    compile(f._gather_samples, {"table_ptr": "*i64", "T": "i32"}, dict(BITS=bits, SB=1024))
print("compiled")
"""


def test_the_kernels_compile_for_a_gpu() -> None:
    """What the interpreter does not check: every kernel lowers to a cubin for an H100 (sm_90),
    for 16-bit and float64 tensors (float32 is the 16-bit code without the load's cast; Triton
    compiles without a GPU; the interpreter is off in that process)."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]


# -- the logged step on the kernels' path ----------------------------------------------------------
def _conv_run(log_dir: Path, path: str, monkeypatch: pytest.MonkeyPatch, device: str = "cpu") -> dict[str, dict]:
    """Three logged steps of a small conv net (channels-first units, ReLU zeros, an MLP head):
    every histogram kind, the inputs' statistics, every format's numerics; as ``golden.read``
    reads them."""
    monkeypatch.setenv(VARIABLE, path)
    torch.manual_seed(0)
    model = conv_net(6, batch_norm=True).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = torch.randn(3, 4, 3, 8, 8, generator=torch.Generator().manual_seed(1)).to(device)
    every = Histograms(every_logged=1, weights_every_logged=1, kinds=list(HISTOGRAM_KINDS))
    formats = tuple(numerics.FORMATS)
    with HookLogger(model, log_dir=log_dir, every=1, inputs=True, histograms=every, numerics=formats) as hooks:
        train(hooks, (model(x).logsumexp(1).mean() for x in xs), opt)
    return both_paths.golden.read(log_dir)


@interpreted
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_both_paths_write_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launches: Counter[str], deterministic: bool
) -> None:
    torch.use_deterministic_algorithms(deterministic)
    try:
        want = _conv_run(tmp_path / "torch", "torch", monkeypatch)
        assert not launches
        got = _conv_run(tmp_path / "triton", "triton", monkeypatch)
    finally:
        torch.use_deterministic_algorithms(False)
    assert launches["_partials"] > 0 and launches["_buckets"] == 3  # (one binning a logged step)
    assert any(tag.startswith("activation/underflow_e4m3/") for tag in want["scalars"])
    assert both_paths.differences(want, got) == []


#: The torch reductions the kernels replace: none is left on the kernels' path.
FUSED_OPS = {"aten.mean", "aten.linalg_vector_norm", "aten.aminmax", "aten.count_nonzero", "aten.nansum", "aten.rsub"}
FUSED_OPS |= {"aten.amax", "aten.clamp", "aten.reciprocal", "aten.le", "aten.lt", "aten.sub", "aten.histc"}


@needs_cuda
def test_both_paths_write_the_same_run_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launches: Counter[str]
) -> None:
    """The same on a GPU (``auto``: CUDA tensors through the kernels), under deterministic
    algorithms so that the two trainings are the same (cuDNN's convolutions)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        want = _conv_run(tmp_path / "torch", "torch", monkeypatch, "cuda")
        got = _conv_run(tmp_path / "auto", "auto", monkeypatch, "cuda")
    finally:
        torch.use_deterministic_algorithms(False)
    assert launches["_partials"] > 0 and launches["_buckets"] == 3
    assert both_paths.differences(want, got) == []


@interpreted
@pytest.mark.parametrize("with_numerics", [False, True], ids=["plain", "numerics"])
def test_a_logged_step_launches_two_kernels_a_tensor_three_with_numerics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launches: Counter[str], with_numerics: bool
) -> None:
    """Per watched tensor (each output, output gradient and input not the output before it;
    with ``numerics=`` each parameter gradient too) one call of the kernels: two launches, three
    with ``numerics=``; the aten ops left around them are the packing's and the histogram
    sample's, and with ``numerics=`` the median |x| of each output; a step that is not logged
    launches none and adds no op."""
    monkeypatch.setenv(VARIABLE, "triton")
    model = mlp(16, 32, 32, 4, act=nn.ReLU, seed=0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))

    def step(hooks: HookLogger | None) -> Counter[str]:
        with OpCounter() as counter:
            train(hooks, [model(x).square().mean()])
        return counter.ops

    step(None)
    baseline = step(None)  # (with the gradients there: the next steps add to them)
    formats = ("fp16", "bf16") if with_numerics else False  # (every format measured; no float8 named: no fp8 casts)
    with HookLogger(model, log_dir=tmp_path, every=2, histograms=False, numerics=formats) as hooks:
        logged = step(hooks)
        at_logged = Counter(launches)
        launches.clear()
        idle = step(hooks)
        assert idle == baseline and not launches, (idle - baseline, baseline - idle)  # not logged

    watched = len(hooks.module_names)
    assert hooks.module_names == ("0", "2", "4")  # the Linear layers
    params = 2 * watched  # each Linear's weight and bias: their gradients' numerics=
    # Outputs, output gradients and inputs (x, or a ReLU's output: not a watched module's).
    tensors = 3 * watched + params * with_numerics
    calls = at_logged["_partials"]
    assert calls == tensors and at_logged["_combine"] == calls
    assert at_logged["_scaled_counts"] == (2 * watched + params) * with_numerics  # (the inputs have no numerics=)
    assert sum(at_logged.values()) - at_logged["_buckets"] <= (3 if with_numerics else 2) * tensors
    left = logged - baseline
    assert not FUSED_OPS & set(left), left
    if with_numerics:
        assert left["aten.median"] == watched, left


def _every_module_watched(name: str) -> tuple[nn.Module, Tensor]:
    """A 4-layer MLP and a small CNN (batch norm, channels-first units), and a batch of each."""
    g = torch.Generator().manual_seed(10)
    if name == "mlp":
        return mlp(16, 32, 32, 32, 4, act=nn.ReLU, seed=0), torch.randn(8, 16, generator=g)
    torch.manual_seed(0)
    return conv_net(6, batch_norm=True), torch.randn(4, 3, 8, 8, generator=g)


def _logged_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launches: Counter[str], name: str, path: str, formats: object
) -> list[tuple[Counter[str], Counter[str]]]:
    """Per logged step (the first with the default histograms, the second without), the aten
    ops and the kernel launches it adds to a training step of ``name``, every module watched,
    on ``path``; the custom ops that launch the kernels are counted by their launches."""
    monkeypatch.setenv(VARIABLE, path)
    model, x = _every_module_watched(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(hooks: HookLogger | None) -> Counter[str]:
        with OpCounter() as counter:
            train(hooks, [model(x).square().mean()], opt)
        return Counter({op: n for op, n in counter.ops.items() if not op.startswith("tblog_hooks.")})

    step(None)
    baseline = step(None)
    steps = []
    with HookLogger(model, log_dir=tmp_path / path, every=1, modules="*", optimizer=opt, numerics=formats) as hooks:
        for _ in range(2):
            launches.clear()
            steps.append((step(hooks) - baseline, Counter(launches)))
    return steps


@interpreted
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_the_kernels_path_launches_fewer_kernels_than_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launches: Counter[str], name: str
) -> None:
    """Every module watched, a logged step's launches plus aten ops on the kernels' path: at
    most half the torch path's aten ops, with the default histograms and without (the samples
    copied by the kernels: each watched tensor's by its second launch, the parameters' and their
    gradients' by one launch each; the bins counted by one; the binning's range and head stay
    torch ops); with ``numerics=`` on four formats at most 3 launches a watched tensor. Each
    tensor's values are one buffer of the kernels, packed whole: no view of it is made."""
    torch_steps = _logged_steps(tmp_path, monkeypatch, launches, name, "torch", False)
    kernel_steps = _logged_steps(tmp_path, monkeypatch, launches, name, "triton", False)
    assert [on["_buckets"] for _, on in kernel_steps] == [1, 0]  # (histograms on the first only)
    assert [on["_gather_samples"] for _, on in kernel_steps] == [2, 0]  # (the weights, their gradients)
    for (want, _), (ops, launched) in zip(torch_steps, kernel_steps):
        assert not ops["aten.unbind"] and not ops["aten.take"], ops
        assert ops.total() + launched.total() <= want.total() / 2, (ops, launched, want.total())
    formats = ("fp16", "bf16", "e4m3", "e5m2")
    for _, launched in _logged_steps(tmp_path, monkeypatch, launches, name, "triton", formats):
        tensors = launched["_partials"]
        assert launched["_combine"] == tensors and launched["_scaled_counts"] <= tensors
        per_step = launched["_buckets"] + launched["_gather_samples"]
        assert launched.total() - per_step <= 3 * tensors, launched


@interpreted
def test_compiled_hooks_trace_the_kernels_and_log_what_the_torch_path_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launches: Counter[str]
) -> None:
    """``tests/test_compile.py``'s model (a shared module, in-place ops after the watched one,
    gradient accumulation) compiled with ``aot_eager`` on the kernels' path: two graphs, no
    graph break (the custom ops trace through their fake implementations), the output
    gradients' probes summarised by the kernels, and the values of the eager torch path (to
    ``test_compile``'s ``1e-4``)."""
    from test_compile import _assert_same_scalars
    from test_compile import _train as train_compile_model
    from torch._dynamo.utils import counters

    eager, _ = train_compile_model(tmp_path / "eager", backend=None, numerics=True)
    monkeypatch.setenv(VARIABLE, "triton")
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = train_compile_model(tmp_path / "compiled", backend="aot_eager", numerics=True)
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    assert launches["_partials"] > 0
    del eager.scalars["gradient/amax/shared"]  # (two calls: a maximum does not add up in the probe)
    _assert_same_scalars(compiled, eager, ("activation/", "param_grad/", "input/", "gradient/"))
    # The histograms, of the samples the kernels copied (the probes' too): bucket for bucket.
    compared = {tag for tag in eager.histograms if not (tag.startswith("gradient") and tag.endswith("/shared"))}
    assert {"gradient/block.fc", "activation/block.fc", "param_grad/block.fc.weight"} <= compared
    for tag in compared:
        for step, want in eager.histograms[tag].items():
            got = compiled.histograms[tag][step]
            assert (got.num, list(got.bucket)) == (want.num, list(want.bucket)), (tag, step)
            assert list(got.bucket_limit) == pytest.approx(list(want.bucket_limit), rel=1e-4, abs=1e-7), (tag, step)


@interpreted
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_models_log_the_same_on_both_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launches: Counter[str], name: str
) -> None:
    """Each of ``tests/test_zoo.py``'s architectures (tuple and dict outputs, PackedSequence,
    a ModelOutput with a cache, detection, attention), every scalar, histogram, tensor and image
    of its run, on both paths (``both_paths``)."""
    runs = {}
    for path in ("torch", "triton"):
        monkeypatch.setenv(VARIABLE, path)
        both_paths.on_its_own_stack(train_zoo_model, ZOO[name], tmp_path / path)
        runs[path] = both_paths.golden.read(tmp_path / path)
    assert launches["_partials"] > 0
    assert both_paths.differences(runs["torch"], runs["triton"]) == []


def _toy_statistics(calls: Counter[str]) -> tuple[Measure, Measure]:
    """Two statistics of an output, each declared once (``docs/architecture.md``, adding a
    statistic): the RMS from the L2 norm, a value the kernels give (``fused=True``: on their
    path they give it, its ``compute`` is torch's), and the mean |x|, which they do not (its
    ``compute`` on both paths); ``calls`` counts each ``compute``'s calls."""

    def norm(x: Tensor, units: int, given: object) -> dict[str, Tensor]:
        calls["toy rms"] += 1
        return {"norm": reductions.norm(x)}

    def absolute_sum(x: Tensor, units: int, given: object) -> dict[str, Tensor]:
        calls["toy mean |x|"] += 1
        return {"absolute_sum": x.abs().sum(dtype=torch.float64)}

    rms = Measure(
        name="toy rms",
        fields=(Field(name="norm", pool=NORM),),
        stats=("toy_rms",),
        scalars=lambda v, n: {"toy_rms": float(v["norm"][0]) / math.sqrt(n)},
        compute=norm,
        needs_numel=True,
        fused=True,
    )
    mean_abs = Measure(
        name="toy mean |x|",
        fields=(Field(name="absolute_sum", pool=SUM),),
        stats=("toy_mean_abs",),
        scalars=lambda v, n: {"toy_mean_abs": float(v["absolute_sum"][0]) / n},
        compute=absolute_sum,
        needs_numel=True,
    )
    return rms, mean_abs


@interpreted
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_a_statistic_declared_once_is_written_on_both_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, launches: Counter[str], path: str
) -> None:
    """A statistic with a field the kernels give and one without, each declared once, are both
    written, as plain torch computes them of the outputs, on the torch path and on the kernels'
    (where the kernels give the first one's field: its ``compute`` is not called); declaring
    ``fused=True`` a field the kernels do not give is refused where it is declared."""
    monkeypatch.setenv(VARIABLE, path)
    calls: Counter[str] = Counter()
    rms, mean_abs = _toy_statistics(calls)
    model = mlp(6, 16, 3, seed=0)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(9))
    seen: dict[str, Tensor] = {}
    for name in ("0", "2"):
        model.get_submodule(name).register_forward_hook(lambda m, a, out, name=name: seen.update({name: out.detach()}))
    with HookLogger(model, log_dir=tmp_path, every=1, histograms=False, measures={"output": [rms, mean_abs]}) as hooks:
        train(hooks, [model(x).square().mean()])
    run = read_run(tmp_path)
    for name, out in seen.items():
        d = out.double()
        assert run.scalar(f"activation/toy_rms/{name}", 0) == pytest.approx(d.square().mean().sqrt().item(), rel=1e-6)
        assert run.scalar(f"activation/toy_mean_abs/{name}", 0) == pytest.approx(d.abs().mean().item(), rel=1e-6)
    assert (launches["_partials"] > 0) == (path == "triton")
    assert calls == {"toy mean |x|": 2, **({"toy rms": 2} if path == "torch" else {})}
    with pytest.raises(HookLoggerError, match=r"toy mean \|x\| is declared fused=True.*\['absolute_sum'\].*they give"):
        dataclasses.replace(mean_abs, fused=True)
