"""Low-precision health of a tensor (``numerics=``): its max |x|, RMS and kurtosis, and per
format what a cast to it loses, counted on the device.

Each format's constants come from ``torch.finfo``. fp16 and bf16 are judged unscaled, as a cast
of the tensor; e4m3 and e5m2 after per-tensor scaling by ``max_F / amax`` (torchao's and
Transformer Engine's recipe, margin 0). What a cast does to an element is decided by comparing
``|x|`` (or ``|x| * scale``) with the format's rounding boundaries, which round-to-nearest-even
fixes exactly: an element becomes 0 where ``|x| <= min_subnormal / 2`` (the tie goes to the even
0), subnormal where ``|x| < tiny - min_subnormal / 2``, and non-finite past the midpoint between
``max_F`` and the next step up. A boundary's count is two ops, a comparison written as 0.0 / 1.0
into one float buffer the tensor's boundaries share and its sum (:class:`Below`), and needs no
float8 kernel (the CPU has none to count with); ``tests/test_numerics.py`` checks the counts
against ``x.to(dtype)`` and counting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..keywords import is_off
from . import reductions, sampling
from .formats import DEFAULT, FORWARD, SPECS, Spec
from .reductions import acc_dtype
from .tags import Axis, Lost, Stat, per_format

#: What a format's device counts count, in order: the elements a cast makes 0 (``zero``), keeps
#: finite (``finite``) and, of a format cast unscaled, makes subnormal or 0 (``small``) or its
#: smallest subnormal or 0 (``least``); :attr:`Format.names` suffixes them with the format's name.
SCALED_COUNTS = ("zero", "finite")
UNSCALED_COUNTS = (*SCALED_COUNTS, "small", "least")
#: The smallest amax a per-tensor scale divides by (torchao's ``EPS``): an all-zero tensor keeps scale ``max_F / EPS``.
AMAX_FLOOR = 1e-12


@dataclass(frozen=True)
class Format:
    """A low-precision format (its constants: ``stats/formats.py``), and how a tensor is cast to
    it: the bounds a cast rounds at, worked out once when it is made. Plain attributes, which
    hooks that ``torch.compile`` traces read as constants (a ``functools.cached_property`` first
    read there takes a lock on Python 3.11, which breaks the graph)."""

    spec: Spec
    #: Magnitudes up to this become 0 in the cast: half the smallest subnormal (the tie goes to the even 0).
    flushed: float = field(init=False)
    #: Magnitudes above :attr:`flushed` and below this become the smallest subnormal: the tie at
    #: 1.5 of it goes to the even 2.
    least: float = field(init=False)
    #: Magnitudes from this on are normal after the cast (below it, subnormal or 0): the tie
    #: between the largest subnormal (odd) and ``tiny`` (even) goes to ``tiny``.
    normal: float = field(init=False)
    #: Magnitudes that stay finite in the cast: up to halfway from ``max`` to the next
    #: representable step, and whether that tie itself stays (``max``'s last mantissa bit is
    #: even: e4m3fn's 448) or rounds up to inf/NaN (odd: fp16, bf16, e5m2).
    finite: tuple[float, bool] = field(init=False)
    #: Its device counts (see :func:`measure`): :data:`SCALED_COUNTS` or :data:`UNSCALED_COUNTS`, suffixed by its name.
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        spec = self.spec
        flushed = spec.tiny * 2.0**-spec.mantissa_bits / 2
        step = 2.0 ** (math.floor(math.log2(spec.max)) - spec.mantissa_bits)
        counts = SCALED_COUNTS if spec.scaled else UNSCALED_COUNTS
        derived = {
            "flushed": flushed,
            "least": 3 * flushed,
            "normal": spec.tiny - flushed,
            "finite": (spec.max + step / 2, round(spec.max / step) % 2 == 0),
            "names": tuple(f"{count}_{spec.name}" for count in counts),
        }
        for key, value in derived.items():
            object.__setattr__(self, key, value)  # (a frozen dataclass's own fields, set once)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.spec.dtype)  # type: ignore[no-any-return]

    @property
    def scaled(self) -> bool:
        """Cast after per-tensor scaling by ``max / amax`` (the float8 formats), else as it is."""
        return self.spec.scaled

    @property
    def max(self) -> float:
        return self.spec.max

    @property
    def tiny(self) -> float:
        """The smallest normal magnitude."""
        return self.spec.tiny


#: The formats ``numerics=`` names, in the order the picture shows them.
FORMATS: dict[str, Format] = {name: Format(spec) for name, spec in SPECS.items()}
#: An autocast dtype's format.
OF_DTYPE = {f.dtype: f.name for f in FORMATS.values()}


#: The device value holding every format's counts side by side, one vector (one value of a
#: record rather than a dozen), in the order of :data:`COUNTED`.
COUNTS = "format_counts"
#: The counts of :data:`COUNTS`, in order: each format's :attr:`Format.names`, the formats in
#: :data:`FORMATS` order (the unscaled ones first, as the fused kernels count them).
COUNTED: tuple[str, ...] = tuple(n for fmt in FORMATS.values() for n in fmt.names)
#: Where each count is in :data:`COUNTS`.
AT = {name: i for i, name in enumerate(COUNTED)}


def measure(x: Tensor, units: int, *, channels: bool, given: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The device values of ``x``: ``amax``; ``ref`` (``max(amax, 1e-12)``) with ``sum2`` and
    ``sum4``, the sums of ``(x / ref)²`` and ``(x / ref)⁴`` (in float32, or float64 for float64
    tensors: relative to the amax they neither overflow nor lose the largest terms);
    ``nonzero``; and :data:`COUNTS`, per format the count of elements the cast makes 0
    (``zero_F``), keeps finite (``finite_F``) and, unscaled, makes subnormal or 0 (``small_F``) or
    its smallest subnormal or 0 (``least_F``), side by side (:data:`COUNTED`). With ``channels``,
    also per unit (along dim ``units``) the amax; ``unit_amax`` is empty for a 0-d or 1-d ``x``.

    ``given``: what the base statistics of ``x`` computed already (:data:`SHARED`), taken rather
    than computed again: ``nonzero`` (not returned then) and the extremes ``min`` and ``max`` (the
    amax, without per-unit ones, is the larger magnitude of the two)."""
    given = given or {}
    wide = acc_dtype(x.dtype)
    a = absolute(x)
    out: dict[str, Tensor] = {}
    if channels:  # (from the per-unit peaks it would take a per-unit minimum and two ops more)
        out["unit_amax"] = reductions.per_unit(a, units, torch.amax)
    if channels and x.dim() >= 2:
        out["amax"] = out["unit_amax"].amax()
    elif "max" in given:
        out["amax"] = torch.maximum(given["max"], given["min"].neg()).to(wide)
    else:
        out["amax"] = a.amax()
    out["ref"] = out["amax"].clamp(min=AMAX_FLOOR)
    scale = out["ref"].reciprocal()  # (also the float8 formats' per-tensor scale, over max_F)
    square = a * scale
    square.square_()
    out["sum2"], out["sum4"] = square.sum(), square.square_().sum()
    own = "nonzero" not in given
    below = Below(a, own + sum(len(fmt.names) for fmt in FORMATS.values()))
    if own:
        below.nonzero("nonzero", a)
    for fmt in FORMATS.values():
        if fmt.scaled:  # (into the powers' buffer, free again; dynamo writes into a contiguous one only)
            square = torch.mul(a, scale * fmt.max, out=square) if square.is_contiguous() else a * (scale * fmt.max)
        below.counts(square if fmt.scaled else a, fmt)
    out.update(below.totals(first=int(own)))
    return out


