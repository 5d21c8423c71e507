"""Parameters: each watched parameter's gradient once it is final, the weights' histograms at
the end of a logged step, and the update ratio of the optimizer step.

Gradients are read either when the backward that made them ends (``optimizer=None``: a
post-accumulate-grad hook queues the read) or when an optimizer steps them (:class:`OptimizerHooks`:
after gradient accumulation, DDP averaging and ``GradScaler.unscale_``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._compat import (
    at_end_of_backward,
    foreach_copy,
    foreach_div,
    foreach_sub_,
    grad_scale,
    loss_scale,
    step_closure,
    unscaled,
    version,
)
from ..stats.binning import Sample
from ..stats.kinds import SUM
from ..stats.packing import Record
from ..stats.recipe import Source
from ..stats.reductions import FLOAT_DTYPES, loggable, norms, sparse_values
from ..stats.tags import Root
from ..topology.sharding import Pending, Split, TermsOf, local, pending
from .step import Part, StepBuffer
from .watched import Watched

#: The names under which failures of these parts are reported (and they stop).

Named = list[tuple[str, Tensor]]


class ParameterRecorder:
    """Records ``param_grad/*``, ``param/update_ratio/*`` and weight histograms of a logged step."""

    def __init__(self, buffer: StepBuffer, *, numerics: bool = False) -> None:
        """``numerics``: also record ``numerics=``'s statistics of the gradients."""
        self.buffer = buffer
        recipe = buffer.recipe
        self._kind, self._update = recipe[Source.PARAM_GRAD], recipe[Source.UPDATE]
        self._term = recipe[Source.UNWATCHED_PARAM_GRAD]
        self._unwatched: frozenset[str] = frozenset()  # keys of parameters no watched module owns
        self._numerics = recipe.numerics.get(Source.PARAM_GRAD) if numerics else None
        # Parameters whose gradient was read this step: its record and histogram sample, and with
        # numerics= (of a dense gradient read at the loss scale it was made at, or unscaled) that record.
        self._graded: dict[str, tuple[Record, Sample | None, Record | None]] = {}
        self._pending: dict[str, Pending] = {}  # gradients placed Partial, read this step
        self._ready: Named = []  # parameters whose gradient this backward made final
        # Before an optimizer step: the parameters, their pieces' splits, norms and copies.
        self._before_update: tuple[Named, list[Split | None], list[Tensor], list[Tensor]] | None = None

    def counted(self, watched: Watched) -> Named:
        """The parameters whose gradients a logged step reads, looked up now: the watched
        modules' (``param_grad/*``) and then the model's others, which count in
        ``param_grad/global_norm`` only, so that it is the whole model's (what
        ``clip_grad_norm_(model.parameters())`` computes)."""
        others = watched.others()
        self._unwatched = frozenset(key for key, _ in others)
        return watched.params() + others

    def on_param_grad(self, name: str, param: Tensor) -> None:
        """Post-accumulate-grad hook body: ``param.grad`` is final for this backward. Read when
        the backward ends, with every other parameter it reached: one norm op for all of them.
        Each call queues the reading (the first callback reads them all): one queued only by the
        first would be lost with a backward that raises, and the next backward's with it. Also
        where the records of a compiled forward are copied out of its graph's memory (see
        ``StepBuffer.keep_traced``), should the model have no probe."""
        self.buffer.trained = True
        self.buffer.keep_traced()
        self._ready.append((name, param))
        if not at_end_of_backward(self._read_ready):  # not run by the autograd engine: read it now
            self._read_ready()

    def read(self, named: Named, scale: Tensor | None = None, unscaled: Tensor | None = None) -> None:
        """Record gradient norms (and histograms) of parameters whose ``.grad`` is final; divided
        on the device by ``scale``, the loss scale still in ``.grad`` (see ``_compat.grad_scale``).
        ``unscaled``: the loss scale ``GradScaler.unscale_`` divided them by, which ``numerics=``
        multiplies back (the formats judge a gradient as backward made it).
        Of a ``DTensor`` gradient, this rank's piece, combined with the others' at the end of the
        step (``topology/sharding.py``)."""
        buffer = self.buffer
        try:
            with torch.no_grad():  # (a gradient of create_graph=True backward requires grad)
                off = buffer.disabled_names
                graded = [(key, g) for key, p in named if key not in off and (g := self._gradient(key, p, scale))]
                if not graded:
                    return
                keys = [key for key, _ in graded]
                grads = [g for _, (g, _, _) in graded]
                splits = [split for _, (_, _, split) in graded]
                samples = self._samples(Root.PARAM_GRAD, keys, [h for _, (_, h, _) in graded], splits)
                found = norms(grads)
                buffer.streams.note(found[0])
                if scale is not None:  # a fused optimizer's gradients, still scaled: unscaled here
                    divisor = scale.to(found[0].device).reshape(())
                    found = foreach_div(found, divisor)
                    for row in samples.values():
                        row.sample.div_(divisor)
                # A later read (the next micro-batch's accumulated gradient) replaces an earlier one.
                dense = {key for key, p in named if p.grad is not None and p.grad.layout == torch.strided}
                for key, grad, norm, split in zip(keys, grads, found, splits):
                    watched = key not in self._unwatched
                    record = Record(self._kind if watched else self._term, key, grad.numel(), (norm,), split=split)
                    numeric = self._numeric(key, grad, split, scale, dense, unscaled) if watched else None
                    self._graded[key] = (record, samples.get(key), numeric)
        except Exception as error:
            buffer.fail(named[0][0] if len(named) == 1 else Part.PARAMETERS, error)
            buffer.disabled_names.update(key for key, _ in named)

    def _numeric(
        self,
        key: str,
        grad: Tensor,
        split: Split | None,
        scale: Tensor | None,
        dense: set[str],
        unscaled: Tensor | None,
    ) -> Record | None:
        """``numerics=``'s record of a gradient, at the loss scale backward made it at (an
        ``unscale_`` divided it: multiplied back for the counts, its magnitudes divided again on
        the device); none of a sparse one, nor of one a fused optimizer still holds scaled (its
        norm is unscaled on the device, these would not be). Of a sharded parameter's piece (an
        FSDP2 shard), the piece's, pooled with the other pieces' at the end of the step."""
        kind = self._numerics
        if kind is None or scale is not None or key not in dense:
            return None
        compute = self.buffer.kernels.compute
        if not grad.numel():  # an empty shard (FSDP2 gives a rank none of a small parameter)
            # (one zero's extremes and sums change nothing pooled; its counts are zeroed)
            named = dict(compute((kind,), grad.new_zeros(1), -1))
            for name in (n for f in kind.fields if f.pool is SUM for n in f.names):
                named[name] = named[name].zero_()
            return Record(kind, key, 0, kind.values(named), split=split)
        if unscaled is None:
            return Record.of(kind, key, grad.numel(), compute((kind,), grad, -1), split=split)
        factor = unscaled.to(grad.device).reshape(())
        named = dict(compute((kind,), grad * factor, -1))
        named["amax"], named["ref"] = named["amax"] / factor, named["ref"] / factor  # (sums are relative to ref)
        return Record(kind, key, grad.numel(), kind.values(named), split=split)

    def weights(self, params: Callable[[], Named]) -> None:
        """Histograms of the weights whose gradients this step recorded, as they are at the end
        of the step (after the update). ``params`` looks the watched parameters up: called only
        on a step that takes weight histograms."""
        if not self.graded or not self.buffer.eager.takes_histogram(Root.PARAM):
            return
        named = [(key, local(p)) for key, p in params() if key in self._graded or key in self._pending]
        if not named:
            return
        try:
            with torch.no_grad():
                keys = [key for key, _ in named]
                pieces = [piece for _, (piece, _) in named]
                samples = self._samples(Root.PARAM, keys, pieces, [split for _, (_, split) in named])
                for row in samples.values():
                    self.buffer.eager.add(row)
        except Exception as error:
            self.buffer.fail(Part.PARAMETERS, error)

    def before_update(self, named: Named) -> None:
        """Optimizer step pre-hook: copy the watched weights (logged steps only) to measure the update."""
        named = [(key, p) for key, p in named if key not in self._unwatched]
        if not named:
            return
        try:
            with torch.no_grad():
                pieces = [local(p) for _, p in named]
                weights = [piece for piece, _ in pieces]
                splits = [split for _, split in pieces]
                self._before_update = (named, splits, norms(weights), foreach_copy(weights))
        except Exception as error:
            self.buffer.fail(Part.UPDATE_RATIO, error)

    def after_update(self) -> None:
        """Optimizer step post-hook: ``||W_after - W_before||`` and ``||W_before||`` per parameter
        (their ratio is the update ratio), computed in place in the copy, which is then dropped."""
        if self._before_update is None:
            return
        named, splits, weight_norms, before = self._before_update
        self._before_update = None
        try:
            with torch.no_grad():
                foreach_sub_(before, [local(p)[0] for _, p in named])
                for (key, p), split, change, weight in zip(named, splits, norms(before), weight_norms):
                    self.buffer.eager.add(Record(self._update, key, p.numel(), (change, weight), split=split))
        except Exception as error:
            self.buffer.fail(Part.UPDATE_RATIO, error)

    def end_step(self) -> tuple[list[Record], list[Sample], list[Pending]]:
        """The gradients this logged step read, as records and histogram samples, and those
        still to be reduced over ranks; forgets them."""
        graded, self._graded = self._graded, {}
        waiting, self._pending = list(self._pending.values()), {}
        self._ready, self._before_update = [], None  # (of a backward that raised before its end)
        records = [record for record, _, _ in graded.values()]
        records += [numeric for _, _, numeric in graded.values() if numeric is not None]
        return records, [row for _, row, _ in graded.values() if row is not None], waiting

    def resolve(self, waiting: list[Pending], reduced: list[Tensor]) -> tuple[list[Record], list[Sample]]:
        """Records and histogram samples of gradients placed ``Partial``, from their terms
        ``reduced`` over ranks (``Ranks.finish``)."""
        with torch.no_grad():
            wholes = [p.whole(t) for p, t in zip(waiting, reduced)]
            keys = [p.key for p in waiting]
            found = norms([t for t, _ in wholes])
            records = [
                Record(self._term if k in self._unwatched else self._kind, k, t.numel(), (n,), split=s)
                for k, (t, s), n in zip(keys, wholes, found)
            ]
            samples = self._samples(Root.PARAM_GRAD, keys, [t for t, _ in wholes], [s for _, s in wholes])
        return records, list(samples.values())

    @property
    def graded(self) -> bool:
        """Whether this logged step read any gradient so far."""
        return bool(self._graded or self._pending)

    def _read_ready(self) -> None:
        ready, self._ready = self._ready, []
        if ready:
            self.read(ready)

    def _samples(
        self, kind: str, keys: list[str], tensors: list[Tensor], splits: list[Split | None]
    ) -> dict[str, Sample]:
        """Histogram samples of parameters or their gradients, over the sample's own range (no
        pass over the whole tensor); none on a step without ``kind``, nor of an unwatched parameter
        (:meth:`counted`), nor of an empty tensor unless it is a piece of a split one (an empty
        FSDP2 shard: its empty sample joins the others')."""
        eager = self.buffer.eager
        if not eager.takes_histogram(kind):
            return {}
        taken = [
            (key, t, split)
            for key, t, split in zip(keys, tensors, splits)
            if (t.numel() or split is not None) and key not in self._unwatched
        ]
        sampled = eager.samples([t for _, t, _ in taken])
        return {
            key: Sample(kind, key, s, t.numel(), None, None, split=split) for (key, t, split), s in zip(taken, sampled)
        }

    def _gradient(self, key: str, p: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor, Split | None] | None:
        """A parameter's gradient as dense tensors for its norm and its histogram, and how it is
        split over ranks: this rank's piece of a ``DTensor`` gradient, the summed values of a
        sparse one (``reductions.sparse_values``); ``None`` if it is not logged now: not
        loggable, or placed ``Partial`` (kept as ``Pending``; ``scale`` as for :meth:`read`)."""
        grad = p.grad
        if grad is not None and grad.layout == torch.sparse_coo and grad.dtype in FLOAT_DTYPES:
            return (*sparse_values(grad), None)
        if not loggable(grad):
            return None
        waiting = pending(key, grad, TermsOf.PARAMETER_GRADIENT)  # type: ignore[arg-type]  # loggable: a tensor
        if waiting is not None:  # read once reduced over ranks, at the end of the step
            if scale is not None:
                waiting.terms.div_(scale.to(waiting.terms.device).reshape(()))
            self._pending[key] = waiting
            self._graded.pop(key, None)
            return None
        piece, split = local(grad)  # type: ignore[arg-type]
        self._pending.pop(key, None)
        return piece, piece, split


class OptimizerHooks:
    """Step pre- and post-hook of every optimizer (``register_optimizer_step_pre_hook`` and
    ``_post_hook`` of ``torch.optim.optimizer``): on a logged step, the parameters an optimizer
    steps (:meth:`ParameterRecorder.counted`) are read when it steps them — after gradient accumulation, DDP averaging
    and ``GradScaler.unscale_`` — so each is read by its own optimizer (a GAN's two; one that
    replaced the optimizer given), and one no optimizer steps is not read. The weights are
    copied before the step to measure the update."""

    __slots__ = ("_held", "_params", "_scaler", "_stepped", "_stepping", "parameters", "watched")

    def __init__(
        self, parameters: ParameterRecorder, watched: Watched, scaler: torch.amp.GradScaler | None = None
    ) -> None:
        """``scaler``: the run's ``GradScaler``, whose ``unscale_`` ran before its ``step()`` called
        the optimizer."""
        self.parameters, self.watched, self._scaler = parameters, watched, scaler
        # This logged step's counted parameters by id (``ParameterRecorder.counted``), looked up at its
        # first optimizer step (so parameters replaced just before it are read); None until then and
        # between logged steps.
        self._params: dict[int, tuple[str, Tensor]] | None = None
        self._stepped: set[str] = set()  # keys an optimizer stepped this logged step
        # id(optimizer) -> (its counted parameters, whether to read them after its step), during its step.
        self._stepping: dict[int, tuple[Named, bool]] = {}
        # The watched parameters' gradients when this logged step began, each with its version, by key.
        self._held: dict[str, tuple[weakref.ref[Tensor], int]] = {}

    def pre(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        buffer = self.parameters.buffer
        if not buffer.active or Part.PARAMETERS in buffer.disabled_parts:
            return
        try:
            params = self._params  # one read: another thread's optimizer may run this hook too
            if params is None:
                params = self._params = {id(p): (key, p) for key, p in self.parameters.counted(self.watched)}
            named = [entry for group in optimizer.param_groups for p in group["params"] if (entry := params.get(id(p)))]
            if not named:
                return  # another model's optimizer
            # LBFGS & co. compute gradients inside step(), by calling the closure: read them after it.
            closure = step_closure(args, kwargs)
            if closure is None:
                self._read(named, grad_scale(optimizer), self._unscaled(optimizer))
            self._stepping[id(optimizer)] = (named, closure is not None)
            self.parameters.before_update([(key, p) for key, p in named if p.requires_grad])
        except Exception as error:  # the logger must never stop training
            buffer.fail(Part.PARAMETERS, error)

    def post(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        stepping = self._stepping.pop(id(optimizer), None)
        if stepping is None:
            return
        try:
            named, read_after = stepping
            if read_after:
                self._read(named, None, self._unscaled(optimizer))
            self.parameters.after_update()
        except Exception as error:
            self.parameters.buffer.fail(Part.PARAMETERS, error)

    def _unscaled(self, optimizer: Optimizer) -> Tensor | None:
        """The loss scale the run's ``GradScaler`` divided ``optimizer``'s gradients by
        (``unscale_``, which its ``step()`` calls before the optimizer's), on its device; ``None``
        where it did not."""
        scaler = self._scaler
        if scaler is None or not scaler.is_enabled() or not unscaled(scaler, optimizer):
            return None
        return loss_scale(scaler)

    def _read(self, named: Named, scale: Tensor | None, unscaled: Tensor | None) -> None:
        self.parameters.read(named, scale=scale, unscaled=unscaled)
        self._stepped.update(key for key, _ in named)

    def begin(self) -> None:
        """A logged step begins: note which gradient each watched parameter holds, and its version
        (for :meth:`unstepped`; one Python look per parameter, nothing read on the device)."""
        params = self.watched.params()
        self._held = {key: (weakref.ref(g), version(g)) for key, p in params if (g := p.grad) is not None}

    def unstepped(self) -> list[str]:
        """Watched parameters holding a gradient written this logged step (another gradient than
        at :meth:`begin`, or the same one changed since) that no optimizer stepped; none when
        these hooks failed (nothing was read then). A gradient left from an earlier phase of
        training (a branch no backward reaches now) is not this step's."""
        if Part.PARAMETERS in self.parameters.buffer.disabled_parts:
            return []
        missed = []
        for key, p in self.watched.params():
            grad = p.grad
            if key in self._stepped or not p.requires_grad or grad is None:
                continue
            held = self._held.get(key)
            if held is None or held[0]() is not grad or held[1] != version(grad):
                missed.append(key)
        return missed

    def clear(self) -> None:
        """End of a logged step: hold no parameter or gradient until the next one."""
        self._params, self._stepped, self._held = None, set(), {}
        self._stepping.clear()
