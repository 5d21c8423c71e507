"""What a logged step's optimizer steps say about the loop: a closure optimizer's evaluations,
and a ``step()`` the loop forgot.

One global optimizer step pre-hook (``register_optimizer_step_pre_hook``: every ``torch.optim``
optimizer), registered by every logger whatever its options; between logged steps it returns at
once. In a logged step:

- an optimizer given a closure (``LBFGS``, Lightning's ``optimizer.step(closure)``) may call it
  several times; each call is one evaluation of the loss, not a micro-batch, so the step's
  statistics are the last evaluation's (as its parameter gradients are): the hook hands the
  optimizer the closure wrapped so that each call first drops what the hooks recorded since the
  step began (a few list truncations; nothing read, no op);
- an optimizer that steps twice says that ``step()`` was not called after its first step
  (gradient accumulation is one optimizer step; a GAN's two optimizers step once each), said once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

from torch.optim import Optimizer

from .._compat import step_closure
from .step import StepBuffer
from .watched import Watched

#: Drops what the hooks recorded after it was made (``Recording.rewinder``).
Rewind = Callable[[], None]


class OptimizerSteps:
    """The optimizer step pre-hook of a logger (:meth:`pre`), and what it saw this logged step."""

    def __init__(self, buffer: StepBuffer, watched: Watched, rewinder: Callable[[], Rewind]) -> None:
        """``rewinder``: makes a :data:`Rewind` of the records made so far (``Recording.rewinder``)."""
        self.buffer, self.watched, self._rewinder = buffer, watched, rewinder
        self._steps: dict[int, int] = {}  # id(optimizer) -> its steps this logged step
        self._closure: Rewind | None = None  # of the closure step under way, if any
        self._warned = False
        #: What else a closure's evaluation starts again, on every step, logged or not (each makes
        #: a :data:`Rewind` of its state as the step begins): ``spikes=``' sample count.
        self.every_step: list[Callable[[], Rewind]] = []

    def pre(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Optimizer step pre-hook: count the step; given a closure, return the step's arguments
        with the closure wrapped (see the module's docstring), else ``None`` (arguments unchanged)."""
        buffer = self.buffer
        if buffer.active:
            buffer.trained = True
            self._count(optimizer)
        given = step_closure(args, kwargs)
        if given is None or not (buffer.active or self.every_step):
            return None
        closure = cast(Callable[..., Any], given)
        rewinds = [make() for make in self.every_step]
        if buffer.active:
            rewind = self._closure = self._rewinder()
            rewinds.append(lambda: rewind() if self._closure is rewind else None)  # (not once the logged step ended)

        def evaluation(*a: Any, **k: Any) -> Any:
            for start_again in rewinds:
                start_again()
            return closure(*a, **k)

        if "closure" in kwargs:
            return args, {**kwargs, "closure": evaluation}
        return (*args[:1], evaluation, *args[2:]), kwargs

    def _count(self, optimizer: Optimizer) -> None:
        """One more step of ``optimizer`` in this logged step; its second is said (once)."""
        steps = self._steps[id(optimizer)] = self._steps.get(id(optimizer), 0) + 1
        if steps == 2 and not self._warned and self._trains_watched(optimizer):
            self._warned = True
            warnings.warn(
                f"tblog_hooks: {type(optimizer).__name__} stepped a second time within one logged step, so that logged "
                "step pools the statistics of every optimizer step since the last hooks.step(); call hooks.step() "
                "once after each optimizer step (after all of the step's micro-batches, with gradient accumulation)",
                RuntimeWarning,
                stacklevel=4,
            )

    def end_step(self) -> None:
        """The logged step ended: forget its optimizer steps."""
        self._steps.clear()
        self._closure = None

    def _trains_watched(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps a parameter of the watched modules (another model's
        optimizer may step as often as it likes)."""
        watched = {id(p) for _, p in self.watched.params()}
        return any(id(p) in watched for group in optimizer.param_groups for p in group["params"])
