"""Every step's gradient norms, read where the optimizer steps and brought to the host without a sync.

An optimizer step pre-hook (``register_optimizer_step_pre_hook``: every ``torch.optim``
optimizer, after gradient accumulation, DDP averaging and ``GradScaler.unscale_``; the post-hook
for an optimizer given a closure, which computes the gradients inside its step) takes the
norms of the model's gradients that optimizer steps in one multi-tensor op, and adds their
squares up per watched module on the device, those of parameters no watched module owns in one
slot of their own (they count in the step's norm, which is the whole model's), in a fixed
handful of ops, whatever the number of parameters. At ``step()`` the per-module squares, their
total and the loss go to a host ring of the last ``steps`` steps with one non-blocking copy; a
row is read once its copy is complete: on the CPU at once, on CUDA when its event says so (at a
later ``step()``). A step whose gradients were not read (no optimizer stepped, or a fused
optimizer's step the ``GradScaler`` skipped) has negative squares, :data:`NOT_READ`; non-finite
ones are the gradients' own.

FSDP2 (and tensor-parallel) gradients are ``DTensor`` pieces: their squares are summed over the
mesh dims each gradient is sharded on (``topology.sharding.Split``; a ``RowwiseParallel``
embedding's gradient is ``Replicate`` where its parameter is ``Shard(0)``), one ``all_reduce`` of ``modules + 1``
floats per group of such dims per step, on every rank, in ``step()`` (never in a hook: a rank whose
hook failed still takes part). Gradients placed ``Partial`` (a sequence-parallel norm's) are left
out of the per-step norms, said once: only a collective of the whole gradient could add them up.

Which collectives a step makes is fixed when the logger is made, alike on every rank: the
shard groups of the model's parameters as they are then. A model sharded after that (the logger
made before ``fully_shard`` or ``parallelize_llama``) adds none: the norms are switched off on the
rank that reads them, which alone would otherwise enter a collective the others never make.
A parameter two optimizers step in one step (torchtitan's ``OptimizersContainer``, itself an
optimizer, steps the optimizers it holds) is counted once.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from .._compat import context_parallel_mesh, grad_scale, in_backward, pipeline_pass, step_closure
from ..errors import HookLoggerError
from ..stats.reductions import loggable, stacked_norms
from ..topology.sharding import is_dtensor, is_partial, local
from ..transport.distributed import collective_device, rank_and_world
from .watched import Watched, _Hook

Groups = tuple[dist.ProcessGroup, ...]
#: The squares of a step whose gradients were not read (squares are never negative).
NOT_READ = -1.0


class StepNorms:
    """The optimizer step pre-hook and the host ring of per-step norms and losses."""

    def __init__(
        self,
        watched: Watched,
        modules: Sequence[str],
        steps: int,
        *,
        over_ranks: bool = False,
        first: int = 0,
        divisor: Callable[[], float] = lambda: 1.0,
    ) -> None:
        """``over_ranks`` (``reduce_ranks=True`` over several ranks): each step's samples are summed
        over the ranks, those of the first rank of each tensor-parallel group (``first``, its global
        rank), and so are their losses (:meth:`_pooled`), divided by ``divisor()`` (what the
        data-parallel reduction divides the summed gradients by, ``distributed.gradient_divisor``):
        the loss whose gradients the optimizer applies."""
        self.watched, self.modules, self.steps = watched, tuple(modules), steps
        self._width = len(self.modules) + 1  # squares per watched module, then the other parameters'
        self._over_ranks, self._first, self._divisor = over_ranks, first, divisor
        # id(parameter) -> (slot: group-set index * width + module index, parameter, whether it is a
        # DTensor, whose gradient is one too); None: look up again.
        self._owners: dict[int, tuple[int, Tensor, bool]] | None = None
        # Shard groups of sharded parameters by their Split's key (alike on every rank), in the order
        # found; a parameter's slot is in block 1 + that position (block 0: not sharded).
        self._group_sets = _group_sets(watched)
        self._indices: dict[tuple[int, ...], Tensor] = {}  # device index tensors by their slots
        self._stepped: dict[int, Tensor] = {}  # id(optimizer) -> its per-module squares this step
        self._read_now: set[int] = set()  # id(parameter) of the gradients read this step
        self._device = torch.device("cpu")  # of the squares
        self._after: set[int] = set()  # optimizers stepping with a closure: read after their step
        self._ring = Ring(steps, self._width)
        self.failed = False
        self._partial_warned = False

    def refresh(self) -> None:
        """Look the parameters up again at the next optimizer step (replaced, unfrozen ones)."""
        self._owners = None

    def pre(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook: this optimizer's watched gradients, squared and summed per module;
        with a closure (LBFGS, Lightning), which computes them inside ``step()``, after it instead."""
        if step_closure(args, kwargs) is None:
            self._read(optimizer)
        else:
            self._after.add(id(optimizer))

    def post(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step post-hook: read the gradients a closure computed."""
        if id(optimizer) in self._after:
            self._after.discard(id(optimizer))
            self._read(optimizer)

    def _read(self, optimizer: Optimizer) -> None:
        if self.failed:
            return
        try:
            owners = self._owners if self._owners is not None else self._look_up()
            grads, slots, partial = [], [], []
            for group in optimizer.param_groups:
                for p in group["params"]:
                    entry = owners.get(id(p))
                    if entry is None or id(p) in self._read_now or not loggable(g := p.grad):
                        continue
                    self._read_now.add(id(p))
                    slot = entry[0]
                    if entry[2]:  # (no DTensor check per plain parameter and step)
                        if is_partial(g):
                            partial.append(p)
                            continue
                        if g.placements != p.placements:  # (a RowwiseParallel embedding's: Replicate)
                            slot = self._placed_as(g, slot)
                        g = g.to_local()
                    grads.append(g)
                    slots.append(slot)
            if partial:
                self._say_partial(partial)
            if grads:
                scale = grad_scale(optimizer)
                squares = self._squares(grads, tuple(slots), scale)
                if scale is not None:  # a step the scaler skips runs (on inf gradients): not read
                    squares = squares.where(optimizer.found_inf.to(squares.device) == 0, NOT_READ)  # type: ignore[attr-defined]
                self._stepped[id(optimizer)] = squares
        except Exception as error:  # the logger must never stop training
            self._fail(error)

    def end_step(self, step: int, loss: Tensor | float | None, samples: int | None) -> bool:
        """The step's squares (summed over ranks), ``loss`` and ``samples`` (over ranks with
        ``over_ranks``) into the ring (one non-blocking copy per device); nothing read.
        Whether a row was queued: none without squares or a loss (nothing to judge)."""
        sums, (total, counted) = self._combined(), self._pooled(loss, samples)
        if self.failed or (sums is None and loss is None):
            return False
        try:
            self._ring.put(step, sums, total, counted)
        except Exception as error:
            self._fail(error)
            return False
        return True

    def drop(self, loss: Tensor | float | None, samples: int | None) -> None:
        """The step's squares, loss and samples summed over ranks, and forgotten (a rank that does not write)."""
        self._combined()
        self._pooled(loss, samples)

    def _pooled(
        self, loss: Tensor | float | None, samples: int | None
    ) -> tuple[Tensor | float | None, Tensor | int | None]:
        """``loss`` (made whole, :func:`whole_loss`) and ``samples``, or with ``over_ranks`` those of
        the step over every rank: one ``all_gather`` of four values a rank, on every rank at each
        step, failed or not (the other ranks make it too); nothing read.

        Samples are counted on the first rank of each tensor-parallel group. A loss counts once
        where ranks hold copies of it and on each rank where they hold terms of it: of the ranks
        that may hold a copy of one rank's loss (its tensor-parallel group for a plain loss, which
        holds copies where the model's output is ``Replicate`` and terms where the ranks compute
        the loss of their pieces; the ranks of its mesh for a ``DTensor`` loss, made whole), that
        rank's counts alone where they are all equal, else each. Their sum is divided by ``divisor()``
        (NaN where no rank gave a loss)."""
        mine = _held_by(loss, self._first)
        loss = whole_loss(loss)
        if not self._over_ranks:
            return loss, samples
        try:
            device = collective_device()
            row = torch.zeros(4, dtype=torch.float64, device=device)
            # (filled on the device, the loss added there: no copy, nothing read)
            counts = self._first == dist.get_rank()
            row[0], row[2], row[3] = float(samples or 0) * counts, float(loss is not None), mine
            row[1] = loss.detach().reshape(()) if isinstance(loss, Tensor) else (loss or 0.0)
            gathered = [torch.empty_like(row) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, row)
            rows = torch.stack(gathered)
        except Exception as error:  # a broken process group: no collective from now on
            self._over_ranks = False
            self._fail(error)
            return None, None
        total = torch.where(rows[:, 2].sum() > 0, _once_each(rows[:, 1], rows[:, 3].long()) / self._divisor(), math.nan)
        return (total.reshape(1) if loss is not None else None), rows[:, 0].sum().reshape(1)

    def _combined(self) -> Tensor | None:
        """The step's per-module squares, over every optimizer that stepped and, for sharded
        parameters, over the ranks holding their other pieces: the collectives every rank makes
        at each step once the model's parameters are known to be sharded, whatever it read."""
        stepped, self._stepped = list(self._stepped.values()), {}
        self._read_now.clear()
        if not self._group_sets:
            return (
                None if not stepped else stepped[0] if len(stepped) == 1 else torch.stack(on_one_device(stepped)).sum(0)
            )
        blocks = 1 + len(self._group_sets)
        try:
            if stepped:
                rows = torch.stack(on_one_device(stepped)).sum(0).view(blocks, self._width)
            else:  # (this rank stepped nothing it watches, or stopped watching: it joins with zeros)
                rows = torch.zeros(blocks, self._width, dtype=torch.float64, device=self._device)
            for block, groups in enumerate(self._group_sets.values(), 1):
                for group in groups:
                    dist.all_reduce(rows[block], group=group)
        except Exception as error:
            self._fail(error)
            self._group_sets.clear()  # a broken process group: no collective from now on
            return None
        return None if self.failed or not stepped else rows.sum(0)

    def take(self, *, wait: bool) -> list[tuple[int, np.ndarray, bool]]:
        """Rows whose copy is complete, in step order (with ``wait``: all), as ``(step, row, loss
        given)``: ``[squared norm per module..., of the other parameters, loss, samples]``,
        :data:`NOT_READ` squares where the step's gradients were not read, a NaN loss where none
        was given, 0 or NaN samples where none were counted."""
        return self._ring.take(wait=wait)

    # -- internals ---------------------------------------------------------------------------
    def _look_up(self) -> dict[int, tuple[int, Tensor, bool]]:
        """Map each parameter of the model to its slot: its watched module's, else the others'."""
        index = {m: i for i, m in enumerate(self.modules)}
        others = len(self.modules)
        world = rank_and_world()[1]
        owners: dict[int, tuple[int, Tensor, bool]] = {}
        slotted = [(index[module], p) for module, _, p in self.watched.owned()]
        for slot, p in slotted + [(others, p) for _, p in self.watched.others()]:
            block, split = 0, local(p)[1] if world > 1 else None
            if split is not None:
                if split.key not in self._group_sets:
                    raise HookLoggerError(SHARDED_LATE)
                block = 1 + list(self._group_sets).index(split.key)
            owners[id(p)] = (block * self._width + slot, p, is_dtensor(p))
        self._owners = owners
        self._indices.clear()
        return owners

    def _placed_as(self, grad: Tensor, slot: int) -> int:
        """The slot of a gradient placed otherwise than its parameter: its squares are summed
        over the mesh dims the gradient is sharded on. Raises ``ValueError`` for dims no parameter
        is sharded on (the ranks' collectives are fixed when the parameters are looked up)."""
        split = local(grad)[1]
        module = slot % self._width
        if split is None:
            return module
        if split.key not in self._group_sets:
            raise ValueError(f"a gradient is sharded on mesh dims {split.dims}, which no parameter is sharded on")
        return (1 + list(self._group_sets).index(split.key)) * self._width + module

    def _squares(self, grads: list[Tensor], slots: tuple[int, ...], scale: Tensor | None) -> Tensor:
        """Per-module sums of the squared gradient norms, and the other parameters' (over the shard
        groups too), on the device."""
        with torch.no_grad():
            squares = stacked_norms(grads).square()
            device = squares.device
            index = self._indices.get(slots)
            if index is None:
                index = self._indices[slots] = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
            self._device = device
            sums = squares.new_zeros((1 + len(self._group_sets)) * self._width).index_add_(0, index, squares)
            if scale is not None:  # a fused optimizer's gradients, still scaled
                sums = sums / scale.to(device).reshape(()).double().square()
            return sums

    def _say_partial(self, partial: list[Tensor]) -> None:
        if self._partial_warned:
            return
        self._partial_warned = True
        names = {id(p): key for key, p in self.watched.all_params()}
        warnings.warn(
            f"tblog_hooks: the per-step gradient norms (spikes=) leave out {len(partial)} parameter(s) whose gradients "
            f"are placed Partial ({', '.join(repr(names.get(id(p), '?')) for p in partial[:3])}, a sequence-parallel "
            "norm's): only a collective of the whole gradient could add their terms up (the logged steps' "
            "param_grad/* include them)",
            RuntimeWarning,
            stacklevel=3,
        )

    def _fail(self, error: BaseException) -> None:
        self.failed = True
        self._stepped.clear()
        warnings.warn(
            f"tblog_hooks: reading the per-step gradient norms failed, so spikes are no longer watched "
            f"(training continues): {type(error).__name__}: {error}",
            RuntimeWarning,
            stacklevel=3,
        )


