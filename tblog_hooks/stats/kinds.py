"""What a logged step records, declared once, as torchmetrics' ``add_state`` couples a state with
its reduction.

A :class:`Kind` of record (an activation, an output gradient, a parameter's gradient, ...) is the
:class:`Measure` objects declared on it. A measure says everything about one statistic (or a few
computed together): its device function, returning named tensors; its :class:`Field` objects and
how each pools over the records of one module (several calls, micro-batches, ranks: sum, min, max,
norm, moments up to the fourth); the scalars it yields and their :class:`~tblog_hooks.stats.tags.Stat`
names; whether they scale with the loss under a ``GradScaler``; whether they need the record's
element count. Every measure's device function is called one way, ``compute(t, units, given)``.
Kinds and measures are immutable; which kinds a logger records, with which measures, is its
:class:`~tblog_hooks.stats.recipe.Recipe`.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch
from torch import Tensor

from ..errors import HookLoggerError
from ..kernels import outputs as kernel_outputs
from ..kernels.outputs import Fused
from ..keywords import keywords
from . import numerics, reductions
from .formats import FORWARD
from .sampling import IndexCache
from .tags import HISTOGRAM_KINDS as HISTOGRAM_KINDS  # (its home is tags.py: the dashboard reads it without torch)
from .tags import Lost, Stat, per_format

Values = dict[str, np.ndarray]
#: A record's device values, by name, as a measure's device function returns them.
Named = Mapping[str, Tensor]
#: Every measure's device values of a tensor, by name: where the fused kernels gave some, those
#: lie in their one buffer (``kernels.outputs.Fused``).
Computed = dict[str, Tensor] | Fused
#: A measure's device function: ``(t, units, given) -> {name: value}`` (:attr:`Measure.compute`).
Compute = Callable[[Tensor, int, Named], Named]
#: What a measure that uses nothing is given.
_NOTHING: Named = MappingProxyType({})


@dataclass(frozen=True)
class Pool:
    """How the values of a field pool over records, on the host; and, where they can, how they
    add up on the device (a compiled module's probe sums the gradient summaries of its calls)."""

    #: (values per record, elements per record) -> pooled.
    combine: Callable[[np.ndarray, np.ndarray], np.ndarray]
    #: A field's device values (its parts, as one float64 vector) into a form whose sum over
    #: records is that of the pooled records, and back (``None``: not summable, as a maximum is
    #: not; the probe keeps it of a single call only).
    summed: tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]] | None = None