#: The base statistics' device values :func:`measure` takes where its kind computes them.
SHARED = ("nonzero", "min", "max")


def absolute(x: Tensor) -> Tensor:
    """``|x|`` in the accumulation dtype (float32, or float64 for float64 tensors): one op, or
    two for a 16-bit ``x``."""
    wide = acc_dtype(x.dtype)
    return x.abs() if x.dtype == wide else x.to(wide).abs_()


#: Up to this many elements, a float32 sum of ones is exact (every partial sum an integer it holds).
_EXACT_FLOAT32_COUNT = 1 << 24
#: The most elements :class:`Below` writes every count's comparison into side by side (1 MB: a
#: larger buffer leaves the CPU's cache, and summing each comparison while it is there is faster).
_SIDE_BY_SIDE = 1 << 18


class Below:
    """Exact counts of the magnitudes of one tensor at or below bounds: each a comparison written
    as 0.0 / 1.0 into a float32 buffer, summed (in float32 up to 2**24 elements, else float64). On a
    CPU a comparison into float32 takes a fifth of the time of ``count_nonzero(a <= bound)``,
    whose bool tensor and branching count are slow. Up to :data:`_SIDE_BY_SIDE` elements in all
    the ``bounds`` comparisons go side by side and one op sums them (the ops, not the passes, are
    a small tensor's cost); a larger tensor's share one buffer, each summed as it is written."""

    def __init__(self, like: Tensor, bounds: int) -> None:
        self._together = like.numel() * bounds <= _SIDE_BY_SIDE
        shape = (bounds if self._together else 1, *like.shape)
        self._ones = torch.empty(shape, dtype=torch.float32, device=like.device)
        self._rows = self._ones.unbind() if self._together else (self._ones[0],)
        self._sum = torch.float32 if like.numel() <= _EXACT_FLOAT32_COUNT else torch.float64
        self._names: list[str] = []
        self._counted: dict[str, Tensor] = {}

    def at_most(self, name: str, seen: Tensor, bound: float, *, tie: bool = True) -> None:
        """Count ``seen <= bound`` (``tie=False``: ``< bound``) as ``name``; NaN is none."""
        self._into(name, (torch.le if tie else torch.lt)(seen, bound, out=self._row()))

    def nonzero(self, name: str, seen: Tensor) -> None:
        """Count the elements of ``seen`` that are not 0 (NaN is), as ``torch.count_nonzero``."""
        self._into(name, torch.ne(seen, 0, out=self._row()))

    def counts(self, seen: Tensor, fmt: Format, axis: str | None = None) -> None:
        """:func:`measure`'s counts of one format, of the magnitudes ``seen`` as they are cast
        (``axis``: of one of :func:`fp8_cast`'s casts, :func:`cast_counts`)."""
        bound, tie_stays = fmt.finite  # finite after the cast (NaN fails every comparison)
        zero, finite, *small = fmt.names if axis is None else cast_counts(axis)
        self.at_most(zero, seen, fmt.flushed)
        self.at_most(finite, seen, bound, tie=tie_stays)
        if small:
            self.at_most(small[0], seen, fmt.normal, tie=False)
            self.at_most(small[1], seen, fmt.least, tie=False)

    def totals(self, first: int | None = None) -> dict[str, Tensor]:
        """Every count, by name (0-d); with ``first``, the counts from the ``first``-th on as one
        vector, :data:`COUNTS`, and those before it by name (each a vector of one where the
        counts were summed together: one op splits them)."""
        if not self._together:
            if first is None:
                return self._counted
            counted = [self._counted[n] for n in self._names]
            return {**dict(zip(self._names[:first], counted[:first])), COUNTS: torch.stack(counted[first:])}
        summed = self._ones.view(len(self._rows), -1).sum(dim=1, dtype=self._sum)
        if first is None:
            return dict(zip(self._names, summed.unbind()))
        if not first:
            return {COUNTS: summed}
        *heads, rest = summed.split([1] * first + [len(self._names) - first])
        return {**dict(zip(self._names, heads)), COUNTS: rest}

    def _row(self) -> Tensor:
        return self._rows[len(self._names)] if self._together else self._rows[0]

    def _into(self, name: str, ones: Tensor) -> None:
        if not self._together:
            self._counted[name] = ones.sum(dtype=self._sum)
        self._names.append(name)