def _group_sets(watched: Watched) -> dict[tuple[object, ...], Groups]:
    """The shard groups of the model's parameters split over ranks, by their ``Split``'s key (alike
    on every rank), in the order found: the collectives of every step, fixed when the logger is made."""
    found: dict[tuple[object, ...], Groups] = {}
    if rank_and_world()[1] > 1:
        for _, p in watched.all_params():
            split = local(p)[1]
            if split is not None:
                found.setdefault(split.key, split.groups)
    return found


#: Why the per-step norms stop on a model sharded after the logger was made.
SHARDED_LATE = (
    "the model was sharded (fully_shard, parallelize_module, torchtitan's parallelize) after the HookLogger was "
    "created, so the gradient norms would be this rank's pieces, and adding them up would take collectives the "
    "other ranks do not make; create the HookLogger after sharding the model"
)


class Ring:
    """The host ring of the last ``steps`` rows ``[squared norm per module..., loss, samples]``, each
    filled by one non-blocking copy per device and read once its copy is complete."""

    def __init__(self, steps: int, modules: int) -> None:
        self.steps, self.modules = steps, modules
        self._host: Tensor | None = None  # [steps, modules + 2] float64, pinned on CUDA
        self._rows: np.ndarray | None = None  # the same memory, written on the host without an op
        self._pinned = False
        # (step, row, the copies' events (none on the CPU), whether a loss was given)
        self._pending: deque[tuple[int, int, tuple[torch.cuda.Event, ...], bool]] = deque()
        self._done: list[tuple[int, np.ndarray, bool]] = []
        self._next_row = 0

    def put(self, step: int, sums: Tensor | None, loss: Tensor | float | None, samples: Tensor | int | None) -> None:
        """A step's row into the ring: ``sums`` (:data:`NOT_READ` where ``None``), ``loss`` and ``samples``
        (NaN where ``None``), device values copied without blocking, in runs of neighbours on one device."""
        parts = ((sums, self.modules, NOT_READ), (loss, 1, math.nan), (samples, 1, math.nan))
        tensors = [t for t, _, _ in parts if isinstance(t, Tensor)]
        cuda = any(t.device.type == "cuda" for t in tensors)
        if self._host is None or (cuda and not self._pinned):
            # Pinned once a CUDA tensor comes (a first step without an optimizer step has none):
            # a copy into pageable memory blocks.
            ring = torch.empty((self.steps, self.modules + 2), dtype=torch.float64, pin_memory=cuda)
            if self._host is not None:
                ring.copy_(self._host)  # (rows of CPU values: their copies are done)
            self._host, self._rows, self._pinned = ring, ring.numpy(), cuda
        if len(self._pending) == self.steps:
            self._read_oldest()  # a row still in flight after `steps` steps: wait for it
        row, self._next_row = self._next_row, (self._next_row + 1) % self.steps
        host, values = self._host[row], self._rows[row]  # type: ignore[index]
        runs: list[tuple[int, list[Tensor]]] = []
        at = 0
        for value, width, missing in parts:
            if not isinstance(value, Tensor):
                values[at : at + width] = missing if value is None else float(value)
            elif runs and runs[-1][1][-1].device == value.device and runs[-1][0] + _length(runs[-1][1]) == at:
                runs[-1][1].append(value)
            else:
                runs.append((at, [value]))
            at += width
        with torch.no_grad():
            for start, run in runs:
                flat = [t if t.dim() == 1 else t.reshape(1) for t in run]  # (the squares, or one value)
                source = flat[0] if len(flat) == 1 else torch.cat(flat)
                host[start : start + source.numel()].copy_(source, non_blocking=True)
        self._pending.append((step, row, _events(*tensors), loss is not None))

    def _read_oldest(self) -> None:
        step, row, events, given = self._pending.popleft()
        for event in events:
            event.synchronize()
        self._done.append((step, self._host[row].numpy().copy(), given))  # type: ignore[index]

    def take(self, *, wait: bool) -> list[tuple[int, np.ndarray, bool]]:
        """The rows whose copy is complete (with ``wait``: all), in step order."""
        while self._pending and (wait or all(event.query() for event in self._pending[0][2])):
            self._read_oldest()
        done, self._done = self._done, []
        return done