def _moments(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``[mean, centred norm(, M3, M4)]`` of the concatenation of records holding the same: the
    pairwise update of Chan et al. for the second central moment and of Pébay (2008) for the third
    and fourth (``M_p`` the sum of ``(x - mean)^p``)."""
    n, mean = counts[0], values[0][0]
    m = [0.0, 0.0, values[0][1] ** 2, *values[0][2:]]  # m[p]: M_p
    order = len(m) - 1
    for count, row in zip(counts[1:], values[1:]):
        b = [0.0, 0.0, row[1] ** 2, *row[2:]]
        total = n + count
        delta = row[0] - mean
        if order >= 4:
            m[4] = (
                m[4] + b[4]
                + delta**4 * n * count * (n * n - n * count + count * count) / total**3
                + 6 * delta**2 * (n * n * b[2] + count * count * m[2]) / total**2
                + 4 * delta * (n * b[3] - count * m[3]) / total
            )  # fmt: skip
        if order >= 3:
            m[3] = (
                m[3] + b[3]
                + delta**3 * n * count * (n - count) / total**2
                + 3 * delta * (n * b[2] - count * m[2]) / total
            )  # fmt: skip
        m[2] = m[2] + b[2] + delta * delta * n * count / total
        mean = mean + delta * count / total
        n = total
    return np.array([mean, math.sqrt(m[2]), *m[3:]])


def _same(t: Tensor) -> Tensor:
    return t


SUM = Pool(lambda v, n: v.sum(axis=0), (_same, _same))
MIN = Pool(lambda v, n: v.min(axis=0))  # NaN propagates, as in torch.aminmax
MAX = Pool(lambda v, n: v.max(axis=0))
FIRST = Pool(lambda v, n: v[0])
#: L2 norms: the root of the summed squares of all records.
NORM = Pool(lambda v, n: np.sqrt(np.square(v).sum(axis=0)), (torch.square, torch.sqrt))
#: ``[mean, centred L2 norm]``, optionally followed by the third and fourth central sums.
MOMENTS = Pool(_moments)
#: ``[ref, Σ(x/ref)², Σ(x/ref)⁴]`` (``numerics.pool_powers``); summed on the device as
#: ``[1, Σx², Σx⁴]`` in float64 (``numerics.absolute_powers``).
POWERS = Pool(numerics.pool_powers, (numerics.absolute_powers, numerics.relative_to_one))


@dataclass(frozen=True, kw_only=True)
class Field:
    """One recorded value: 0-d, a vector of fixed length (``size``) or one value per channel, or
    several device values pooled together (``parts``, e.g. a mean and a centred norm)."""

    name: str
    pool: Pool
    #: The names of its device values, when it has several; else the field's own name.
    parts: tuple[str, ...] = ()
    #: One value per unit of the module (its pieces, where the units are split over ranks, go side by side).
    per_unit: bool = False
    #: Elements of each of its device values, where that is fixed (the per-format counts side by
    #: side; a compiled module's probe lays its record out by them): 1, a 0-d value or a vector of one.
    size: int = 1

    @property
    def names(self) -> tuple[str, ...]:
        return self.parts or (self.name,)


@keywords(counted="needs_numel")
@dataclass(frozen=True, kw_only=True)
class Measure:
    """One statistic, or a few computed together, declared once."""

    #: What error messages call it (default: its statistics).
    name: str = ""
    #: What it records, and how each field pools.
    fields: tuple[Field, ...]
    #: The statistics its scalars are tagged with (``{kind}/{stat}/{module}``).
    stats: tuple[str, ...] = ()
    #: (its pooled fields, elements in all records) -> ``{stat: value}``; the stat ``""`` tags a
    #: record by its own name (a whole tag, e.g. ``amp/loss_scale``).
    scalars: Callable[[Values, int], Mapping[str, float]]
    #: The record's device values of a tensor ``t``, by name (called under ``no_grad``):
    #: ``compute(t, units, given)``, ``units`` the dim that holds its units
    #: (``reductions.units_dim``), ``given`` the values of :attr:`uses` (empty without);
    #: ``None`` for values recorded by their own hooks.
    compute: Compute | None = None
    #: Device values of the measures before it in its kind that ``compute`` takes rather than
    #: computing them again (``given``, by name): the one computation of a tensor shared.
    uses: tuple[str, ...] = ()
    #: Its scalars of gradients scale with the loss under a ``GradScaler`` (norms, extremes: they
    #: are divided by the scale on the host); ``False`` for counts, fractions and ratios.
    scaled: bool = False
    #: Its scalars need the records' element count (a count of its fields only is not one).
    needs_numel: bool = False
    #: A whole-model scalar ``{kind}/{total}``: the L2 norm over every record's (one) field.
    total: str | None = None
    #: The fused kernels give its device values, by the names ``compute`` gives them
    #: (``kernels/fused.py``, where ``TBLOG_HOOKS_KERNELS`` sends the tensor): each must be one of
    #: ``kernels/outputs.py``'s ``OUTPUTS``, checked when the measure is declared. A measure
    #: without is computed by ``compute``, with torch, on both paths.
    fused: bool = False

    def __post_init__(self) -> None:
        if self.compute is not None and not _takes_given(self.compute):
            warnings.warn(
                f"{describe(self)}: a Measure's compute taking (t, units) is deprecated and will not be called so in "
                "the next release: take (t, units, given) (given: the values of uses=, empty without)",
                DeprecationWarning,
                stacklevel=4,  # (the declaration: past __init__ and keywords')
            )
            old: Callable[[Tensor, int], Named] = self.compute  # type: ignore[assignment]  # (checked above)
            object.__setattr__(self, "compute", _given_left_out(old))  # (a frozen field, set once)
        missing = [n for f in self.fields for n in f.names if n not in kernel_outputs.OUTPUTS] if self.fused else []
        if missing:
            raise HookLoggerError(
                f"{describe(self)} is declared fused=True, but the fused kernels do not give {missing}: they give "
                f"{', '.join(kernel_outputs.OUTPUTS)} (tblog_hooks/kernels/outputs.py). Declare it without fused=True "
                "(its compute then runs on every path), or add the value to the kernels"
            )


def _takes_given(compute: Callable[..., Named]) -> bool:
    """Whether ``compute`` takes three positional arguments (``(t, units, given)``)."""
    try:
        parameters = inspect.signature(compute).parameters.values()
    except (TypeError, ValueError):  # (a callable without a signature: taken as it is)
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    spread = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)
    return spread or sum(p.kind in positional for p in parameters) >= 3


def _given_left_out(compute: Callable[[Tensor, int], Named]) -> Compute:
    """A deprecated ``compute(t, units)`` called as every measure's is (not ``functools.wraps``:
    its signature, which :func:`_takes_given` reads, is the new one)."""

    def taking_given(t: Tensor, units: int, given: Named) -> Named:
        return compute(t, units)

    return taking_given


class Kind:
    """A kind of record: its measures, and how its records travel. Immutable, validated when made;
    compared and hashed by identity (a logger's :class:`~tblog_hooks.stats.recipe.Recipe` makes
    its own, looked up for every record of a step)."""

    __slots__ = (
        "_computed",
        "_unfused",
        "fields",
        "host_knows_numel",
        "measures",
        "name",
        "norms",
        "per_call",
        "stats",
    )

    def __init__(
        self,
        *,
        name: str,
        per_call: bool = False,
        norms: bool = False,
        host_knows_numel: bool = True,
        measures: tuple[Measure, ...] = (),
    ) -> None:
        #: The tag root of its scalars (``{name}/{stat}/{module}``) and histograms; kinds whose
        #: records are tagged by their own names have a name of their own.
        self.name = name
        #: Pooled over ranks with ``reduce_ranks=True`` (one record per call); otherwise the writing rank's own.
        self.per_call = per_call
        #: Every field is an L2 norm: those of a tensor's pieces on several ranks combine as the root
        #: of their summed squares.
        self.norms = norms
        #: The host knows its records' element count; else (an output gradient summed by a compiled
        #: probe) a record carries it on the device, as the field of :data:`ELEMENTS`, where its
        #: measures need it.
        self.host_knows_numel = host_knows_numel
        _check(self, measures)
        self.measures: tuple[Measure, ...] = measures
        self.fields: tuple[Field, ...] = tuple(f for m in measures for f in m.fields)
        self.stats: tuple[str, ...] = tuple(s for m in measures for s in m.stats)
        self._computed = tuple(m for m in measures if m.compute is not None)
        self._unfused = tuple(m for m in measures if m.compute is not None and not m.fused)

    def __setattr__(self, key: str, value: object) -> None:
        if hasattr(self, key):
            raise AttributeError(f"{self!r} is immutable: make a new one")
        object.__setattr__(self, key, value)

    def __repr__(self) -> str:
        return f"Kind({str(self.name)!r})"

    def compute(
        self, t: Tensor, units: int, *, unfused: bool = False, given: dict[str, Tensor] | Fused | None = None
    ) -> Computed:
        """Every measure's device values of ``t``, by name (call under ``no_grad``), after those
        ``given`` (the fused kernels' or another kind's of ``t``; not changed); with ``unfused``,
        those of the measures the fused kernels do not give (``Measure.fused``)."""
        out: Computed = {} if given is None else given.copy()
        for m in self._unfused if unfused else self._computed:
            assert m.compute is not None  # (the computed measures)
            out.update(m.compute(t, units, {n: out[n] for n in m.uses} if m.uses else _NOTHING))
        return out

    def numel(self, fields: Values, numel: int) -> int:
        """The elements a record (its fields, read back) describes: ``numel`` where the host knows
        it, else its :data:`ELEMENTS` field."""
        return numel if self.host_knows_numel or ELEMENTS_FIELD not in fields else int(fields[ELEMENTS_FIELD][0])

    def values(self, named: Named) -> tuple[Tensor, ...]:
        """A record's values in field order, from their names."""
        return tuple(named[n] for f in self.fields for n in f.names)

    def scalars(self, values: Values, count: int) -> dict[str, float]:
        """``{stat: value}`` of a module's pooled fields."""
        out: dict[str, float] = {}
        for m in self.measures:
            out.update(m.scalars(values, count))
        return out