#: The e4m3 casts of one tensor (:func:`fp8_cast`): by the axis that suffixes its counts and
#: statistics (``None``: none), the dim of its 2-d view that its scales are taken along (``None``: one per tensor).
Casts = Mapping[Axis | None, int | None]


#: How fp8 training scales a Linear's input and weight for their e4m3 cast, by the name of torchao's
#: recipe (``fp8_scaling=``): one cast (``None``: its counts and statistics unsuffixed), scaled per
#: tensor (``None``) or per row (the dim of :func:`fp8_cast`'s 2-d view whose amax gives each scale).
SCALINGS: dict[str, Casts] = {"tensorwise": {None: None}, "rowwise": {None: -1}}
#: How torchao's ``"rowwise"`` recipe casts a Linear's output gradient (``float8_linear.py``,
#: ``matmul_with_hp_or_float8_args.backward``): to e4m3 twice, its 2-d view scaled per row (dim -1)
#: for grad_input and per column (dim 0, over every token) for grad_weight.
GRADIENT_CASTS: Casts = {Axis.ROWS: -1, Axis.COLUMNS: 0}


def fp8_cast(x: Tensor, casts: Casts) -> dict[str, Tensor]:
    """The device values of a Linear's input, weight or output gradient as fp8 training casts it to
    e4m3, once per entry of ``casts`` (:data:`SCALINGS`, :data:`GRADIENT_CASTS`): of its 2-d view
    ``x.reshape(-1, features)`` (torchao's ``grad_output_reshaped``; of an input, the per-token
    amax is that of ``x``'s last dim), scaled per tensor by ``max_F / amax`` or along a dim
    (:func:`axis_scales`). ``nonzero``, and per cast the ``zero_e4m3`` and ``finite_e4m3`` counts
    of :func:`measure` (:func:`cast_counts`)."""
    fmt = FORMATS[FORWARD]
    a = absolute(x).reshape(-1, x.shape[-1])
    below = Below(a, 1 + 2 * len(casts))
    below.nonzero("nonzero", a)
    scaled = a if len(casts) == 1 else torch.empty_like(a)  # (one cast scales |x| in place)
    for axis, dim in casts.items():
        scale = a.amax().clamp(min=AMAX_FLOOR).reciprocal() * fmt.max if dim is None else axis_scales(a, fmt, dim)
        below.counts(torch.mul(a, scale, out=scaled), fmt, axis)
    return below.totals()