class Samples(_Hook):
    """The model's forward pre-hook: the samples of a step's training passes, the first dim of
    each call's first tensor argument (shape metadata, nothing read from the device); of a
    ``DTensor`` (torchtitan's ``full_dtensor`` batch, split over the data-parallel ranks), this
    rank's piece's, as a plain batch is this rank's. Under context parallelism the ranks of its
    mesh each hold a shard of the sequence of the same samples: counted on its first rank only.
    Under a pipeline schedule the microbatches are counted by the first stage (the later stages
    run the same samples), its shape inference not at all."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()) or in_backward():
            return
        piped = pipeline_pass()
        if piped is not None and (piped.inference or 0 not in piped.stages):
            return
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        sequence = context_parallel_mesh()
        if first is not None and first.dim() > 0 and (sequence is None or sequence.get_local_rank() == 0):
            self.count += (first.to_local() if is_dtensor(first) else first).shape[0]

    def rewinder(self) -> Callable[[], None]:
        """Sets the count back to what it is now: a closure optimizer's evaluations of one step
        (LBFGS's) are one batch, not micro-batches (``OptimizerSteps.every_step``)."""
        start = self.count

        def rewind() -> None:
            self.count = start

        return rewind

    def take(self) -> int | None:
        """The step's samples (``None``: no training pass of the model seen), and start again."""
        count, self.count = self.count, 0
        return count or None


def on_one_device(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` on the first one's device (a model over several GPUs has its norms on each),
    copied without a sync; the list itself when they are all there."""
    device = tensors[0].device
    if all(t.device == device for t in tensors):
        return tensors
    return [t.to(device, non_blocking=True) for t in tensors]


def any_split(watched: Watched) -> bool:
    """Whether a parameter of the model is a ``DTensor`` of several ranks (its norm needs a collective)."""
    return rank_and_world()[1] > 1 and any(is_dtensor(p) for _, p in watched.all_params())


def _length(tensors: list[Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def _events(*tensors: Tensor | float | None) -> tuple[torch.cuda.Event, ...]:
    """An event after the copies just queued from ``tensors``, one per CUDA device they are on
    (a loss on another GPU than the norms is copied on that GPU's stream); none on the CPU,
    where those copies are done."""
    devices = {t.device for t in tensors if isinstance(t, Tensor) and t.device.type == "cuda"}
    events = []
    for device in sorted(devices, key=str):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        events.append(event)
    return tuple(events)


def check_loss(loss: object) -> Tensor | float | None:
    """``loss`` as ``step(loss=...)`` takes it: a one-element tensor, a Python or NumPy number
    (as a float), or ``None``; else ``HookLoggerError``."""
    if loss is None or (isinstance(loss, (int, float, np.floating)) and not isinstance(loss, bool)):
        return None if loss is None else float(loss)
    if isinstance(loss, Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    what = repr(loss) if not isinstance(loss, Tensor) else f"a tensor of shape {tuple(loss.shape)}, {loss.dtype}"
    raise HookLoggerError(
        f"step(loss=...) takes the step's loss as a one-element floating-point tensor (or a number), got {what}"
    )


def _held_by(loss: Tensor | float | None, first: int) -> int:
    """The global rank whose loss this rank's may be a copy of (see ``StepNorms._pooled``): of a
    ``DTensor`` loss the first rank of its mesh, else ``first`` (of this rank's tensor-parallel group)."""
    return int(loss.device_mesh.mesh.reshape(-1)[0]) if is_dtensor(loss) else first


def _once_each(losses: Tensor, held_by: Tensor) -> Tensor:
    """The sum of ``losses`` (one a rank) counting copies once: where the ranks ``held_by`` the
    same rank all hold its value, that rank's alone; where any differs, each (terms of a sum)."""
    differs = (losses != losses[held_by]).double()
    anywhere = torch.zeros_like(losses).index_reduce_(0, held_by, differs, "amax")
    counted = (held_by == torch.arange(len(losses), device=losses.device)) | (anywhere[held_by] > 0)
    return (losses * counted).sum()


def whole_loss(loss: Tensor | float | None) -> Tensor | float | None:
    """The loss as one process has it: a ``DTensor`` loss (loss parallelism's, ``Replicate``) as its
    full value; called on every rank at its ``step()``, since a ``Partial`` one's takes a collective."""
    return loss.full_tensor() if is_dtensor(loss) else loss