def describe(measure: Measure) -> str:
    """A measure as an error message names it."""
    return measure.name or f"the measure of {list(measure.stats) or [f.name for f in measure.fields]}"


def _check(kind: Kind, measures: tuple[Measure, ...]) -> None:
    """No name (field, device value or statistic) given by two measures; measures that need the
    element count only where records know their element count (on the host, or by :data:`ELEMENTS` before them)."""
    owner: dict[str, tuple[int, Measure]] = {}
    values: set[str] = set()  # the device values of the measures so far
    for i, measure in enumerate(measures):
        if measure.needs_numel and not kind.host_knows_numel and ELEMENTS_FIELD not in values:
            raise HookLoggerError(
                f"{kind!r} records do not know their element count on the host, which {describe(measure)} needs "
                f"(needs_numel=True): put {describe(ELEMENTS)} before it"
            )
        missing = [n for n in measure.uses if n not in values]
        if missing:
            raise HookLoggerError(
                f"{kind!r}: {describe(measure)} uses {missing}, which no measure before it gives; "
                f"those before it give {sorted(values)}"
            )
        values.update(n for f in measure.fields for n in f.names)
        names = {n for f in measure.fields for n in (f.name, *f.names)} | set(measure.stats)
        for name in sorted(names):
            at, first = owner.setdefault(name, (i, measure))
            if at != i:
                raise HookLoggerError(
                    f"{kind!r}: {describe(measure)} and {describe(first)} both give {str(name)!r}; "
                    "each field and statistic of a kind has one measure"
                )