def axis_scales(a: Tensor, fmt: Format, dim: int) -> Tensor:
    """torchao's axiswise scales of the magnitudes ``a`` along ``dim``: per slice (one amax along
    ``dim``: along the last, an input's per token, a weight's per output feature; along dim 0 of an
    output gradient's 2-d view, per output feature over every token) ``max_F / max(amax, 1e-12)``,
    taken in float64 and then float32 and rounded down to a power of two, as ``amax_to_scale`` with
    ``round_scales_to_power_of_2=True``; multiplying by a power of two rounds nothing."""
    amax = a.amax(dim=dim, keepdim=True).double().clamp_(min=AMAX_FLOOR)
    return (fmt.max / amax).float().log2_().floor_().exp2_().to(a.dtype)


def cast_counts(axis: str | None) -> tuple[str, str]:
    """The device counts of one e4m3 cast of :func:`fp8_cast`: made zero, kept finite."""
    return per_format("zero", FORWARD, axis), per_format("finite", FORWARD, axis)


def fp8_statistics(v: Values, count: int, axes: Sequence[str | None]) -> dict[str, float]:
    """The e4m3 underflow and overflow fractions of each cast (``axes``: :func:`fp8_cast`'s) of a
    Linear's pooled input, weight or output gradient values."""
    n = float(count)
    zeros = n - float(v["nonzero"][0])
    out = {}
    for axis in axes:
        made_zero, finite = cast_counts(axis)
        out[per_format(Lost.UNDERFLOW, FORWARD, axis)] = (float(v[made_zero][0]) - zeros) / n
        out[per_format(Lost.OVERFLOW, FORWARD, axis)] = (n - float(v[finite][0])) / n
    return out


def median_abs(x: Tensor, indices: sampling.IndexCache) -> dict[str, Tensor]:
    """The median of ``|x|`` (``median``, :func:`median`): a selection, which no fused kernel
    computes (``kernels/fused.py``), so a measure of its own."""
    return {"median": median(x, indices)}


