"""What one logger records, decided once at its construction: for each source of tensors (a
watched module's output and input, its output gradient, a parameter's gradient, an optimizer
step's update, and the values recorded under their own tags) the :class:`~tblog_hooks.stats.kinds.Kind`
whose measures say what is computed, how it pools, which scalars it yields and which of them
scale with the loss.

A :class:`Recipe` is immutable and belongs to one logger: recording (``capture/*``), the compiled
probes' layout, packing and pooling over calls and ranks, unscaling, summarising and the docs'
tag table read it; nothing reads a module-level registry, so extending one logger's recipe
(``HookLogger(..., measures={"output": [measure]})``) never touches another's. It carries the
one thing its measures keep between steps, the logger's sample indices (made once per size).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import HookLoggerError
from .formats import BACKWARD
from .kinds import (
    ATTENTION_HEADS,
    ELEMENTS,
    GLOBAL_NORM_TERM,
    GRADIENT_NONFINITE,
    GRADIENT_NORM,
    HISTOGRAM_ROWS,
    LOG_PARTITION,
    NONFINITE,
    PARAM_GRAD_NORM,
    PIXELS,
    SCALAR_VALUE,
    TENSOR_MEASURES,
    UPDATE_RATIO,
    Kind,
    Measure,
    describe,
    fp8_cast_measure,
    median_abs,
    numeric_measures,
)
from .numerics import FORMAT_OF, GRADIENT_CASTS, SCALINGS
from .sampling import IndexCache
from .tags import Lost, Root, per_format


class Source(enum.StrEnum):
    """Where a kind's records come from."""

    #: A watched module's output (``activation/*``).
    OUTPUT = "output"
    #: With ``inputs=True``, a watched module's input (``input/*``).
    INPUT = "input"
    #: Without ``inputs=True``, the NaN/Inf count of a watched module's inputs alone
    #: (``input/nonfinite/{module}``), recorded as their finite count (``reductions.finite``).
    NONFINITE_INPUT = "nonfinite_input"
    #: The gradient w.r.t. a watched module's output (``gradient/*``). Under ``torch.compile``
    #: its records are summed on the device by the module's probe, which knows the element count
    #: only on the device: where its measures need it, the records carry it (``kinds.ELEMENTS``).
    OUTPUT_GRADIENT = "output_gradient"
    #: A watched parameter's final gradient (``param_grad/*``), recorded by ``capture/parameters.py``.
    PARAM_GRAD = "param_grad"
    #: The final gradient of a parameter no watched module owns: in ``param_grad/global_norm`` only.
    UNWATCHED_PARAM_GRAD = "unwatched_param_grad"
    #: An optimizer step's change of a parameter (``param/update_ratio``), recorded by ``capture/parameters.py``.
    UPDATE = "update"
    #: A device value logged under its own tag (``amp/*``).
    SCALAR = "scalar"
    #: A module's feature maps (``feature_map/{module}``).
    IMAGE = "image"
    #: With ``attention=``, a module's attention calls (``attention/*``).
    ATTENTION = "attention"
    #: Every histogram of the step, binned.
    BINNED = "binned"
    #: With a float8 format in ``numerics=``, a watched ``nn.Linear``'s input and weight as fp8
    #: training casts them (``input/underflow_e4m3/*``, ``param/underflow_e4m3/*``): numerics only.
    FP8_INPUT = "fp8_input"
    FP8_WEIGHT = "fp8_weight"
    #: With ``fp8_scaling="rowwise"`` too, a watched ``nn.Linear``'s output gradient as torchao's
    #: rowwise recipe casts it, per row and per column (``gradient/underflow_e4m3_rows/*``,
    #: ``gradient/underflow_e4m3_columns/*``): numerics only, of eager modules.
    FP8_GRADIENT = "fp8_gradient"
    #: With ``logits=``, the output logits of the modules it names: their log-partition
    #: (``activation/log_z/*``, ``kinds.LOG_PARTITION``).
    LOGITS = "logits"