def _finite(value: float) -> dict[str, float]:
    """A scalar left out where undefined."""
    return {"": value} if math.isfinite(value) else {}


def _ratio(change: float, weight: float) -> dict[str, float]:
    """The update ratio where defined (not of an all-zero or non-finite weight)."""
    ratio = change / weight if weight > 0 else math.nan
    return {Stat.UPDATE_RATIO: ratio} if math.isfinite(ratio) else {}


def _std(norm: float, count: int) -> float:
    return norm / math.sqrt(count - 1) if count > 1 else 0.0  # unbiased, as torch.std


#: The mean and the (unbiased) standard deviation of a tensor; centring keeps the standard
#: deviation accurate when |mean| >> std.
MEAN_STD = Measure(
    name="mean and std",
    fields=(Field(name="moments", pool=MOMENTS, parts=("mean", "centred_norm")),),
    stats=(Stat.MEAN, Stat.STD),
    scalars=lambda v, n: {Stat.MEAN: float(v["moments"][0]), Stat.STD: _std(float(v["moments"][1]), n)},
    compute=lambda x, units, given: reductions.mean_and_centred_norm(x, units),
    scaled=True,
    needs_numel=True,
    fused=True,
)
#: The smallest and largest element (exact; also a histogram's range).
EXTREMES = Measure(
    name="extremes",
    fields=(Field(name="min", pool=MIN), Field(name="max", pool=MAX)),
    stats=(Stat.MIN, Stat.MAX),
    scalars=lambda v, n: {Stat.MIN: float(v["min"][0]), Stat.MAX: float(v["max"][0])},
    compute=lambda x, units, given: reductions.extremes(x, units),
    scaled=True,
    fused=True,
)
#: The fraction of elements exactly zero.
ZERO_FRAC = Measure(
    name="zero fraction",
    fields=(Field(name="nonzero", pool=SUM),),
    stats=(Stat.ZERO_FRAC,),
    scalars=lambda v, n: {Stat.ZERO_FRAC: float((n - v["nonzero"][0]) / n)},
    compute=lambda x, units, given: {"nonzero": torch.count_nonzero(x)},
    needs_numel=True,
    fused=True,
)
#: The NaN/Inf count, from the finite count (the host knows the elements: NaN/Inf are the rest).
NONFINITE = Measure(
    name="NaN/Inf count",
    fields=(Field(name="finite", pool=SUM),),
    stats=(Stat.NONFINITE,),
    scalars=lambda v, n: {Stat.NONFINITE: float(n - v["finite"][0])},
    compute=lambda x, units, given: {"finite": reductions.finite(x)},
    needs_numel=True,
    fused=True,
)


