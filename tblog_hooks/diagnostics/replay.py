"""A run read back from TensorBoard's files, replayed through the rules the logger uses: what
``tblog-hooks report`` and the dashboard show. Host-side only, no torch.

The logged scalars go through the same :class:`~tblog_hooks.diagnostics.health.Health` as in
the live logger, with the default :class:`~tblog_hooks.Thresholds`, and the per-step series of
``spikes=`` through the same spike detector, with the default :class:`~tblog_hooks.Spikes`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ..stats.tags import Indexed, Root, Stat, tag, unescape
from .findings import Finding, Thresholds
from .health import default_health
from .spikes import replay

#: Roots that only a logged step holds: their presence marks a step as logged.
_STATISTICS = tuple(tag(root, "") for root in (Root.ACTIVATION, Root.GRADIENT, Root.PARAM_GRAD))
#: The per-step series of ``spikes=``, written in events of their own.
_SERIES = tuple(tag(root, "") for root in (Root.STEP, Root.SPIKE))
#: Tags whose last part names every watched module (the forward order may be missing).
_NAMED = (tag(Root.GRADIENT, Stat.NORM, ""), tag(Root.ACTIVATION, Stat.MEAN, ""))


@dataclass
class Run:
    """One logger's scalars (its own tags, without the prefix) at the steps it logged, and its
    watched modules in forward order."""

    label: str  # the run directory, as the user named it
    prefix: str  # the logger's tag prefix ("" for none)
    scalars: dict[int, dict[str, float]]
    order: list[str]
    #: ``(from, to)`` for each time the logged steps went back (a run restarted into the same
    #: directory); from ``to`` on, the steps are those of the restart.
    restarts: list[tuple[int, int]] = field(default_factory=list)
    #: With ``spikes=``: ``{step: {tag: value}}`` of every step (``step/*``, ``spike/*``).
    series: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The directory's label, then the prefix in brackets: ``runs/gan [G]``."""
        return f"{self.label} [{self.prefix}]" if self.prefix else self.label


def is_logged_step(scalars: Mapping[str, float]) -> bool:
    """Whether an event's scalars (tags without the prefix) are those of a logged step."""
    return any(t.startswith(_STATISTICS) for t in scalars)


def is_series(scalars: Mapping[str, float]) -> bool:
    """Whether an event's scalars are every-step series of ``spikes=`` (written in events of their own)."""
    return all(t.startswith(_SERIES) for t in scalars)


def forward_order(written: Sequence[str], tags: Iterable[str]) -> list[str]:
    """The watched modules in forward order: as written (``health/forward_order``), then those
    only the run's scalar ``tags`` name, sorted."""
    named = {unescape(t.split("/", 2)[2]) for t in tags if t.startswith(_NAMED)}
    return [*written, *sorted(named - set(written))]


def from_columns(
    label: str, prefix: str, columns: Mapping[str, tuple[Sequence[int], Sequence[float]]], written: Sequence[str]
) -> Run:
    """A run from each of its scalar tags' ``(steps, values)`` (tags without the prefix, as a
    data provider serves them) and the forward order it wrote: the steps holding a statistic are
    its logged steps, the every-step series of ``spikes=`` go to :attr:`Run.series`.

    Tags written at the same steps are laid out as one table, so that a step's scalars (and their
    :class:`~tblog_hooks.stats.tags.Indexed` index) are built a table row at a time rather than
    value by value: a deep model's run holds millions."""
    order = forward_order(written, columns)
    tables: dict[tuple[bool, tuple[int, ...]], list[str]] = {}
    for t in sorted(columns, key=_tag_key(order)):
        tables.setdefault((t.startswith(_SERIES), tuple(columns[t][0])), []).append(t)
    steps_of: dict[bool, dict[int, tuple[Indexed, dict[str, dict[str, float]]]]] = {False: {}, True: {}}
    for (series, steps), tags in tables.items():
        heads = _heads(tags)
        for step, row in zip(steps, zip(*(columns[t][1] for t in tags))):
            if step not in steps_of[series]:
                index: dict[str, dict[str, float]] = {}
                steps_of[series][step] = (Indexed({}, index), index)
            held, index = steps_of[series][step]
            held.update(zip(tags, row))
            for head, names, start in heads:
                index.setdefault(head, {}).update(zip(names, row[start : start + len(names)]))
    scalars = {step: held for step, (held, _) in steps_of[False].items()}
    every_step = {step: held for step, (held, _) in steps_of[True].items()}
    logged = {step: scalars[step] for step in sorted(scalars) if is_logged_step(scalars[step])}
    return Run(label, prefix, dict(logged), order, series={s: every_step[s] for s in sorted(every_step)})