#: The sources a measure of one's own may be added to: those whose records a measure's device
#: function computes from the tensor (the others' records are built by hand).
EXTENSIBLE = (Source.OUTPUT, Source.INPUT, Source.OUTPUT_GRADIENT)
#: The sources whose scaled statistics carry the ``GradScaler``'s loss scale (parameter
#: gradients only where they are read before ``unscale_``, see ``output/scaling.py``).
LOSS_SCALED = (Source.OUTPUT_GRADIENT, Source.PARAM_GRAD, Source.UNWATCHED_PARAM_GRAD)
#: The sources of parameter gradients, read where the optimizer steps them (or as backward ends).
PARAM_GRADS = (Source.PARAM_GRAD, Source.UNWATCHED_PARAM_GRAD)

#: The histograms that carry the loss scale, by tag root: their source, and whether they bin
#: log10 magnitudes (shifted, not divided).
HISTOGRAM_SOURCES: dict[str, tuple[Source, bool]] = {
    Root.GRADIENT: (Source.OUTPUT_GRADIENT, False),
    Root.GRADIENT_LOG10: (Source.OUTPUT_GRADIENT, True),
    Root.PARAM_GRAD: (Source.PARAM_GRAD, False),
}

_TRAVEL: dict[Source, dict[str, object]] = {
    Source.OUTPUT: {"name": Root.ACTIVATION, "per_call": True},
    Source.INPUT: {"name": Root.INPUT, "per_call": True},
    Source.NONFINITE_INPUT: {"name": Root.INPUT, "per_call": True},
    Source.OUTPUT_GRADIENT: {"name": Root.GRADIENT, "per_call": True, "host_knows_numel": False},
    Source.PARAM_GRAD: {"name": Root.PARAM_GRAD, "norms": True},
    Source.UNWATCHED_PARAM_GRAD: {"name": Root.PARAM_GRAD, "norms": True},
    Source.UPDATE: {"name": Root.PARAM, "norms": True},
    Source.SCALAR: {"name": "scalar"},
    Source.IMAGE: {"name": Root.FEATURE_MAP},
    Source.ATTENTION: {"name": Root.ATTENTION, "per_call": True},
    Source.BINNED: {"name": "histogram"},
    Source.FP8_INPUT: {"name": Root.INPUT, "per_call": True},
    Source.FP8_WEIGHT: {"name": Root.PARAM, "per_call": True},
    Source.FP8_GRADIENT: {"name": Root.GRADIENT, "per_call": True},
    Source.LOGITS: {"name": Root.ACTIVATION, "per_call": True},
}
#: The sources of numerics alone (measured by ``kinds.fp8_cast_measure``): a Linear's input and
#: weight, and with ``fp8_scaling="rowwise"`` its output gradient.
FP8_SOURCES = (Source.FP8_INPUT, Source.FP8_WEIGHT, Source.FP8_GRADIENT)
#: What the tensorwise fp8 recipe loses of an output gradient: its own numerics' e5m2 fractions.
_TENSORWISE_GRADIENT = frozenset(per_format(lost, BACKWARD) for lost in (Lost.UNDERFLOW, Lost.OVERFLOW))
_MEASURES: dict[Source, tuple[Measure, ...]] = {
    Source.OUTPUT: TENSOR_MEASURES,
    Source.INPUT: TENSOR_MEASURES,
    Source.NONFINITE_INPUT: (NONFINITE,),
    Source.OUTPUT_GRADIENT: (GRADIENT_NORM, GRADIENT_NONFINITE),
    Source.PARAM_GRAD: (PARAM_GRAD_NORM,),
    Source.UNWATCHED_PARAM_GRAD: (GLOBAL_NORM_TERM,),
    Source.UPDATE: (UPDATE_RATIO,),
    Source.SCALAR: (SCALAR_VALUE,),
    Source.IMAGE: (PIXELS,),
    Source.ATTENTION: (ATTENTION_HEADS,),
    Source.BINNED: (HISTOGRAM_ROWS,),
    Source.LOGITS: (LOG_PARTITION,),
}
#: Measures of one's own, by source (a :class:`Source` or its value).
Extra = Mapping["Source | str", Sequence[Measure]]