def _dead_fraction(v: Values, count: int) -> dict[str, float]:
    """A unit is dead if it is never positive across the pooled batch (outputs of 2+ dims)."""
    peaks = v["peak"]
    return {Stat.DEAD_FRAC: float(np.count_nonzero(peaks <= 0) / peaks.size)} if peaks.size else {}


#: Per unit, the largest value: the fraction of units never positive.
DEAD_FRAC = Measure(
    name="dead fraction",
    fields=(Field(name="peak", pool=MAX, per_unit=True),),
    stats=(Stat.DEAD_FRAC,),
    scalars=_dead_fraction,
    compute=lambda x, units, given: reductions.unit_peaks(x, units),
    fused=True,
)

#: The statistics of a module's output, and with ``inputs=True`` of its input.
TENSOR_MEASURES = (MEAN_STD, EXTREMES, ZERO_FRAC, NONFINITE, DEAD_FRAC)
#: The L2 norm of an output gradient (``gradient/norm``).
GRADIENT_NORM = Measure(
    name="gradient norm",
    fields=(Field(name="norm", pool=NORM),),
    stats=(Stat.NORM,),
    scalars=lambda v, n: {Stat.NORM: float(v["norm"][0])},
    compute=lambda g, units, given: {"norm": reductions.norm(g)},
    scaled=True,
    fused=True,
)
#: The element count of a record, on the device, for kinds whose host does not know it
#: (``Kind.host_knows_numel``): a compiled probe sums it over a module's calls with the other fields.
ELEMENTS_FIELD = "elements"
ELEMENTS = Measure(
    name="element count",
    fields=(Field(name=ELEMENTS_FIELD, pool=SUM),),
    scalars=lambda v, n: {},
    compute=lambda t, units, given: {ELEMENTS_FIELD: reductions.elements(t)},
)
#: The NaN/Inf count of an output gradient, recorded as it is (``gradient/nonfinite``; a
#: probe's records know their element count only where numerics need it, :data:`ELEMENTS`).
GRADIENT_NONFINITE = Measure(
    name="gradient NaN/Inf count",
    fields=(Field(name="nonfinite", pool=SUM),),
    stats=(Stat.NONFINITE,),
    scalars=lambda v, n: {Stat.NONFINITE: float(v["nonfinite"][0])},
    compute=lambda g, units, given: {"nonfinite": reductions.nonfinite(g)},
    fused=True,
)
#: A parameter's final gradient's norm (``param_grad/norm``) and the whole-model
#: ``param_grad/global_norm``; recorded by ``capture/parameters.py``.
PARAM_GRAD_NORM = Measure(
    name="parameter gradient norm",
    fields=(Field(name="norm", pool=FIRST),),
    stats=(Stat.NORM,),
    scalars=lambda v, n: {Stat.NORM: float(v["norm"][0])},
    scaled=True,
    total=Stat.GLOBAL_NORM,
)
#: The gradient norm of a parameter that no watched module owns: counted in
#: ``param_grad/global_norm`` only (the whole model's), with no tag of its own.
GLOBAL_NORM_TERM = Measure(
    name="unwatched parameter gradient norm",
    fields=(Field(name="norm", pool=FIRST),),
    scalars=lambda v, n: {},
    scaled=True,
    total=Stat.GLOBAL_NORM,
)
#: An optimizer step's change of a parameter, ``||W_after - W_before|| / ||W_before||``
#: (``param/update_ratio``; left out where the weight is all zeros); recorded by ``capture/parameters.py``.
UPDATE_RATIO = Measure(
    name="update ratio",
    fields=(Field(name="change", pool=FIRST), Field(name="weight", pool=FIRST)),
    stats=(Stat.UPDATE_RATIO,),
    scalars=lambda v, n: _ratio(float(v["change"][0]), float(v["weight"][0])),
)
#: A device value logged under its own tag (``amp/*``); the first record.
SCALAR_VALUE = Measure(
    name="scalar", fields=(Field(name="value", pool=FIRST),), scalars=lambda v, n: _finite(float(v["value"][0]))
)
#: A module's feature maps, an image in [0, 1] (``feature_map/{module}``); the first record of a step.
PIXELS = Measure(name="feature map", fields=(Field(name="pixels", pool=FIRST),), scalars=lambda v, n: {})