def _heads(tags: Sequence[str]) -> list[tuple[str, list[str], int]]:
    """``(root/stat/, names, first position)`` of each run of ``tags`` named ``root/stat/{name}``."""
    found: list[tuple[str, list[str], int]] = []
    for i, t in enumerate(tags):
        head, slash, name = t.rpartition("/")
        if not slash:
            continue
        if found and found[-1][0] == f"{head}/" and found[-1][2] + len(found[-1][1]) == i:
            found[-1][1].append(unescape(name))
        else:
            found.append((f"{head}/", [unescape(name)], i))
    return found


def findings(run: Run, thresholds: Thresholds | None = None) -> list[Finding]:
    """Every finding that starts in the run, in step order (spikes of its per-step series too).

    Each step's scalars are judged in one order, whatever order they were read in (an event
    file's, TensorBoard's): by tag root and statistic, then by name in forward order (see
    :func:`forward_key`), so that where values tie, the same module is named."""
    judge = default_health(thresholds or Thresholds(), logs=False)  # the report prints them itself
    key = _tag_key(run.order)
    for step, scalars in _in_order(run.scalars, key):
        judge.update(step, scalars, run.order)
    return sorted(judge.started + replay(dict(_in_order(run.series, key)), order=run.order), key=lambda f: f.step)


def _in_order(
    steps: Mapping[int, Mapping[str, float]], key: Callable[[str], object]
) -> Iterator[tuple[int, dict[str, float]]]:
    """Each step's values with their tags in ``key`` order (sorted again only where a step's tags
    differ from the step's before: most steps hold the same), :class:`~tblog_hooks.stats.tags.Indexed`
    for the rules' look-ups."""
    tags: list[str] = []
    held: set[str] = set()
    for step, values in steps.items():
        if values.keys() != held:
            held, tags = set(values), sorted(values, key=key)  # type: ignore[arg-type]
        if list(values) != tags:
            values = values.reordered(tags) if isinstance(values, Indexed) else {t: values[t] for t in tags}
        yield step, values if isinstance(values, Indexed) else Indexed(values)


def forward_key(order: Sequence[str]) -> Callable[[str], tuple[float, int, tuple[tuple[int, str], ...]]]:
    """A sort key putting names of modules or parameters in forward order: a parameter
    (``{module}.{param}``) right after its module (the innermost whose name starts it), an unwatched
    module (one ``attention=`` names) right before its first watched submodule, names no watched
    module explains last, in natural order (``h.2`` before ``h.10``)."""
    position = {m: i for i, m in enumerate(order)}

    @functools.lru_cache(maxsize=1 << 16)
    def key(name: str) -> tuple[float, int, tuple[tuple[int, str], ...]]:
        module = owner(name, order)
        if module is not None:
            return position[module], int(module != name), _natural(name)
        inside = [position[m] for m in order if m.startswith(f"{name}.")]
        return (min(inside) - 0.5, 0, ()) if inside else (len(order), 0, _natural(name))

    return key


def owner(name: str, order: Sequence[str]) -> str | None:
    """The watched module a name belongs to: the module itself, or for a parameter
    (``{module}.{param}``) the innermost module whose name starts it; ``None`` when none does."""
    if name in order:
        return name
    return max((m for m in order if name.startswith(f"{m}.")), key=len, default=None)


def _natural(name: str) -> tuple[tuple[int, str], ...]:
    return tuple((int(part), "") if part.isdigit() else (-1, part) for part in re.split(r"(\d+)", name))


def _tag_key(order: Sequence[str]) -> Callable[[str], tuple[str, tuple[object, ...]]]:
    """The order :func:`findings` judges a step's tags in."""
    by_name = forward_key(order)

    def key(full: str) -> tuple[str, tuple[object, ...]]:
        head, _, name = full.rpartition("/")
        return (head, by_name(unescape(name))) if head.count("/") == 1 else (full, ())

    return key


def module_rows(run: Run) -> list[dict[str, object]]:
    """Per watched module: output-gradient norm (latest, minimum, latest/first), latest dead
    fraction, and NaN/Inf counted over the run (outputs and output gradients)."""
    rows: list[dict[str, object]] = []
    for m in run.order:
        norm_tag, dead_tag = tag(Root.GRADIENT, Stat.NORM, m), tag(Root.ACTIVATION, Stat.DEAD_FRAC, m)
        norms = [s[norm_tag] for s in run.scalars.values() if norm_tag in s]
        dead = [s[dead_tag] for s in run.scalars.values() if dead_tag in s]
        bad = sum(
            s.get(tag(Root.ACTIVATION, Stat.NONFINITE, m), 0.0) + s.get(tag(Root.GRADIENT, Stat.NONFINITE, m), 0.0)
            for s in run.scalars.values()
        )
        rows.append({
            "module": m,
            "grad_norm_latest": norms[-1] if norms else None,
            "grad_norm_min": min(norms) if norms else None,
            "grad_norm_trend": norms[-1] / norms[0] if norms and norms[0] > 0 else None,
            Stat.DEAD_FRAC: dead[-1] if dead else None,
            "nonfinite": bad,
        })  # fmt: skip
    return rows
