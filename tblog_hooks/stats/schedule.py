"""Which histograms a logged step writes: ``HookLogger(histograms=...)``.

Histograms are most of a run's bytes and of TensorBoard's load time (a 32-bucket histogram is
~600 bytes, a scalar ~50), and they change slowly from one logged step to the next, so by
default they are written on every 5th logged step, and weights on every 10th. Decided on the
host from the step index when a logged step begins, so steps without histograms skip their
device work (sampling and binning) too.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import HookLoggerError
from ..keywords import Renamed, keywords, switched
from .tags import HISTOGRAM_KINDS, Root

#: All but ``gradient``: the linear histogram of an output gradient is mostly one spike at zero
#: whose width ``gradient/norm`` already charts; ``gradient_log10`` shows its spread over orders
#: of magnitude, which is where vanishing gradients show.
DEFAULT_KINDS = tuple(k for k in HISTOGRAM_KINDS if k != Root.GRADIENT)


@keywords(
    every="every_logged",
    param_every=Renamed(
        "weights_every_logged",
        "param_every counted histogram steps, weights_every_logged counts logged steps: "
        "weights_every_logged = every_logged * param_every",
        lambda value, given: given["every_logged"] * value,
    ),
)
@dataclass(frozen=True)
class Histograms:
    """Which histograms logged steps write, counted in the logged steps that recorded something
    (``HookLogger``'s ``every`` counts optimizer steps): the first of them writes every kind, so a
    run, a resumed run or a framework callback has histograms from its first trained step on.

    Everything on every logged step: ``Histograms(every_logged=1, weights_every_logged=1,
    kinds=HISTOGRAM_KINDS)``.

    Args:
        every_logged: histograms on logged steps ``0, every_logged, 2 * every_logged, ...`` (the
            first logged step that records something is number 0).
        weights_every_logged: weight histograms (``param/...``) on logged steps ``0,
            weights_every_logged, ...``; the other kinds follow ``every_logged``.
        kinds: the tag roots to write histograms of, among
            :data:`~tblog_hooks.stats.tags.HISTOGRAM_KINDS`; kept as a tuple in that order. A
            kind is named as its histograms' tags are (``activation/{module}``), singular, where
            the options that produce them are plural: ``activations=`` produces ``activation``,
            ``inputs=`` ``input``, ``gradients=`` ``gradient`` and ``gradient_log10``,
            ``parameters=`` ``param_grad`` and ``param`` (the weights). By default all but
            ``gradient``, of those the logger's options produce; kinds given here must all be
            produced (``input`` needs ``inputs=True``, ...).

    ``every=`` and ``param_every=``, the old keywords, still work for this release, with a
    ``DeprecationWarning``: ``every`` is ``every_logged``, and ``weights_every_logged = every_logged
    * param_every``.

    Raises:
        HookLoggerError: a count that is not a positive int, an empty ``kinds``, an unknown kind
            or an unknown keyword.
    """

    every_logged: int = 5
    weights_every_logged: int = 10
    kinds: Iterable[str] = field(default=DEFAULT_KINDS)
    #: Whether ``kinds`` was given (then every kind must be produced by the logger's options).
    explicit: bool = field(init=False, repr=False, compare=False)
    # What kinds_at returns, made once: under torch.compile a hook's test `kind in kinds` is
    # guarded on the set object, so the same few objects give a few graphs, not one per step.
    _steps: tuple[frozenset[str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("every_logged", "weights_every_logged"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HookLoggerError(f"Histograms({name}={value!r}) is invalid: it must be a positive int")
        given: object = self.kinds
        object.__setattr__(self, "explicit", given is not DEFAULT_KINDS)
        kinds = list(given) if isinstance(given, Iterable) and not isinstance(given, str) else [given]
        unknown = [k for k in kinds if k not in HISTOGRAM_KINDS]
        if unknown or not kinds:
            what = (
                f"holds {', '.join(map(_named, unknown))}" if unknown else "is empty (pass histograms=False for none)"
            )
            raise HookLoggerError(
                f"Histograms(kinds={given!r}) {what}; kinds are tag roots among {', '.join(HISTOGRAM_KINDS)} "
                "(singular, as the tags are: activation/{module}; unlike the options activations=, inputs=, ...)"
            )
        chosen = frozenset(str(k) for k in kinds)
        weights = chosen & {Root.PARAM}
        object.__setattr__(self, "kinds", tuple(k for k in HISTOGRAM_KINDS if k in chosen))
        # (none, all but weights, weights only, all)
        object.__setattr__(self, "_steps", (frozenset(), chosen - weights, frozenset(weights), chosen))

    @property
    def all_kinds(self) -> frozenset[str]:
        """Every kind some logged step writes (one object: see ``_steps``)."""
        return self._steps[3]

    def kinds_at(self, index: int) -> frozenset[str]:
        """The kinds logged step number ``index`` (0, 1, 2, ... in logged steps that record) writes."""
        others, weights = index % self.every_logged == 0, index % self.weights_every_logged == 0
        return self._steps[others + 2 * weights]


def _named(kind: object) -> str:
    """An unknown kind, with the kind it is closest to (``'activations'``: ``'activation'``)."""
    close = difflib.get_close_matches(str(kind), HISTOGRAM_KINDS, n=1, cutoff=0.7)
    return f"{kind!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def schedule(value: object) -> Histograms | None:
    """``HookLogger(histograms=...)`` as a :class:`Histograms` (``None``: no histograms)."""
    return switched(value, Histograms, _every_nth)


def _every_nth(value: object) -> Histograms:
    """``histograms=n``: histograms on every ``n``-th logged step, weights on every ``2n``-th."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return Histograms(every_logged=value, weights_every_logged=2 * value)
    raise HookLoggerError(
        "histograms must be True (the defaults, Histograms()), False or None (none), a positive int n "
        f"(histograms on every n-th logged step, weights on every 2n-th) or a tblog_hooks.Histograms, got {value!r}"
    )