def _attention_scalars(v: Values, count: int) -> dict[str, float]:
    """A module's attention calls pooled over heads: the largest logit, the mean entropy per query."""
    queries = float(v["queries"].sum())
    out = {Stat.MAX_LOGIT: float(v["max_logit"].max())}
    if queries > 0:
        out[Stat.ENTROPY] = float(v["entropy"].sum()) / queries
    return out  # type: ignore[return-value]  # (Stat is a str)


#: The attention calls of a module (``attention/*``; ``stats/attention.py``), one value per head:
#: the largest logit, the summed entropy of its queries and their count. The heads of a
#: tensor-parallel attention, split over ranks, go side by side.
ATTENTION_HEADS = Measure(
    name="attention",
    fields=(
        Field(name="max_logit", pool=MAX, per_unit=True),
        Field(name="entropy", pool=SUM, per_unit=True),
        Field(name="queries", pool=SUM, per_unit=True),
    ),
    stats=(Stat.MAX_LOGIT, Stat.ENTROPY),
    scalars=_attention_scalars,
)
#: Every histogram of the step: rows ``[start, span, min, max, counts...]`` (``binning.bin_rows``).
HISTOGRAM_ROWS = Measure(name="histograms", fields=(Field(name="rows", pool=FIRST),), scalars=lambda v, n: {})


def _log_partition(v: Values, count: int) -> dict[str, float]:
    """Mean and max of ``log Z`` over the pooled tokens, and the mean of its square."""
    tokens = float(v["tokens"][0])
    if not tokens > 0:
        return {}
    return {
        Stat.LOG_Z: float(v["log_z"][0]) / tokens,
        Stat.LOG_Z_MAX: float(v["log_z_max"][0]),
        Stat.Z_LOSS: float(v["log_z_squares"][0]) / tokens,
    }


#: With ``logits=``, the log-partition ``log Σ exp(z)`` of a module's output logits per token, the
#: statistic z-loss regularises (``reductions.log_partition``): its mean over tokens
#: (``activation/log_z``), max (``log_z_max``) and mean square (``z_loss``, before a z-loss's weight).
LOG_PARTITION = Measure(
    name="log-partition",
    fields=(
        Field(name="log_z", pool=SUM),
        Field(name="log_z_squares", pool=SUM),
        Field(name="log_z_max", pool=MAX),
        Field(name="tokens", pool=SUM),
    ),
    stats=(Stat.LOG_Z, Stat.LOG_Z_MAX, Stat.Z_LOSS),
    scalars=_log_partition,
    compute=lambda z, units, given: reductions.log_partition(z, units),
)