@dataclass(frozen=True, eq=False)
class Recipe:
    """A logger's kinds of record, by source (immutable), and its sample indices. Build one with
    :meth:`build`."""

    #: Every source's kind (:attr:`Source.INPUT` only with ``inputs=True``, else
    #: :attr:`Source.NONFINITE_INPUT`).
    kinds: Mapping[Source, Kind]
    #: With ``numerics=``, the low-precision health of a source's tensors measured in a kind of
    #: its own, by that source (a parameter gradient's, whose records ``capture/parameters.py``
    #: builds after its own, and :data:`FP8_SOURCES`; an output's and an output gradient's are
    #: measures of their own kinds, :func:`_numeric_measures`); empty without.
    numerics: Mapping[Source, Kind]
    #: With ``numerics=``, by kind, the per-format statistics of its ``numerics=`` measures (a
    #: tensor's as a whole: ``underflow_fp16``, not ``underflow_e4m3_rows``) with their format;
    #: a measure of one's own has none, whatever its statistics are named. Empty without.
    formats: Mapping[Kind, Mapping[str, str]]
    #: The logger's sample indices, made on the host once per size: its histograms' and its
    #: outputs' median |x| (emptied when the logger closes, ``Recording.release``).
    indices: IndexCache

    @classmethod
    def build(
        cls, *, inputs: bool = False, numerics: bool = False, measures: Extra | None = None, rowwise: bool = False
    ) -> Recipe:
        """The recipe of a logger with these options; ``measures``: its own, added after the
        built-in ones of their source (:data:`EXTENSIBLE`); ``rowwise``: the fp8 casts scaled per
        row, the output gradient's too (``fp8_scaling="rowwise"``). Raises :class:`HookLoggerError` for a
        measure the source cannot compute and for a field or statistic two measures give."""
        extra = _extra(measures or {}, inputs=inputs)
        skipped = (Source.NONFINITE_INPUT if inputs else Source.INPUT, *FP8_SOURCES)
        wanted = [s for s in Source if s not in skipped]
        indices = IndexCache()
        added = _numeric_measures(indices) if numerics else {}
        kinds = {
            s: Kind(**_TRAVEL[s], measures=_with_numel(s, (*_MEASURES[s], *added.get(s, ()), *extra.get(s, ()))))  # type: ignore[arg-type]
            for s in wanted
        }
        numeric: dict[Source, Kind] = {}
        if numerics:
            numeric[Source.PARAM_GRAD] = Kind(
                name=Root.PARAM_GRAD, measures=numeric_measures(zero_frac=False, channels=False)
            )
            cast = fp8_cast_measure(SCALINGS["rowwise" if rowwise else "tensorwise"])
            casts = {Source.FP8_INPUT: cast, Source.FP8_WEIGHT: cast}
            if rowwise:  # (the tensorwise recipe casts it per tensor to e5m2: the gradient's own numerics)
                casts[Source.FP8_GRADIENT] = fp8_cast_measure(GRADIENT_CASTS)
            for source, cast in casts.items():
                numeric[source] = Kind(**_TRAVEL[source], measures=(cast,))  # type: ignore[arg-type]
        by_numerics = [(kinds[s], added[s]) for s in added if s in kinds] + [(k, k.measures) for k in numeric.values()]
        formats = {kind: MappingProxyType(_formats(measures)) for kind, measures in by_numerics}
        recipe = cls(MappingProxyType(kinds), MappingProxyType(numeric), MappingProxyType(formats), indices)
        recipe._check_tags()
        return recipe

    def __getitem__(self, source: Source) -> Kind:
        return self.kinds[source]

    @functools.cached_property
    def casts(self) -> Mapping[Kind, frozenset[str]]:
        """By kind, its statistics of a tensor fp8 training casts, in the format it casts it to:
        every statistic of a Linear's input and weight (and with ``fp8_scaling="rowwise"`` its
        output gradient) cast kinds, or without rowwise the output gradient's e5m2 ones (the
        tensorwise recipe's backward cast). Written whichever float8 format ``numerics=`` names."""
        out = {k: frozenset(k.stats) for s in FP8_SOURCES if (k := self.numerics.get(s)) is not None}
        if self.numerics and Source.FP8_GRADIENT not in self.numerics:
            out[self.kinds[Source.OUTPUT_GRADIENT]] = _TENSORWISE_GRADIENT
        return MappingProxyType(out)

    @property
    def all(self) -> tuple[Kind, ...]:
        """Every kind of the recipe."""
        return (*self.kinds.values(), *self.numerics.values())

    @property
    def scalar_kinds(self) -> tuple[Kind, ...]:
        """The kinds whose records become scalars as their measures say (attention's are
        summarised with their per-head values, ``output/summarize.py``)."""
        plain = (Source.IMAGE, Source.ATTENTION, Source.BINNED)
        return tuple(k for s, k in self.kinds.items() if s not in plain) + tuple(self.numerics.values())

    def scaled_by(self, source: Source) -> tuple[Kind, ...]:
        """The kinds of ``source``'s tensors (its own and its numerics): those of
        :data:`LOSS_SCALED` sources carry the loss scale in their scaled measures."""
        return tuple(k for k in (self.kinds.get(source), self.numerics.get(source)) if k is not None)

    def _check_tags(self) -> None:
        """No two measures of kinds sharing a tag root give the same statistic (they would write
        one tag); a whole-model total may be several measures' (it adds up all their records)."""
        by_root: dict[str, dict[str, Measure]] = {}
        for kind in self.all:
            owner = by_root.setdefault(kind.name, {})
            for measure in kind.measures:
                for stat in (*measure.stats, *filter(None, [measure.total])):
                    first = owner.setdefault(stat, measure)
                    shared = stat == measure.total == first.total
                    if first is not measure and not shared:  # (one kind's twice: Kind refuses those)
                        raise HookLoggerError(
                            f"{describe(measure)} and {describe(first)} both write '{kind.name}/{stat}/...'; "
                            "give the new measure a statistic of its own"
                        )


