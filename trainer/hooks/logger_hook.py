"""Writes metrics to the console, the text log and TensorBoard."""

import datetime
import logging
import time

import torch

from ..distributed import is_main_process
from .hookbase import HookBase, Priority

logger = logging.getLogger(__name__)


class LoggerHook(HookBase):
    """Every ``period`` iterations, logs one line (progress, ETA, losses, LR, data and iteration
    time, peak CUDA memory) to the console and ``work_dir/log.txt``, and writes every metric to
    TensorBoard under ``trainer.tb_log_dir`` (rank 0 only).

    The ETA divides the wall time since the previous log line by the iterations it covered, so
    evaluation and checkpointing are counted in it.

    Args:
        period: Iterations between log lines.

    Example::

        >>> hook = LoggerHook(period=20)  # the Trainer registers one with log_period
    """

    priority = Priority.LOGGER

    def __init__(self, period: int = 50) -> None:
        self._period = period
        self._writer = None
        self._written: dict[str, int] = {}  # metric -> values already sent to TensorBoard
        self._printed: dict[str, int] = {}  # metric -> values already shown on the console
        self._last_time = 0.0
        self._last_iter = 0
        self._train_start = 0.0

    def before_train(self) -> None:
        """Open the TensorBoard writer and start the clocks."""
        if is_main_process():
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.trainer.tb_log_dir)
        self._train_start = self._last_time = time.perf_counter()
        self._last_iter = self.trainer.start_iter

    def after_iter(self) -> None:
        """Log at every ``period``-th and at the last iteration."""
        if self.every_n_iters(self._period) or self.is_last_iter():
            self._write_console()
            self._write_tensorboard()

    def after_epoch(self) -> None:
        """Send what other hooks logged at the epoch's end (e.g. evaluation) to TensorBoard."""
        self._write_tensorboard()

    def after_train(self) -> None:
        """Flush and close the TensorBoard writer; log the total time."""
        try:
            self._write_tensorboard()
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        total = datetime.timedelta(seconds=int(time.perf_counter() - self._train_start))
        logger.info(f"Training ran for {total} (up to iteration {self.trainer.cur_iter + 1}).")

    def _new_values(self, seen: dict[str, int]) -> dict[str, float]:
        storage = self.trainer.metric_storage
        fresh = {}
        for name, (_, value) in storage.values_maybe_smooth.items():
            if storage[name].count > seen.get(name, 0):
                seen[name] = storage[name].count
                fresh[name] = value
        return fresh

    def _write_console(self) -> None:
        trainer = self.trainer
        now = time.perf_counter()
        done = trainer.cur_iter + 1
        seconds_per_iter = (now - self._last_time) / max(done - self._last_iter, 1)
        self._last_time, self._last_iter = now, done
        eta = datetime.timedelta(seconds=int(seconds_per_iter * (trainer.max_iters - done)))
        values = self._new_values(self._printed)
        parts = [
            f"epoch {trainer.cur_epoch + 1}/{trainer.max_epochs}"
            f" [{trainer.inner_iter + 1}/{trainer.epoch_iters}]",
            f"iter {done}/{trainer.max_iters}",
            f"ETA {eta}",
        ]
        if "lr" in values:
            parts.append(f"lr {values.pop('lr'):.4g}")
        parts += [f"{name} {value:.4g}" for name, value in values.items()]
        if trainer.device.type == "cuda":
            # reads the allocator's counters: no device sync
            peak = torch.cuda.max_memory_allocated(trainer.device) / 2**20
            parts.append(f"max_mem {peak:.0f}M")
        logger.info("  ".join(parts))

    def _write_tensorboard(self) -> None:
        if self._writer is None:
            return
        storage = self.trainer.metric_storage
        for name, value in self._new_values(self._written).items():
            self._writer.add_scalar(name, value, storage.latest_iter(name))
        # No flush here: the writer flushes on its own timer (flush_secs) and on close.