def median_abs(indices: IndexCache) -> Measure:
    """The median |x| of an output with ``numerics=`` (its scalar is :func:`numeric_measures`'),
    of the sample ``indices`` take (the logger's)."""
    return Measure(
        name="numerics (median)",
        fields=(Field(name="median", pool=MAX),),
        scalars=lambda v, n: {},
        compute=lambda x, units, given: numerics.median_abs(x, indices),
    )


def numeric_measures(*, zero_frac: bool, channels: bool, base: tuple[Measure, ...] = ()) -> tuple[Measure, ...]:
    """With ``numerics=``, a tensor's low-precision health (``stats/numerics.py``), as measures
    of its kind after ``base`` (its source's own): the max |x| and RMS, which scale with the loss
    under a ``GradScaler``, and the kurtosis and per-format fractions, which do not (they are
    judged at the loss scale, as the format sees the gradients); with ``channels``, the per-unit
    peaks too (and the median |x|, :func:`median_abs`, which the recipe adds with the logger's
    sample indices). What ``base`` computes of the tensor (``numerics.SHARED``: the non-zero
    count, the extremes) they take rather than compute again."""
    magnitude = (Stat.AMAX, Stat.RMS)
    every = numerics.stats(zero_frac=zero_frac, channels=channels)
    given = {n for m in base for f in m.fields for n in f.names}
    uses = tuple(n for n in numerics.SHARED if n in given)
    own_field = (Field(name="nonzero", pool=SUM),) * ("nonzero" not in uses)
    per_unit = (Field(name="unit_amax", pool=MAX, per_unit=True),) * channels

    shape = Measure(
        name="numerics (counts)",
        fields=(*own_field, Field(name=numerics.COUNTS, pool=SUM, size=len(numerics.COUNTED)), *per_unit),
        stats=tuple(s for s in every if s not in magnitude),
        scalars=lambda v, n: numerics.statistics(v, n, zero_frac=zero_frac),
        compute=lambda x, units, given: numerics.measure(x, units, channels=channels, given=given),
        uses=uses,
        needs_numel=True,
        fused=True,
    )
    size = Measure(
        name="numerics (magnitudes)",
        fields=(Field(name="amax", pool=MAX), Field(name="powers", pool=POWERS, parts=("ref", "sum2", "sum4"))),
        stats=magnitude,
        scalars=numerics.sizes,
        scaled=True,
        needs_numel=True,
        fused=True,
    )
    return shape, size


def fp8_cast_measure(casts: numerics.Casts) -> Measure:
    """With a float8 format in ``numerics=``, what fp8 training casts to e4m3 of a watched
    ``nn.Linear`` (``numerics.fp8_cast``): its input or its weight, scaled per tensor by
    ``max_F / amax`` or per row as torchao's ``"rowwise"`` recipe (``numerics.SCALINGS``:
    ``input/underflow_e4m3/{module}``, ``param/underflow_e4m3/{module}.weight``); or, under that
    recipe, its output gradient scaled per row and per column (``numerics.GRADIENT_CASTS``:
    ``gradient/underflow_e4m3_rows/{module}``, ``gradient/underflow_e4m3_columns/{module}``)."""
    counts = ("nonzero", *(c for axis in casts for c in numerics.cast_counts(axis)))
    return Measure(
        name="numerics (fp8 casts)",
        fields=tuple(Field(name=c, pool=SUM) for c in counts),
        stats=tuple(per_format(lost, FORWARD, axis) for axis in casts for lost in (Lost.UNDERFLOW, Lost.OVERFLOW)),
        scalars=lambda v, n: numerics.fp8_statistics(v, n, tuple(casts)),
        compute=lambda x, units, given: numerics.fp8_cast(x, casts),
        needs_numel=True,
    )