def _formats(measures: Sequence[Measure]) -> dict[str, str]:
    """The per-format statistics ``numerics=``'s ``measures`` give, with their format
    (:data:`~tblog_hooks.stats.numerics.FORMAT_OF`)."""
    return {stat: FORMAT_OF[stat] for m in measures for stat in m.stats if stat in FORMAT_OF}


def _numeric_measures(indices: IndexCache) -> dict[Source, tuple[Measure, ...]]:
    """With ``numerics=``, the measures added to a source's kind: an output's per-unit peaks and
    median |x| too (of the samples ``indices`` take), sharing the non-zero count and the extremes
    of its statistics; an output gradient's zero fraction (for fp16 underflow), with its element
    count on the device (``Kind.host_knows_numel``)."""
    return {
        Source.OUTPUT: (*numeric_measures(zero_frac=False, channels=True, base=TENSOR_MEASURES), median_abs(indices)),
        Source.OUTPUT_GRADIENT: numeric_measures(zero_frac=True, channels=False),
    }


def _with_numel(source: Source, measures: tuple[Measure, ...]) -> tuple[Measure, ...]:
    """``measures`` of ``source``, after :data:`~tblog_hooks.stats.kinds.ELEMENTS` where its
    records do not tell the host their element count and a measure needs it."""
    on_device = _TRAVEL[source].get("host_knows_numel") is False and any(m.needs_numel for m in measures)
    return (ELEMENTS, *measures) if on_device else measures


def _extra(measures: Extra, *, inputs: bool) -> dict[Source, tuple[Measure, ...]]:
    """``measures=`` checked: by source, measures that a source's records can compute."""
    if not isinstance(measures, Mapping):
        raise HookLoggerError(
            f"measures must be a mapping of a source ({', '.join(EXTENSIBLE)}) to a list of Measure, got {measures!r}"
        )
    out: dict[Source, tuple[Measure, ...]] = {}
    for key, items in measures.items():
        try:
            source = Source(key)
        except ValueError:
            raise HookLoggerError(
                f"measures has the source {key!r}, which is none; measures can be added to: {', '.join(EXTENSIBLE)}"
            ) from None
        if source not in EXTENSIBLE:
            raise HookLoggerError(
                f"measures cannot be added to {source.value!r}: its records are built by the logger "
                f"(capture/parameters.py, ...), not computed from a tensor by a measure; measures can be added to: "
                f"{', '.join(EXTENSIBLE)}"
            )
        if source is Source.INPUT and not inputs:
            raise HookLoggerError("measures for 'input' need inputs=True (without it inputs are only counted)")
        given: tuple[object, ...] = tuple(items) if isinstance(items, (list, tuple)) else (items,)
        checked: list[Measure] = []
        for m in given:
            if not isinstance(m, Measure):
                raise HookLoggerError(f"measures[{key!r}] holds {m!r}, not a tblog_hooks.stats.kinds.Measure")
            if m.compute is None:
                raise HookLoggerError(f"measures[{key!r}]: {describe(m)} has no compute, so nothing would record it")
            checked.append(m)
        out[source] = tuple(checked)
    return out
