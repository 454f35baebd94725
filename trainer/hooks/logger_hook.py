"""Sends metrics to the console, TensorBoard, a JSON Lines file and any other writers."""

import datetime
import logging
import os
import time
from typing import Optional

from ..distributed import is_main_process
from ..writers import ConsoleWriter, JSONLinesWriter, MetricWriter, TensorBoardWriter
from .hookbase import HookBase, Priority

logger = logging.getLogger(__name__)


class LoggerHook(HookBase):
    """Every ``period`` iterations, writes the new metrics to its writers: the console line
    (progress, ETA, LR, losses, data and iteration time, peak CUDA memory; every rank, to its
    console and log file), and on rank 0 TensorBoard (``trainer.tb_log_dir``), the JSON Lines
    file ``work_dir/metrics.jsonl`` and the ``writers`` you pass. Every ``10 * period``
    iterations and at the end it also logs the time spent in each hook (see
    ``trainer.hook_seconds``).

    Args:
        period: Iterations between log points.
        writers: More :class:`~trainer.writers.MetricWriter` objects (rank 0 only).
        tensorboard: Write TensorBoard files.
        metrics_jsonl: Write ``work_dir/metrics.jsonl``.

    Example::

        >>> hook = LoggerHook(period=20)  # the Trainer registers one with log_period
    """

    priority = Priority.LOGGER

    def __init__(
        self,
        period: int = 50,
        writers: Optional[list[MetricWriter]] = None,
        tensorboard: bool = True,
        metrics_jsonl: bool = True,
    ) -> None:
        self._period = period
        self._extra = list(writers or [])
        self._tensorboard = tensorboard
        self._metrics_jsonl = metrics_jsonl
        self._writers: list[MetricWriter] = []
        self._written: dict[str, int] = {}  # metric -> values already written
        self._train_start = 0.0

    def before_train(self) -> None:
        """Open the writers and start the clock. What a resumed run's metrics already hold was
        written by the run that saved them; what that run wrote after its checkpoint (steps this
        run repeats) is dropped from TensorBoard and ``metrics.jsonl``."""
        trainer = self.trainer
        self._train_start = time.perf_counter()
        self._written = {name: buffer.count for name, buffer in trainer.metric_storage.items()}
        self._writers = [ConsoleWriter(self._train_start, trainer.start_iter)]
        if is_main_process():
            if self._tensorboard:
                self._writers.append(TensorBoardWriter(trainer.tb_log_dir, trainer.start_iter))
            if self._metrics_jsonl:
                path = os.path.join(trainer.work_dir, "metrics.jsonl")
                self._writers.append(JSONLinesWriter(path, trainer.start_iter))
            self._writers += self._extra

    def after_iter(self) -> None:
        """Write at every ``period``-th and at the last iteration."""
        done = self.trainer.progress.iter + 1  # read once: this runs every iteration
        if done % self._period == 0 or done == self.trainer.max_iters:
            self._write(log_point=True)
            if done % (10 * self._period) == 0:
                self._log_hook_times()

    def after_epoch(self) -> None:
        """Write what other hooks logged at the epoch's end (e.g. evaluation)."""
        self._write(log_point=False)

    def after_train(self) -> None:
        """Write what is left, close the writers and log the total time."""
        try:
            self._write(log_point=False)
        finally:
            for writer in self._writers:
                writer.close()
            self._writers = []
        self._log_hook_times()
        total = datetime.timedelta(seconds=int(time.perf_counter() - self._train_start))
        logger.info(f"Training ran for {total} (up to iteration {self.trainer.cur_iter + 1}).")

    def _log_hook_times(self) -> None:
        elapsed = time.perf_counter() - self._train_start
        times = sorted(self.trainer.hook_seconds.items(), key=lambda item: -item[1])
        parts = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in times)
        logger.info(f"Time in hooks, of {elapsed:.3g} s of training: {parts}.")

    def _write(self, log_point: bool) -> None:
        storage = self.trainer.metric_storage
        fresh = {}
        for name, buffer in storage.items():
            if buffer.count > self._written.get(name, 0):
                self._written[name] = buffer.count
                fresh[name] = storage.value_maybe_smooth(name)
        if not fresh:
            return
        for writer in self._writers:
            if log_point or not writer.log_points_only:
                writer.write(self.trainer, self.trainer.cur_iter, fresh)