def median(x: Tensor, indices: sampling.IndexCache) -> Tensor:
    """The median of ``|x|`` (the lower of the two middle values, as ``torch.median``): of every
    element up to ``sampling.SAMPLE_CAP`` of them, else of the histograms' jittered sample of that
    many (``sampling.sample``, taken before the magnitudes), so its cost is bounded whatever the
    tensor's size. ``indices``: the logger's sample indices (the histograms' too)."""
    if x.numel() > sampling.SAMPLE_CAP:
        x = sampling.traced_sample(x) if torch.compiler.is_compiling() else sampling.sample(x, indices)
    return absolute(x).median()


Values = Mapping[str, np.ndarray]


def pool_powers(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``[ref, Σ(x/ref)², Σ(x/ref)⁴]`` of the records holding the same, each relative to its own
    ``ref``: the largest ``ref`` and the sums rescaled to it."""
    refs = values[:, 0]
    top = refs.max()
    ratio = refs / top if top > 0 else np.ones_like(refs)
    return np.array([top, (values[:, 1] * ratio**2).sum(), (values[:, 2] * ratio**4).sum()])


def absolute_powers(powers: Tensor) -> Tensor:
    """``[ref, Σ(x/ref)², Σ(x/ref)⁴]`` (float64) as ``[1, Σx², Σx⁴]``, which add up over records
    whatever their ``ref``: float64 holds the fourth power of every float32, bf16 and fp16
    magnitude (a compiled probe sums a module's calls so, ``capture/probes.py``)."""
    ref = powers[:1]
    return torch.cat([torch.ones_like(ref), powers[1:2] * ref.square(), powers[2:] * ref.square().square()])


def relative_to_one(powers: Tensor) -> Tensor:
    """Summed :func:`absolute_powers` as powers: relative to a ``ref`` of 1 (the sum's first value
    counts the records)."""
    return torch.cat([torch.ones_like(powers[:1]), powers[1:]])


def sizes(v: Values, count: int) -> dict[str, float]:
    """The max |x| and RMS of a module's pooled values over ``count`` elements (they scale with
    the loss under a ``GradScaler``); the max left out where NaN (a compiled probe's of a module
    that ran more than once in a backward: a maximum does not add up, ``kinds.Pool.summed``)."""
    ref, sum2, _ = (float(p) for p in v["powers"])
    amax = float(v["amax"][0])
    return {**({} if math.isnan(amax) else {Stat.AMAX: amax}), Stat.RMS: ref * math.sqrt(sum2 / count)}


#: Per format, where its counts are in :data:`COUNTS` and the statistics made of them.
_PER_FORMAT = {
    fmt.name: (
        tuple(AT[n] for n in fmt.names),
        tuple(per_format(lost, fmt.name) for lost in (Lost.UNDERFLOW, Lost.OVERFLOW, Lost.SUBNORMAL, Lost.FLOOR)),
    )
    for fmt in FORMATS.values()
}


def statistics(v: Values, count: int, *, zero_frac: bool) -> dict[str, float]:
    """The other scalars of a module's pooled values over ``count`` elements (those that do not
    scale with the loss), every format's: the caller keeps those it writes (:func:`written`)."""
    n = float(count)
    _, sum2, sum4 = (float(p) for p in v["powers"])
    zeros = n - float(v["nonzero"][0])
    out: dict[str, float] = {}
    if sum2 > 0:  # non-centred, as torchtitan's: (E[x⁴] / E[x²]²) - 3 (ref cancels)
        out[Stat.KURTOSIS] = (sum4 / n) / (sum2 / n) ** 2 - 3
    if zero_frac:
        out[Stat.ZERO_FRAC] = zeros / n
    if "median" in v:
        out[Stat.MEDIAN_ABS] = float(v["median"][0])
        peaks = v["unit_amax"]
        if peaks.size and np.isfinite(peaks).any():
            out[Stat.AMAX_CHANNEL] = float(np.nanargmax(peaks))
    counted = v[COUNTS].tolist()
    for fmt in FORMATS.values():
        counts, (underflow, overflow, subnormal, floor) = _PER_FORMAT[fmt.name]
        made_zero = counted[counts[0]]
        out[underflow] = (made_zero - zeros) / n
        out[overflow] = (n - counted[counts[1]]) / n
        if not fmt.scaled:
            out[subnormal] = (counted[counts[2]] - made_zero) / n
            out[floor] = (counted[counts[3]] - made_zero) / n
    return out


#: Every per-format statistic of a tensor as a whole (``{lost}_{format}``), with its format: those
#: :func:`statistics` gives (a scaled format's subnormal and floor fractions are none), which
#: include the unsuffixed ones of :func:`fp8_statistics`. The recipe hands the formats on by the
#: measures that give these (``Recipe.formats``), never by a statistic's name alone.
FORMAT_OF: dict[str, str] = {
    per_format(lost, fmt.name): fmt.name
    for fmt in FORMATS.values()
    for lost in (Lost.UNDERFLOW, Lost.OVERFLOW, *([] if fmt.scaled else [Lost.SUBNORMAL, Lost.FLOOR]))
}


def stats(*, zero_frac: bool, channels: bool) -> tuple[str, ...]:
    """Every statistic :func:`statistics` may give."""
    base = (Stat.AMAX, Stat.RMS, Stat.KURTOSIS)
    extra = (Stat.ZERO_FRAC,) * zero_frac + (Stat.MEDIAN_ABS, Stat.AMAX_CHANNEL) * channels
    return (*base, *extra, *FORMAT_OF)


def check(numerics: object) -> tuple[str, ...] | None:
    """``numerics=`` as the formats it names (``()``: the run's own, see :class:`Written`), or
    ``None`` when off; raises ``ValueError`` saying what is valid."""
    valid = ", ".join(map(repr, FORMATS))
    if is_off(numerics):
        return None
    if numerics is True:
        return ()
    if isinstance(numerics, (list, tuple)) and numerics and all(isinstance(f, str) for f in numerics):
        unknown = [f for f in numerics if f not in FORMATS]
        if not unknown and len(set(numerics)) == len(numerics):
            return tuple(numerics)
        problem = f"unknown format(s) {unknown}" if unknown else "a format named twice"
        raise ValueError(f"numerics={numerics!r} has {problem}; the formats are {valid}")
    hint = f" (a tuple: numerics=({numerics!r},))" if isinstance(numerics, str) else ""
    raise ValueError(
        f"numerics must be True (the format the run trains in), False, or a non-empty tuple of format names "
        f"among {valid}{hint}, got {numerics!r}"
    )


class Written:
    """Which formats' scalar tags a logger writes: those ``numerics=`` names, or with
    ``numerics=True`` the one the run trains in: the autocast dtype its logged forward passes
    ran under (when fp16 or bf16), else bf16. With a float8 format named, each Linear's input and
    weight are judged as fp8 training casts them (:func:`fp8_cast`)."""

    def __init__(self, named: Sequence[str]) -> None:
        self._named = tuple(named)
        self._seen: str | None = None

    def see(self, device_type: str) -> None:
        """A logged forward pass on ``device_type`` (host-side only: autocast state, no tensor)."""
        if self._named or self._seen is not None or not torch.amp.is_autocast_available(device_type):
            return  # (a device type without autocast, "meta", would raise below)
        if torch.is_autocast_enabled(device_type):
            self._seen = OF_DTYPE.get(torch.get_autocast_dtype(device_type))

    @property
    def formats(self) -> tuple[str, ...]:
        return self._named or (self._seen or DEFAULT,)

    @property
    def fp8(self) -> bool:
        """Whether a float8 format is named: then each Linear's casts are recorded."""
        return any(FORMATS[f].scaled for f in self._named)

    def written(self, scalars: dict[str, float], formats: Mapping[str, str], casts: frozenset[str]) -> dict[str, float]:
        """Take every per-format scalar (``formats``: their format, by tag) of formats not
        written out of ``scalars``, but for those of ``casts`` (what fp8 training casts, in the
        format it casts to) with a float8 format named: a recipe that casts the inputs to e4m3
        and the gradients to e5m2 is judged whichever of the two is named. Returns all
        per-format scalars (for the picture)."""
        every: dict[str, float] = {}
        kept = self.formats
        for key, fmt in formats.items():
            if key in scalars:
                every[key] = scalars[key]
                if fmt not in kept and not (self.fp8 and key in casts):
                    del scalars[key]
        return every
