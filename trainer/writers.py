"""Where the metrics of each log point go: the console, TensorBoard, a JSON Lines file, or a
writer of your own behind the same small interface."""

import datetime
import json
import logging
import os
import time
from collections.abc import Collection
from typing import Any

import torch

from .checkpoint_files import atomic_write
from .logger import open_no_follow

logger = logging.getLogger("trainer.hooks.logger_hook")


class MetricWriter:
    """Receives metrics from ``LoggerHook``: override :meth:`write`, and :meth:`close` if the
    writer holds a resource.

    ``write`` is called at every log point, and at an epoch's end when other hooks (an
    evaluation, say) logged something new. Writers other than the console run on rank 0 only.

    Example::

        class PrintWriter(MetricWriter):
            def write(self, trainer, iter, metrics):
                print(iter, metrics)
    """

    #: Only at log points (the console line), not at epoch ends.
    log_points_only = False

    def write(self, trainer: Any, iter: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` (the values new since the last call: window means for smoothed
        metrics, the latest value for others) at iteration ``iter``, counted from 0 as
        ``trainer.cur_iter`` and TensorBoard's steps are."""
        raise NotImplementedError

    def flush(self) -> None:
        """Put what was written on disk; called before every checkpoint is saved, so that a run
        resumed from it has every row that the checkpoint covers."""

    def close(self) -> None:
        """Flush and release what the writer holds; called when training ends."""


def time_left(elapsed: float, iters_done: int, iters_left: int) -> datetime.timedelta:
    """The ETA: the time of everything since training started (evaluations and checkpoints
    included) spread over the iterations done, for those left."""
    return datetime.timedelta(seconds=int(elapsed / max(iters_done, 1) * iters_left))


def check_writers(name: str, writers: Any) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``writers`` is a list or tuple of
    :class:`MetricWriter` objects."""
    if not isinstance(writers, (list, tuple)) or not all(
        isinstance(w, MetricWriter) for w in writers
    ):
        raise TypeError(
            f"{name} must be a list of trainer.writers.MetricWriter objects, got {writers!r}."
        )


class ConsoleWriter(MetricWriter):
    """The log line: progress, ETA, LR, metrics (times with their units) and peak CUDA memory,
    to the console and ``log.txt`` (each save has a line of its own). The ETA spreads the time
    of everything since training started (evaluation and checkpoints included) over the
    iterations done.

    Args:
        start_time: ``time.perf_counter()`` when training started.
        start_iter: The iteration it started from.
    """

    log_points_only = True

    def __init__(self, start_time: float, start_iter: int) -> None:
        self._start_time = start_time
        self._start_iter = start_iter

    def write(self, trainer: Any, iter: int, metrics: dict[str, float]) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return  # the line would go nowhere: no need to format it
        done = iter + 1
        eta = time_left(time.perf_counter() - self._start_time, done - self._start_iter,
                        trainer.max_iters - done)  # fmt: skip
        metrics = dict(metrics)
        if trainer.max_epochs is None:  # a stream: its passes have no known length
            epoch = f"epoch {trainer.cur_epoch + 1} [{trainer.inner_iter + 1}]"
        else:
            epoch = (
                f"epoch {trainer.cur_epoch + 1}/{trainer.max_epochs}"
                f" [{trainer.inner_iter + 1}/{trainer.progress.epoch_iters}]"
            )
        parts = [
            epoch,
            f"iter {done}/{trainer.max_iters}",
            f"ETA {eta}",
        ]
        if "lr" in metrics:
            parts.append(f"lr {metrics.pop('lr'):.4g}")
        parts += [
            f"{name} {format_seconds(value) if name.endswith('_time') else f'{value:.4g}'}"
            for name, value in metrics.items()
        ]
        if trainer.device.type == "cuda":
            # reads the allocator's counters: no device sync
            peak = torch.cuda.max_memory_allocated(trainer.device) / 2**20
            parts.append(f"max_mem {peak:.0f}M")
        logger.info("  ".join(parts))


def format_seconds(seconds: float) -> str:
    """A duration with its unit: ``"12.3 ms"``, ``"4.56 s"``."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def tensorboard_tag(name: str, evaluated: bool) -> str:
    """The TensorBoard tag of metric ``name``: ``eval/`` for an evaluation's result, ``time/``
    for a time, ``train/`` for the rest; a name with a ``/`` is its own tag.

    Example::

        >>> tensorboard_tag("val_acc", evaluated=True), tensorboard_tag("lr", evaluated=False)
        ('eval/val_acc', 'train/lr')
    """
    if "/" in name:
        return name
    if evaluated:
        return f"eval/{name}"
    return f"time/{name}" if name.endswith("_time") else f"train/{name}"


class TensorBoardWriter(MetricWriter):
    """Scalars in TensorBoard event files under ``log_dir``, grouped by their tag's prefix:
    ``eval/`` for evaluation results (the names in ``eval_names``), ``time/`` for times
    (``data_time``, ``iter_time``), ``train/`` for the rest (losses, ``lr``); a name that has a
    ``/`` already keeps it.

    Each log point becomes one event holding all its scalars, and the events go to
    ``SummaryWriter`` in batches, at most every ``handoff_secs`` seconds (and at :meth:`flush`,
    before every checkpoint, and :meth:`close`). Handing an event over wakes the writer's thread,
    which computes checksums in Python while training waits for the GIL: hundreds of
    microseconds each time, so once per log point was a percent of a small model's training
    time. What TensorBoard shows lags by at most ``handoff_secs`` more than its own
    ``flush_secs`` (120 s).

    The trainer's event files end in ``.trainer``. A run starting from ``start_iter`` removes
    the events from that step on from them (those a resumed run repeats, or all of them for a
    fresh run), so that no step shows twice and two runs' curves never mix. Other event files in
    ``log_dir`` (your own ``SummaryWriter``'s) are never changed.

    Args:
        log_dir: Where the event files go.
        start_iter: The iteration this run starts from.
        handoff_secs: Seconds between hand-overs to ``SummaryWriter``.
        eval_names: The names of evaluation results (a set or dict, read at each write).
    """

    def __init__(
        self,
        log_dir: str,
        start_iter: int = 0,
        handoff_secs: float = 5.0,
        eval_names: Collection[str] = (),
    ) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        self._summary = Summary
        _drop_events_from(log_dir, start_iter)
        _wait_for_a_later_file_name(log_dir)
        self._writer = SummaryWriter(log_dir=log_dir, max_queue=1000, filename_suffix=_SUFFIX)
        self._handoff_secs = handoff_secs
        self._next_handoff = time.monotonic() + handoff_secs
        self._events: list[tuple[Any, int, float]] = []  # (summary, step, wall time)
        self._eval_names = eval_names

    def tag(self, name: str) -> str:
        """The TensorBoard tag of metric ``name``."""
        return tensorboard_tag(name, evaluated=name in self._eval_names)

    def write(self, trainer: Any, iter: int, metrics: dict[str, float]) -> None:
        summary_value = self._summary.Value
        values = [summary_value(tag=self.tag(name), simple_value=v) for name, v in metrics.items()]
        self._events.append((self._summary(value=values), iter, time.time()))
        if time.monotonic() >= self._next_handoff:
            self._hand_over()

    def _hand_over(self) -> None:
        for summary, step, wall_time in self._events:
            self._writer.file_writer.add_summary(summary, step, wall_time)
        self._events = []
        self._next_handoff = time.monotonic() + self._handoff_secs

    def write_text(self, tag: str, text: str, step: int) -> None:
        """Text (Markdown) under ``tag`` in TensorBoard's text tab."""
        self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        self._hand_over()
        self._writer.flush()  # waits for the event file's queue, then flushes the file

    def close(self) -> None:
        self._hand_over()
        self._writer.close()


_SUFFIX = ".trainer"  # the end of the trainer's event file names


def _drop_events_from(log_dir: str, step: int) -> None:
    """Remove the events of ``step`` and later from the trainer's event files in ``log_dir``
    (with TensorBoard's own reader and record writer); a file left with none is deleted."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    if not os.path.isdir(log_dir):
        return
    for name in sorted(os.listdir(log_dir)):
        path = os.path.join(log_dir, name)
        if not name.endswith(_SUFFIX) or not os.path.isfile(path) or os.path.islink(path):
            continue
        records = list(RawEventFileLoader(path).Load())  # a record cut short by a kill: dropped
        kept = [r for r in records if Event.FromString(r).step < step]
        if len(kept) == len(records) and os.path.getsize(path) == _size(records):
            continue
        if all(Event.FromString(r).HasField("file_version") for r in kept):  # no data left
            os.remove(path)
            continue

        def write(f: Any, kept: list[bytes] = kept) -> None:
            writer = RecordWriter(f)
            for record in kept:
                writer.write(record)

        atomic_write(path, write)


def _size(records: list[bytes]) -> int:
    """The bytes ``records`` take in an event file: each with a 16-byte header and footer."""
    return sum(len(r) + 16 for r in records)


def _wait_for_a_later_file_name(log_dir: str) -> None:
    """Wait, if need be, so that the new event file sorts after those already in ``log_dir``.

    TensorBoard reads a directory's event files in name order, and applies a run's
    ``purge_step`` only to the files before its own. A name is
    ``events.out.tfevents.<second>.<host>.<pid>.<counter>``, the counter not zero-padded, so a
    run started in the same second as the previous one (a notebook, a test) could sort before it
    (counter 10 before 9) and have its curves mixed with the old ones.
    """
    try:
        names = os.listdir(log_dir)
    except OSError:
        return  # no directory yet: nothing to sort after
    seconds = [
        int(parts[3])
        for parts in (name.split(".") for name in names if name.startswith("events.out.tfevents."))
        if len(parts) > 3 and parts[3].isdigit()
    ]
    delay = max(seconds, default=0) + 1 - time.time()
    if 0 < delay <= 2:  # longer means a clock set back; waiting would not be worth it
        time.sleep(delay)


class JSONLinesWriter(MetricWriter):
    """One JSON object per line in ``path``: ``{"iter": ..., "epoch": ..., <metric>: ...}``
    (``iter`` counted from 0, ``epoch`` from 1), for scripts and notebooks
    (``pandas.read_json(path, lines=True)``).

    Resuming drops the lines of iterations the resumed run repeats (left by the interrupted
    run), so the file tells one consistent history. Every line is flushed as it is written, so a
    killed run keeps what it logged.
    """

    def __init__(self, path: str, start_iter: int = 0) -> None:
        self._path = path
        if os.path.isfile(path) and not os.path.islink(path):
            _keep_lines_before(path, start_iter)
        self._file = open_no_follow(path, append=True)

    def write(self, trainer: Any, iter: int, metrics: dict[str, float]) -> None:
        record = {"iter": iter, "epoch": trainer.cur_epoch + 1, **metrics}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _keep_lines_before(path: str, start_iter: int) -> None:
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["iter"] < start_iter:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            break  # a line cut short by a crash, and whatever follows it
    if len(kept) < len(lines):
        atomic_write(path, lambda f: f.write("".join(kept).encode("utf-8")))
