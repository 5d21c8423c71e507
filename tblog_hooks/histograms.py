"""Which histograms a logged step writes: ``HookLogger(histograms=...)``.

Histograms are most of a run's bytes and of TensorBoard's load time (a 32-bucket histogram is
~600 bytes, a scalar ~50), and they change slowly from one logged step to the next, so by
default they are written on every 5th logged step, and weights on every 10th. Decided on the
host from the step index when a logged step begins, so steps without histograms skip their
device work (sampling and binning) too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .errors import HookLoggerError
from .records import ACTIVATION, GRADIENT, GRADIENT_LOG10, INPUT, PARAM, PARAM_GRAD

#: Every histogram kind, by tag root: ``activation/{module}``, ``input/{module}`` (with
#: ``inputs=True``), ``gradient/{module}`` (output gradient), ``gradient_log10/{module}`` (log10 of
#: its magnitudes), ``param_grad/{module}.{param}``, ``param/{module}.{param}`` (weights).
KINDS = (ACTIVATION.name, INPUT.name, GRADIENT.name, GRADIENT_LOG10, PARAM_GRAD.name, PARAM)
#: All but ``gradient``: the linear histogram of an output gradient is mostly one spike at zero
#: whose width ``gradient/norm`` already charts; ``gradient_log10`` shows its spread over orders
#: of magnitude, which is where vanishing gradients show.
DEFAULT_KINDS = tuple(k for k in KINDS if k != GRADIENT.name)


@dataclass(frozen=True)
class Histograms:
    """Histograms on every ``every``-th logged step (logged steps ``0, every, 2*every, ...``
    counted as ``step // HookLogger.every``), weights (``param/``) on every ``param_every``-th of
    those, of the tag roots in ``kinds`` (names from :data:`KINDS`; kept as a tuple in that order).
    Everything on every logged step: ``Histograms(every=1, param_every=1, kinds=KINDS)``.
    """

    every: int = 5
    param_every: int = 2
    kinds: Iterable[str] = field(default=DEFAULT_KINDS)
    # What kinds_at returns, made once: under torch.compile a hook's test `kind in kinds` is
    # guarded on the set object, so the same three objects give three graphs, not one per step.
    _steps: tuple[frozenset[str], frozenset[str], frozenset[str]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("every", "param_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HookLoggerError(f"Histograms({name}={value!r}) is invalid: it must be a positive int")
        given: object = self.kinds
        kinds = list(given) if isinstance(given, Iterable) and not isinstance(given, str) else [given]
        unknown = [repr(k) for k in kinds if k not in KINDS]
        if unknown or not kinds:
            what = f"holds {', '.join(unknown)}" if unknown else "is empty (pass histograms=False for none)"
            raise HookLoggerError(f"Histograms(kinds={given!r}) {what}; kinds are tag roots among {', '.join(KINDS)}")
        chosen = frozenset(str(k) for k in kinds)
        object.__setattr__(self, "kinds", tuple(k for k in KINDS if k in chosen))
        object.__setattr__(self, "_steps", (frozenset(), chosen - {PARAM}, chosen))

    @property
    def all_kinds(self) -> frozenset[str]:
        """Every kind some logged step writes (one object: see ``_steps``)."""
        return self._steps[2]

    def kinds_at(self, index: int) -> frozenset[str]:
        """The kinds logged step number ``index`` (0, 1, 2, ... in logged steps) writes."""
        none, without_weights, every_kind = self._steps
        if index % self.every:
            return none
        return without_weights if index % (self.every * self.param_every) else every_kind


def schedule(value: object) -> Histograms | None:
    """``HookLogger(histograms=...)`` as a :class:`Histograms` (``None``: no histograms)."""
    if isinstance(value, Histograms):
        return value
    if value is True:
        return Histograms()
    if value is False:
        return None
    if isinstance(value, int) and value >= 1:
        return Histograms(every=value)
    raise HookLoggerError(
        "histograms must be True (the defaults, Histograms()), False (none), a positive int n "
        f"(histograms on every n-th logged step) or a tblog_hooks.Histograms, got {value!r}"
    )
