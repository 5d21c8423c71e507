"""What ``spikes=`` adds to each ``step()`` of a logger: the step's gradient norms and loss read
on the device (``capture/spikes.py``), judged on the host (``diagnostics/spikes.py``) and written
as series; and whether the next steps are logged in full."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .capture.spikes import Samples, StepNorms, any_split, check_loss, whole_loss
from .diagnostics.spikes import SpikeWatch

if TYPE_CHECKING:
    from .capture.watched import Handles, Watched
    from .diagnostics.health import Health
    from .diagnostics.per_step import Diagnostics
    from .options import Options
    from .output.destination import Destination
    from .transport.distributed import Ranks


class SpikeLog:
    """What ``spikes=`` adds to each ``step()``: the step's norms and loss into the ring, the rows
    that arrived judged, their series written in batches (every ``every`` steps and at close),
    and whether the next step is logged in full (the steps after a spike)."""

    def __init__(
        self, norms: StepNorms, watch: SpikeWatch | None, health: Health | None, destination: Destination | None,
        *, every: int, force: bool,
    ) -> None:  # fmt: skip
        self.norms, self.watch, self.health, self.destination = norms, watch, health, destination
        self._every, self._force = every, force
        self._log_until = -1  # steps up to this one are logged in full
        self._failed = False
        self.samples = Samples()
        self._unjudged = 0  # steps in a row with nothing to judge (no norms read, no loss); -1: said so

    @classmethod
    def of(
        cls, config: Options, watched: Watched, modules: Sequence[str],
        handles: Handles, diagnostics: Diagnostics, destination: Destination | None, ranks: Ranks,
        model: nn.Module | None = None, divisor: Callable[[], float] = lambda: 1.0,
        closures: list[Callable[[], Callable[[], None]]] | None = None,
    ) -> SpikeLog | NoSpikes:  # fmt: skip
        """The spike watch ``config`` asks for, its hooks kept in ``handles`` (``diagnostics``: the
        health findings it tells of spikes, and the watched modules in forward order as far as
        known; ``model``'s forward pre-hook counts each step's samples; ``divisor``: of the ranks'
        summed losses, ``distributed.gradient_divisor``; ``closures``: what each evaluation of a
        closure optimizer's closure sets back, ``OptimizerSteps.every_step``, where the sample
        count goes: an LBFGS step's samples are one evaluation's)."""
        health, order = diagnostics.health, diagnostics.order
        spikes = config.spike_config
        if spikes is None or (destination is None and not (ranks.reduce or any_split(watched))):
            return NoSpikes(off=spikes is None)
        norms = StepNorms(watched, modules, spikes.steps, over_ranks=ranks.reduce, first=ranks.first, divisor=divisor)
        handles.add(register_optimizer_step_pre_hook(norms.pre))
        handles.add(register_optimizer_step_post_hook(norms.post))
        watch = None if destination is None else SpikeWatch(spikes, modules, order)
        log = cls(norms, watch, health, destination, every=config.every, force=not ranks.needed)
        if model is not None:
            handles.add(model.register_forward_pre_hook(log.samples, with_kwargs=True))
        if closures is not None:
            closures.append(log.samples.rewinder)
        # Under collectives in logged steps every rank must log the same steps: no extra ones then.
        return log

    def step(self, step: int, loss: object) -> bool:
        """The end of step ``step`` (``loss``: its loss, checked here); whether step ``step + 1``
        is logged in full."""
        checked = check_loss(loss)
        if self.watch is None:  # a rank that only joins the collectives (sharded norms, samples)
            self.norms.drop(checked, self.samples.take())
            if (step + 1) % self._every == 0:
                self.norms.refresh()
            return False
        queued = self.norms.end_step(step, checked, self.samples.take())
        if self._failed:
            return False
        self._say_if_unjudged(queued)
        self._judge(wait=False)
        if (step + 1) % self._every == 0 or len(self.watch.pending) >= _MAX_PENDING:
            self.norms.refresh()  # as a logged step looks the parameters up again
            self._flush()
        return self._force and step + 1 <= self._log_until

    def close(self) -> None:
        """Judge and write every row still on its way."""
        if self.watch is not None and not self._failed:
            self._judge(wait=True)
            self._flush()

    def _judge(self, *, wait: bool) -> None:
        assert self.watch is not None
        for at, row, loss_given in self.norms.take(wait=wait):
            samples = int(row[-1]) if row[-1] > 0 else None  # (NaN, 0: none counted)
            found = self.watch.feed(at, row[:-1], loss_given, samples)
            if found:  # (on CUDA a row is read a step or more after its own: the window is the spike's)
                self._log_until = max(self._log_until, at + self.watch.config.after)
                if self.health is not None:
                    self.health.spiked(found)

    def _say_if_unjudged(self, queued: bool) -> None:
        """Warn once when ``warmup`` steps in a row brought nothing to judge: no gradient norms read
        (no ``torch.optim`` optimizer stepped the model's parameters) and no loss given."""
        assert self.watch is not None
        if self._unjudged < 0:
            return
        self._unjudged = 0 if queued else self._unjudged + 1
        if self._unjudged < self.watch.config.warmup or self.norms.failed:
            return
        self._unjudged = -1
        warnings.warn(
            f"tblog_hooks: spikes= has had nothing to judge for {self.watch.config.warmup} steps: no "
            "torch.optim optimizer stepped the model's parameters (their gradient norms are read in its step "
            "hooks) and step() was given no loss; pass the loss, hooks.step(loss=loss), or train with a "
            "torch.optim.Optimizer",
            UserWarning,
            stacklevel=4,
        )

    def _flush(self) -> None:
        assert self.watch is not None and self.destination is not None
        pending = self.watch.take()
        if not pending:
            return
        try:
            self.destination.write_series(pending)
            self.destination.flush()
        except Exception as error:  # a broken writer: the logger's own writes report it too
            self._failed = True
            warnings.warn(
                f"tblog_hooks: writing the per-step series failed, so spikes are no longer watched "
                f"(training continues): {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=4,
            )


#: Steps of series held before they are written even between logged steps (a large ``every``).
_MAX_PENDING = 1000


class NoSpikes:
    """``spikes=`` off, or a rank that neither writes nor joins a collective of sharded norms: a
    loss given to ``step()`` is checked, and warned about (once) when ``spikes=`` is off; with it
    on, a ``DTensor`` loss is made whole as on the writing rank (a ``Partial`` one's is a collective)."""

    def __init__(self, *, off: bool) -> None:
        self._off = off

    def step(self, step: int, loss: object) -> bool:
        checked = check_loss(loss)
        if not self._off:  # (a Partial DTensor loss's full value is a collective the writing rank makes)
            whole_loss(checked)
        elif loss is not None:
            warnings.warn(
                "tblog_hooks: step(loss=...) is only used with spikes= (HookLogger(..., spikes=True)); "
                "this logger ignores it",
                UserWarning,
                stacklevel=3,
            )
        return False

    def close(self) -> None:
        pass
