"""Hugging Face ``Trainer``: ``HookLoggerCallback`` attaches a ``HookLogger`` to the model it trains.

>>> trainer = transformers.Trainer(model, args, callbacks=[HookLoggerCallback(modules=["*.attn"])])  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..logger import HookLogger
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
    ``logging_steps``. With ``spikes=``, each step's loss is the ``loss`` of the model's output in its
    last training forward pass (the last micro-batch's, before the Trainer divides it for gradient
    accumulation). Attaches at train begin, closes at train end (or, after an exception, at the
    next train begin or :meth:`close`).

    Args:
        **options: ``HookLogger`` options (see :class:`~tblog_hooks.options.Options`) other than
            those the Trainer supplies, e.g. ``modules=["*.attn"]``, ``every=50``.

    Raises:
        HookLoggerError: at construction, for an option the Trainer supplies or a name that is no
            option.
    """

    def __init__(self, **options: Any) -> None:
        check_options(options, "the Hugging Face Trainer")
        self.options = options
        self.hooks: HookLogger | None = None
        self._loss: Tensor | None = None  # of the latest training forward pass (spikes=)
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
            self._loss_hook = kwargs["model"].register_forward_hook(self._keep_loss)
        # The Trainer shows an optimizer step at the global_step it ends with: the first is step 1.
        advance(self.hooks, state.global_step + 1)

    def _keep_loss(self, module: nn.Module, args: Any, output: Any) -> None:
        loss = output.get("loss") if isinstance(output, Mapping) else None
        if module.training and isinstance(loss, Tensor):
            self._loss = loss.detach()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.hooks is not None:
            loss, self._loss = self._loss, None
            advance(self.hooks, state.global_step + 1, loss)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    def close(self) -> None:
        """Write what is pending and remove every hook (done at train end; safe to call again)."""
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = self._loss = None
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
