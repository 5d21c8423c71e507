"""The recorders of a logger wired to one step buffer and to the model's watched modules: what
:class:`~tblog_hooks.HookLogger` starts and ends each logged step with; and the ``GradScaler``'s
recorder (:class:`ScaleWatch`)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .._compat import found_inf, initial_scale, loss_scale
from ..kernels import Kernels
from ..keywords import is_off
from ..stats.binning import Sample
from ..stats.numerics import Written
from ..stats.packing import Record, StepLayout, pack_step
from ..stats.recipe import Source
from ..stats.reductions import units_dim
from ..stats.tags import SCALE_TAG, SKIPPED_TAG
from ..topology.parallel import TensorParallel
from ..topology.sharding import Pending, TermsOf
from ..transport.distributed import rank_and_world
from .activations import ActivationRecorder
from .attention import AttentionRecorder
from .hooks import ForwardHook, ForwardPreHook, KeepTraced, ParamGradHook, PlacementHook
from .output_gradients import OutputGradientRecorder
from .parameters import OptimizerHooks, ParameterRecorder
from .step import OptimizerSteps, Part, Rewind, StepBuffer
from .watched import Handles, Watched

if TYPE_CHECKING:
    from ..options import Options


class Recording:
    """Hooks on the watched modules (and optimizers) that record on logged steps only."""

    def __init__(
        self,
        watched: Watched,
        config: Options,
        *,
        feature_maps: frozenset[str],
        logits: frozenset[str],
        model: nn.Module,
        parallel: TensorParallel,
    ) -> None:
        """The recording the ``HookLogger`` options ``config`` ask for (``feature_maps``, ``logits``:
        the names of the watched modules they select; ``parallel``: the model's tensor-parallel styles)."""
        histograms = config.histogram_schedule
        self.watched = watched
        self._parameters = config.parameters
        self.buffer = StepBuffer(histograms, config.recipe, Kernels.from_environment())
        formats = config.numerics_formats
        #: With ``numerics=``, the formats whose scalars are written.
        self.numerics = None if formats is None else Written(formats)
        numerics = self.numerics is not None
        self.gradients = (
            OutputGradientRecorder(self.buffer, histograms=histograms is not None) if config.gradients else None
        )
        self.parallel = parallel
        merged = config.reduce_ranks and rank_and_world()[1] > 1
        self.activations = ActivationRecorder(
            self.buffer,
            self.gradients,
            activations=config.activations,
            inputs=config.inputs,
            eval_passes=config.eval_passes,
            merged=merged,
            feature_maps=feature_maps,
            logits=logits,
            parallel=self.parallel,
            numerics=self.numerics,
        )
        self.parameters = ParameterRecorder(self.buffer, numerics=numerics)
        self.attention = (
            AttentionRecorder(
                self.buffer,
                model,
                config.attention,
                eval_passes=config.eval_passes,
                parallel=self.parallel,
                merged=merged,
            )
            if not is_off(config.attention)
            else None
        )
        #: With ``optimizer=``, parameters are read when an optimizer steps them; else during backward.
        wanted = config.optimizer is not None and config.parameters
        self.optimizer_hooks = OptimizerHooks(self.parameters, watched, config.scaler) if wanted else None
        self.optimizer_steps = OptimizerSteps(self.buffer, watched, self.rewinder)
        self.handles = Handles()  # live until release()
        self._step_handles = Handles()  # live during one logged step
        self._unstepped_warned = self._eval_warned = self._uncalled_warned = False

    def params(self) -> list[tuple[str, Tensor]]:
        """The watched parameters that are logged (none with ``parameters=False``)."""
        return self.watched.params() if self._parameters else []

    def counted(self) -> list[tuple[str, Tensor]]:
        """The parameters whose gradients are read (none with ``parameters=False``): the watched
        ones, then the model's others, for ``param_grad/global_norm`` (``ParameterRecorder.counted``)."""
        return self.parameters.counted(self.watched) if self._parameters else []

    @property
    def forward_order(self) -> list[str]:
        """Watched modules in the order their forward hooks first fired (grows as they do)."""
        return self.activations.forward_order

    def attach(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        """Register the module hooks (and the optimizer hooks, with ``optimizer=``)."""
        for module, pre, follow in self.parallel.boundaries(model):
            hook = PlacementHook(follow)
            self.handles.add(module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook))
        for name, module in modules.items():
            self.activations.units[name] = units_dim(module)
            self.handles.add(module.register_forward_pre_hook(ForwardPreHook(self.activations, name), with_kwargs=True))
            self.handles.add(module.register_forward_hook(ForwardHook(self.activations, name)))
        if self.gradients is not None:
            self.gradients.place_probes(model, modules)
        if self.attention is not None:
            enter, leave = self.attention.hooks()
            for entry in self.attention.entries(model):
                self.handles.add(entry.register_forward_pre_hook(enter))
                self.handles.add(entry.register_forward_hook(leave, always_call=True))
        self.handles.add(register_optimizer_step_pre_hook(self.optimizer_steps.pre))
        if self.optimizer_hooks is not None:
            self.handles.add(register_optimizer_step_pre_hook(self.optimizer_hooks.pre))
            self.handles.add(register_optimizer_step_post_hook(self.optimizer_hooks.post))

    def begin(self, index: int) -> None:
        """Logged step number ``index`` (in logged steps) begins: hooks record from now on."""
        for name in self.watched.newly_left():
            self.buffer.disabled_names.add(name)  # should it still be called from elsewhere
            warnings.warn(
                f"tblog_hooks: watched module {name!r} is no longer part of the model (replaced or deleted after the "
                "HookLogger was created), so it is not logged any more; create the HookLogger after changing the "
                "model to watch the new module",
                RuntimeWarning,
                stacklevel=4,
            )
        self.activations.called.clear()
        self.buffer.active = True
        self.buffer.begin(index)
        self.parallel.begin()
        if self.optimizer_hooks is not None and not self._unstepped_warned:
            self.optimizer_hooks.begin()
        if self.optimizer_hooks is None:  # else parameters are read when an optimizer steps them
            for key, p in self.counted():
                if p.requires_grad:  # a frozen parameter has no gradient (and takes no hook)
                    self._step_handles.add(p.register_post_accumulate_grad_hook(ParamGradHook(self.parameters, key)))
        elif self.gradients is None:  # no hook of ours would run in backward: one that keeps compiled records
            anchor = self.watched.trained_parameter()
            if anchor is not None:
                self._step_handles.add(anchor.register_post_accumulate_grad_hook(KeepTraced(self.buffer)))

    def stop(self) -> None:
        """Hooks record nothing from now on, until the next :meth:`begin`."""
        self.buffer.active = False

    def rewinder(self) -> Rewind:
        """What drops every record this logged step's hooks make after now (each evaluation of a
        closure optimizer's closure starts with it, ``step.OptimizerSteps``)."""
        buffer, activations, gradients = self.buffer, self.activations, self.gradients
        at, mapped, pending = buffer.mark(), activations.mark(), 0 if gradients is None else gradients.mark()

        def rewind() -> None:
            buffer.rewind(at)
            activations.rewind(mapped)
            if gradients is not None:
                gradients.rewind(pending)

        return rewind

    @property
    def trained(self) -> bool:
        """Whether this logged step saw a backward reach the watched modules or an optimizer step."""
        return self.buffer.trained

    @property
    def empty(self) -> bool:
        """Whether nothing was recorded since the logged step began."""
        return self.buffer.empty and not self.parameters.graded

    def end(self) -> None:
        """The logged step's training is over: stop recording, remove its per-step hooks, take
        the weight histograms (after the optimizer's update, on whichever stream it ran)."""
        self.stop()
        self.buffer.streams.wait()
        if self.activations.only_evaluated and self.parameters.graded and not self._eval_warned:
            self._eval_warned = True
            warnings.warn(
                "tblog_hooks: a logged step ran backward, but every forward pass of the watched modules was in eval "
                "mode, so no activation or output-gradient statistics were recorded: call model.train() before "
                "training (or pass eval_passes=True to record eval-mode passes as well)",
                RuntimeWarning,
                stacklevel=4,
            )
        self.activations.end_step()
        if self.attention is not None:
            self.attention.end_step()
        self._step_handles.remove_all()
        self.optimizer_steps.end_step()
        if self.optimizer_hooks is not None:
            self.optimizer_hooks.clear()
        self.parameters.weights(self.params)

    def drain(self, *, dropped: bool = False) -> tuple[list[Record], list[Sample], list[Pending]]:
        """The step's records and histogram samples, and the gradients still to be reduced over
        ranks (``sharding.Pending``), ready for the current stream (``transport/streams.py``);
        the recorders are reset. ``dropped``: none (a step that is not written)."""
        records, samples = self.buffer.drain()
        outputs = self.activations.take_terms() + ([] if self.gradients is None else self.gradients.end_step(records))
        graded, rows, waiting = self.parameters.end_step()
        if dropped:
            return [], [], []
        self._say_uncalled(records, graded, waiting)
        records, samples, waiting = records + graded, samples + rows, waiting + outputs
        self.buffer.streams.keep(_tensors(records, samples, waiting))
        return records, samples, waiting

    def _say_uncalled(self, records: list[Record], graded: list[Record], waiting: list[Pending]) -> None:
        """Warn once when watched modules recorded no call in a logged step while their parameters'
        gradients were read (:func:`_uncalled`)."""
        recorder = self.activations
        if self._uncalled_warned or not (recorder.activations or recorder.inputs or self.gradients is not None):
            return
        silent = _uncalled(self.buffer, self.watched, recorder.called, records, graded, waiting)
        if silent:
            self._uncalled_warned = True
            _warn_uncalled(silent)

    def resolve(self, waiting: list[Pending], reduced: list[Tensor]) -> tuple[list[Record], list[Sample]]:
        """Records and histogram samples of the tensors placed ``Partial``, from their terms ``reduced`` over
        ranks (``Ranks.finish``), by their recorders: parameters' and outputs' gradients, outputs."""
        records, samples = list[Record](), list[Sample]()
        recorders = {TermsOf.PARAMETER_GRADIENT: self.parameters, TermsOf.OUTPUT_GRADIENT: self.gradients}
        for of, recorder in {**recorders, TermsOf.OUTPUT: self.activations}.items():
            mine = [(p, t) for p, t in zip(waiting, reduced) if p.of is of]
            if mine and recorder is not None:
                more, rows = recorder.resolve([p for p, _ in mine], [t for _, t in mine])
                records, samples = records + more, samples + rows
        return records, samples

    def pack(self, records: list[Record], samples: list[Sample]) -> tuple[Tensor, StepLayout] | None:
        """Bin the step's histograms and pack every record into one float64 tensor. Should binning
        fail (a kernel the device refuses), the step is packed without histograms and histograms
        stop, said once: no scalar depends on them."""
        buffer = self.buffer
        try:
            return pack_step(records, samples, buffer.kinds, buffer.indices, buffer.recipe, buffer.kernels)
        except Exception as error:
            if not samples:
                raise
            buffer.fail(Part.HISTOGRAMS, error)
            buffer.stop_histograms()
            return pack_step(records, [], buffer.kinds, buffer.indices, buffer.recipe, buffer.kernels)

    def check_stepped(self, step: int) -> None:
        """Warn once when, at the end of logged step ``step``, a watched parameter holds a gradient
        written in that step that no optimizer stepped (one outside ``torch.optim``, or none), so
        it was not read."""
        if self.optimizer_hooks is None or self._unstepped_warned:
            return
        missed = self.optimizer_hooks.unstepped()
        if missed:
            self._unstepped_warned = True
            warnings.warn(
                f"tblog_hooks: {len(missed)} watched parameter(s) ({', '.join(map(repr, missed[:5]))}"
                f"{', ...' if len(missed) > 5 else ''}) have gradients but no torch.optim optimizer stepped them in "
                f"logged step {step}, so param_grad/* leaves them out (with optimizer=, gradients are read when "
                "an optimizer steps them); pass optimizer=None to read them during backward instead",
                RuntimeWarning,
                stacklevel=3,
            )

    def release(self) -> None:
        """The logger is done: stop recording, remove every hook, drop cached tensors."""
        self.stop()
        self.handles.remove_all()
        self._step_handles.remove_all()
        if self.gradients is not None:
            self.gradients.release()
        self.buffer.indices.clear()


def _tensors(records: list[Record], samples: list[Sample], waiting: list[Pending]) -> Iterator[Tensor]:
    """Every device tensor a drained step holds."""
    for record in records:
        yield from record.values
    for h in samples:
        yield from (t for t in (h.sample, h.lo, h.hi, h.weight) if t is not None)
    for p in waiting:
        yield p.terms


class ScaleWatch:
    """Records one enabled ``GradScaler``'s state around a logged step, on its device, never on
    the host: during backward every gradient is multiplied by the loss scale; the scale in use
    and whether the scaler skipped the step (inf/nan found) are read from the scaler's own device
    tensors and recorded as ``amp/loss_scale`` and ``amp/skipped_step``, so they travel in the
    logged step's one transfer; ``output/scaling.py`` applies them on the host."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self._before: Tensor | None = None

    def begin(self) -> None:
        """At the start of a logged step: the scale its backward passes will use."""
        scale = loss_scale(self.scaler)
        self._before = None if scale is None else scale.detach().clone()

    def finish(self, buffer: StepBuffer) -> None:
        """Record the scale used by the step's backward, and whether the scaler skipped the step."""
        scale = loss_scale(self.scaler)
        if scale is None:  # the scaler was not used in this step
            return
        found = found_inf(self.scaler)
        if found:  # step() ran but update() has not: the current scale is the one backward used
            used, skipped = scale, torch.stack([f.to(scale.device) for f in found]).sum() > 0
        else:  # update() ran: it lowers the scale exactly when it skipped the step
            before = self._before if self._before is not None else torch.full_like(scale, initial_scale(self.scaler))
            used, skipped = before, scale < before
        buffer.record_scalar(SCALE_TAG, used)
        buffer.record_scalar(SKIPPED_TAG, skipped)


def _uncalled(
    buffer: StepBuffer, watched: Watched, called: set[str], records: list[Record], graded: list[Record],
    waiting: list[Pending],
) -> list[str]:  # fmt: skip
    """Watched modules that recorded no call in a logged step (no forward hook of theirs ran,
    ``called``, and no compiled one recorded) while their parameters' gradients were read: a
    module used functionally or called through ``self.forward(...)`` runs no hook. An ``out_proj``
    whose attention recorded is not one (``Watched.computed_by_parent``)."""
    kind = buffer.recipe[Source.PARAM_GRAD]
    read = {r.name for r in graded if r.kind is kind} | {p.key for p in waiting if p.of is TermsOf.PARAMETER_GRADIENT}
    if not read:
        return []
    recorded = called | {r.name for r in records if r.kind.per_call}
    skipped = recorded | buffer.disabled_names
    skipped |= {m for m, parent in watched.computed_by_parent().items() if parent in recorded}
    return list(dict.fromkeys(m for m, key, _ in watched.owned() if key in read and m not in skipped))


def _warn_uncalled(silent: list[str]) -> None:
    listed = ", ".join(map(repr, silent[:5])) + (f" and {len(silent) - 5} more" if len(silent) > 5 else "")
    warnings.warn(
        f"tblog_hooks: watched module(s) {listed} recorded no call in a logged step although their parameters "
        "have gradients: their forward hooks never ran, so they have no activation/* or gradient/* statistics "
        "(their param_grad/* are logged). A module runs no hooks when its weights are used functionally by "
        "another (nn.MultiheadAttention's out_proj), when its forward is called directly (self.forward(x), "
        "as forward-forward layers train), or when it was not called in that step; call the module itself "
        "(layer(x), not layer.forward(x)) to record it, or leave it out of modules= to silence this",
        RuntimeWarning,
        stacklevel=6,
    )
