"""Lightning: ``HookLoggerCallback`` attaches a ``HookLogger`` to the ``LightningModule`` being fit.

>>> trainer = lightning.pytorch.Trainer(callbacks=[HookLoggerCallback(modules=["encoder.*"])])  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .._compat import event_file_writer, writer_closed
from ..errors import HookLoggerError
from ..logger import HookLogger
from ..options import WatchOptions, callback_signature
from ._common import advance, check_options, grad_scaler, missing_framework

try:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.utilities import rank_zero_info
except ImportError as error:
    raise missing_framework("lightning", error) from None


class HookLoggerCallback(pl.Callback):
    """Log the module's statistics into the Trainer's TensorBoard run, indexed by ``trainer.global_step``.

    Takes every ``HookLogger`` option except ``writer``, ``log_dir``, ``optimizer``, ``scaler`` and
    ``start_step``, which come from the Trainer: the experiment of its ``TensorBoardLogger`` (else a
    writer in ``trainer.log_dir``), its one optimizer, the precision plugin's ``GradScaler`` and
    ``trainer.global_step``. ``every`` defaults to ``trainer.log_every_n_steps``. With ``spikes=``,
    each step's loss is the ``training_step`` output's (the tensor, or its ``"loss"``); under
    ``accumulate_grad_batches``, the mean of those of the step's micro-batches (the loss whose
    gradient the optimizer applies). Attaches when
    training starts (after a checkpoint is restored, so a resumed run continues its step numbers),
    closes at fit end and on exceptions. A ``fit`` after another stage on the same Trainer
    (``validate``, ``lr_find``, an earlier ``fit``) writes into the same run: Lightning closes its
    writer at the end of each stage, and the callback opens it again, as Lightning's next write
    would. Under ``fast_dev_run`` Lightning logs nothing, and neither does the callback.

    Args:
        **options: ``HookLogger`` options other than those the Trainer supplies: the fields of
            :class:`~tblog_hooks.options.WatchOptions` (the signature is made
            from them), e.g. ``modules=["encoder.*"]``, ``every=50``.

    Raises:
        HookLoggerError: at construction, for an option the Trainer supplies or a name that is no
            option, or a bad value; when training starts, for a Trainer with more than one optimizer.
    """

    @callback_signature(WatchOptions, every="trainer.log_every_n_steps")
    def __init__(self, **options: Any) -> None:
        check_options(options, "Lightning's Trainer")
        self.options = options
        self.hooks: HookLogger | None = None
        self._losses: list[Tensor] = []  # the training_step losses of the micro-batches since the last step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise HookLoggerError(
                f"HookLoggerCallback needs exactly one optimizer (its steps are the logged steps), the Trainer has "
                f"{len(trainer.optimizers)}; with several, use tblog_hooks.HookLogger in the LightningModule"
            )
        log_dir = trainer.log_dir  # (a collective: every rank asks)
        if log_dir is None:  # fast_dev_run: Lightning writes nothing
            rank_zero_info(
                "HookLoggerCallback: Lightning logs nothing in this run (fast_dev_run), nor does this callback"
            )
            return
        target: dict[str, Any] = {}
        if trainer.is_global_zero:  # other ranks write nothing (HookLogger makes no writer there either)
            tensorboard = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
            target = {"log_dir": log_dir} if tensorboard is None else {"writer": _opened(tensorboard)}
        every: int = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set at runtime by Lightning
        self.hooks = HookLogger(
            pl_module,
            optimizer=trainer.optimizers[0],
            scaler=grad_scaler(trainer.precision_plugin),
            **{"every": every, **self.options, **target},
        )
        advance(self.hooks, trainer.global_step)  # (a resumed run continues its step numbers)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Called for every batch; under accumulate_grad_batches only some of them step the optimizer.
        if self.hooks is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if self.options.get("spikes") and isinstance(loss, Tensor):
            # Lightning hands on the training_step loss divided by accumulate_grad_batches.
            self._losses.append(loss.detach() * trainer.accumulate_grad_batches)
        if trainer.global_step > self.hooks.global_step:  # this batch stepped the optimizer
            losses, self._losses = self._losses, []
            mean = None if not losses else losses[0] if len(losses) == 1 else torch.stack(losses).mean()
            advance(self.hooks, trainer.global_step, mean)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Write what is pending and remove every hook (done at fit end; safe to call again)."""
        if self.hooks is not None:
            self.hooks.close()
            self.hooks = None
        self._losses = []


def _opened(logger: TensorBoardLogger) -> Any:
    """The logger's ``SummaryWriter``, open: Lightning closes it at the end of each stage
    (``validate``, ``fit``, ``lr_find``) and relies on the next write to open a new event file;
    the callback opens it now, as that write would."""
    writer = logger.experiment
    if writer_closed(writer):
        event_file_writer(writer)
    return writer
