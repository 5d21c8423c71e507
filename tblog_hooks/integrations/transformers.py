"""Hugging Face ``Trainer``: ``HookLoggerCallback`` attaches a ``HookLogger`` to the model it trains.

>>> trainer = transformers.Trainer(model, args, callbacks=[HookLoggerCallback(modules=["*.attn"])])  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..logger import HookLogger
from ..options import WatchOptions, callback_signature
from ._common import advance, check_options, grad_scaler, missing_framework

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
    from transformers.integrations.integration_utils import TensorBoardCallback, default_logdir
    from transformers.trainer_callback import CallbackHandler
except ImportError as error:
    raise missing_framework("transformers", error) from None


class HookLoggerCallback(TrainerCallback):
    """Log the model's statistics into the Trainer's TensorBoard run, indexed by ``state.global_step``.

    Takes every ``HookLogger`` option except ``writer``, ``log_dir``, ``optimizer``, ``scaler`` and
    ``start_step``, which come from the Trainer: the run directory of its ``TensorBoardCallback``,
    its optimizer, accelerate's ``GradScaler`` and its step count. ``every`` defaults to
    ``logging_steps``. With ``spikes=``, each step's loss is the Trainer's own (its ``train/loss``
    with ``logging_steps=1``), from the ``loss`` of the model's outputs in the step's training
    forward passes: under gradient accumulation their mean, or their sum when the Trainer passed the
    model ``num_items_in_batch`` (a model taking loss keywords divides by the items of the whole
    step). Attaches at train begin, closes at train end (or, after an exception, at the
    next train begin or :meth:`close`).

    Args:
        **options: ``HookLogger`` options other than those the Trainer supplies: the fields of
            :class:`~tblog_hooks.options.WatchOptions` (the signature is made
            from them), e.g. ``modules=["*.attn"]``, ``every=50``.

    Raises:
        HookLoggerError: at construction, for an option the Trainer supplies or a name that is no
            option, or a bad value.
    """

    @callback_signature(WatchOptions, every="args.logging_steps")
    def __init__(self, **options: Any) -> None:
        check_options(options, "the Hugging Face Trainer")
        self.options = options
        self.hooks: HookLogger | None = None
        # The model's output losses of the step's training forward passes, and whether the Trainer
        # passed num_items_in_batch (spikes=).
        self._losses: list[Tensor] = []
        self._per_item = False
        self._loss_hook: RemovableHandle | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()  # a logger left by an earlier train() that raised
        optimizer = kwargs["optimizer"]
        self.hooks = HookLogger(
            kwargs["model"],
            log_dir=_tensorboard_dir(args) if state.is_world_process_zero else None,
            # accelerate wraps the optimizer (and holds the scaler); hooks go on the optimizer that steps
            optimizer=getattr(optimizer, "optimizer", optimizer),
            scaler=grad_scaler(optimizer),
            **{"every": int(state.logging_steps), **self.options},  # a float when given as one
        )
        if self.options.get("spikes"):  # a callback is not given the loss: the model's output holds it
            self._loss_hook = kwargs["model"].register_forward_hook(self._keep_loss, with_kwargs=True)
        # The Trainer shows an optimizer step at the global_step it ends with: the first is step 1.
        advance(self.hooks, state.global_step + 1)

    def _keep_loss(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else None
        if module.training and torch.is_grad_enabled() and isinstance(loss, Tensor):
            self._losses.append(loss.detach())
            self._per_item = kwargs.get("num_items_in_batch") is not None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.hooks is not None:
            advance(self.hooks, state.global_step + 1, self._step_loss())

    def _step_loss(self) -> Tensor | None:
        """The step's loss as the Trainer adds it up for ``train/loss``: each micro-batch's loss
        divided by their count, unless the model divided it by the step's ``num_items_in_batch``."""
        losses, self._losses = self._losses, []
        if len(losses) < 2:
            return losses[0] if losses else None
        total = torch.stack(losses).sum()
        return total if self._per_item else total / len(losses)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    def close(self) -> None:
        """Write what is pending and remove every hook (done at train end; safe to call again)."""
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        self._losses = []
        if self.hooks is not None:
            self.hooks.close()
            self.hooks = None


def _tensorboard_dir(args: TrainingArguments) -> str:
    """The run directory of the Trainer's ``TensorBoardCallback`` (``report_to="tensorboard"``), so its
    scalars and ours are one run; without one, where it would write."""
    frame = inspect.currentframe()
    # A callback is not told the Trainer's other callbacks; the CallbackHandler calling it holds them.
    # The TensorBoardCallback comes before user callbacks, so it has chosen its directory by now.
    try:
        while frame is not None:
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler):
                for callback in handler.callbacks:
                    if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
                        return str(callback.tb_writer.log_dir)
                break
            frame = frame.f_back
    finally:
        del frame  # a frame that refers to itself would be a reference cycle
    env = os.environ.get("TENSORBOARD_LOGGING_DIR")
    # output_dir is never None once TrainingArguments.__post_init__ ran
    return os.path.expanduser(env) if env else os.path.join(str(args.output_dir), default_logdir())
