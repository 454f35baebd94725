"""Sends metrics to the console, TensorBoard, a JSON Lines file and any other writers, and logs
the end-of-run summary table."""

import datetime
import json
import logging
import os
import time
from typing import Any, Optional

from tabulate import tabulate

from ..distributed import is_main_process
from ..logger import TRACEBACK_FOLLOWS, open_no_follow
from ..misc import check_int, check_type
from ..writers import (
    ConsoleWriter,
    JSONLinesWriter,
    MetricWriter,
    TensorBoardWriter,
    format_seconds,
    settings_to_compare,
)
from .hookbase import HookBase, Priority
from .metric_watch import record_results

logger = logging.getLogger(__name__)


class LoggerHook(HookBase):
    """Writes the metrics new at each log point, at the step ``cur_iter + 1``: the console line
    on every rank (to its console and log file), and on rank 0 TensorBoard
    (``trainer.tb_log_dir``), ``work_dir/metrics.jsonl`` and your ``writers``; an evaluation's
    results, in a row of their own. Files get each metric's value logged last, the console line
    the window mean of a smoothed one. Rank 0 writes the run's settings (``trainer.run_config``)
    to ``work_dir/run.json`` and TensorBoard; every rank logs a summary table at the end.

    Args:
        period: Iterations between log points: the trainer's ``log_period`` (None), where the
            values it writes are flushed; another period is refused when training starts.
        writers: More [`MetricWriter`][] objects, such as
            [`MLflowWriter`][writers.MLflowWriter] and [`WandbWriter`][writers.WandbWriter]
            (rank 0 only; their state, a tracker's run id, goes in the checkpoints).
        tensorboard: Write TensorBoard files.
        metrics_jsonl: Write ``work_dir/metrics.jsonl``.

    Example::

        >>> hook = LoggerHook(tensorboard=False)  # the Trainer registers one by default
    """

    priority = Priority.LOGGER

    def __init__(
        self,
        period: Optional[int] = None,
        writers: Optional[list[MetricWriter]] = None,
        tensorboard: bool = True,
        metrics_jsonl: bool = True,
    ) -> None:
        if period is not None:
            check_int("period", period, minimum=1)
        extra = [] if writers is None else writers
        if not isinstance(extra, (list, tuple)) or not all(
            isinstance(w, MetricWriter) for w in extra
        ):
            raise TypeError(f"writers must be a list of MetricWriter objects, got {writers!r}.")
        check_type("tensorboard", tensorboard, bool, "True or False")
        check_type("metrics_jsonl", metrics_jsonl, bool, "True or False")
        self._period = period
        self._extra = list(extra)
        self._tensorboard = tensorboard
        self._metrics_jsonl = metrics_jsonl
        self._writers: list[MetricWriter] = []
        self._written: dict[str, int] = {}  # metric -> values already written
        self._resumed_written: Optional[dict[str, int]] = None  # the checkpoint's _written
        self._resumed_rows_crc: Optional[int] = None  # the checkpoint's CRC of metrics.jsonl
        self._train_start: Optional[float] = None  # when its before_train ran
        self._data_start = 0.0  # trainer.data_seconds then
        self._evals: dict[str, dict[str, Any]] = {}  # evaluated metrics' final and best values

    def before_train(self) -> None:
        """Open the writers (a resumed run drops what it repeats), write the settings, time it."""
        trainer = self.trainer
        if self._period not in (None, trainer.log_period):
            # the values it writes are flushed at the trainer's log points
            raise ValueError(
                f"LoggerHook(period={self._period}) but log_period={trainer.log_period}: omit it."
            )
        self._log_start()
        self._train_start = time.perf_counter()
        self._data_start = trainer.data_seconds
        # a resumed run writes what its checkpoint had not written yet (at later steps)
        written, self._resumed_written = self._resumed_written, None
        if written is None:
            written = {name: buffer.count for name, buffer in trainer.metric_storage.items()}
        self._written = written
        rows_crc, self._resumed_rows_crc = self._resumed_rows_crc, None
        self._writers = [ConsoleWriter(self._train_start, trainer.start_iter)]
        if is_main_process():
            # the settings, and the hooks in run order (the options they take are theirs)
            config = {**trainer.run_config, "hooks": trainer.hooks.info()}
            path = os.path.join(trainer.work_dir, "run.json")
            if trainer.start_iter > 0:  # resumed: the run's own settings are in its run.json
                config = _log_changes(trainer.work_dir, _read_run_json(path), config)
            if not trainer.progress.finished:  # a rerun of a finished run changes no file
                self._open_files(config, rows_crc)

    def _open_files(self, config: dict[str, Any], rows_crc: Optional[int]) -> None:
        """On rank 0 of a run that trains: write ``run.json``, and open the file writers and
        yours, which drop the steps after the checkpoint's (the run writes them again); yours
        get the rows of metrics.jsonl up to it if their CRC is the checkpoint's ``rows_crc``
        (or it has none)."""
        trainer = self.trainer
        with open_no_follow(os.path.join(trainer.work_dir, "run.json"), append=False) as f:
            json.dump(config, f, indent=2)
        if self._tensorboard:
            writer = TensorBoardWriter(
                trainer.tb_log_dir, trainer.start_iter, eval_names=self._evals
            )
            writer.write_text("run", _markdown_table(config), trainer.start_iter + 1)
            self._writers.append(writer)
        history: list[dict[str, Any]] = []  # the rows up to the checkpoint's step
        if self._metrics_jsonl:
            path = os.path.join(trainer.work_dir, "metrics.jsonl")
            jsonl = JSONLinesWriter(path, trainer.start_iter)
            history, jsonl.history = jsonl.history, []  # for your writers, not kept
            if history and rows_crc not in (None, jsonl.crc):  # a fresh start's, since
                logger.warning(
                    f"{path} does not hold the rows of the run that "
                    f"{trainer.checkpointer.last_path} belongs to (another run wrote it since): "
                    f"the trackers get none of its rows up to step {trainer.start_iter} again."
                )
                history = []
            self._writers.append(jsonl)
        for extra in self._extra:  # each closed when training ends, once started
            extra.load_history(history)
            extra.start(trainer, trainer.start_iter, config)
            self._writers.append(extra)

    def _log_start(self) -> None:
        """Say where training starts, or that the run is finished and how to train more (a
        stopped run: the trainer says so)."""
        trainer = self.trainer
        progress = trainer.progress
        last = trainer.checkpointer.last_path
        if progress.stopped:
            return
        if progress.finished:
            held = f"{progress.resumed_iters} iterations"  # the checkpoint's: max_iters may cut
            if trainer.train_by_epoch:
                held = f"{progress.position[0]} epochs ({held})"
            logger.info(
                f"Nothing to train: {trainer.work_dir} holds a finished run of {held} ({last}). "
                "To train longer, raise max_epochs or max_iters; to start afresh, pass another "
                "work_dir or train(auto_resume=False)."
            )
            return
        origin = f"resuming {last}" if trainer.start_iter > 0 and last is not None else "afresh"
        first = f"iteration {trainer.start_iter + 1} of {trainer.max_iters}"
        logger.info(f"Start training with {first} in {trainer.work_dir}, {origin}.")

    def after_iter_period(self) -> int:
        """Every log point: every ``log_period``-th iteration, and the last."""
        return self.trainer.log_period

    def after_iter(self) -> None:
        """Write a log point."""
        self._write(log_point=True)

    def before_save_checkpoint(self) -> None:
        """Write this iteration's log point, if it is one (at a stop's save, what is left), and
        flush the writers: a kill after the save loses no row that the resumed run will not
        write again, and a continued stop writes none twice."""
        log_point = self.every_n_iters(self.trainer.log_period) or self.is_last_iter()
        if log_point or self.trainer.progress.stopped:
            self._write(log_point)
        for writer in self._writers:
            writer.flush()

    def after_eval(self, results: dict[str, float]) -> None:
        """Write an evaluation's results, in a row of their own (not the console line: the
        ``EvalHook`` logs its own), and keep their final and best values for the summary."""
        watches = [getattr(hook, "metric_watch", None) for hook in self.trainer.hooks]
        modes = {watch.metric: watch.mode for watch in watches if watch is not None}
        record_results(self._evals, results, self.trainer.cur_iter + 1, modes)
        self._write(log_point=False, names=set(results))

    def after_train(self) -> None:
        """Log the failure that ended training, if one did (its traceback in the log file; on the
        console Python prints it), write what is left, close the writers and log the summary
        table."""
        trainer = self.trainer
        error = trainer.progress.error
        if error is not None:
            where = "as it started"
            if trainer.cur_iter >= trainer.start_iter:
                where = f"in iteration {trainer.cur_iter + 1} of {trainer.max_iters}"
            if is_main_process():  # rank 0 writes the checkpoints: it knows
                where += f" (last checkpoint on disk: {trainer.checkpointer.last_path or 'none'})"
            logger.error(
                f"Training failed {where}: {type(error).__name__}: {error}",
                exc_info=error,
                extra={TRACEBACK_FOLLOWS: True},
            )
        try:
            self._write(log_point=False)
        finally:
            for writer in self._writers:
                writer.close()
            self._writers = []
        if self._train_start is None:  # training failed before this hook's before_train
            return
        logs = [trainer.log_file]
        if is_main_process():
            logs += [os.path.join(trainer.work_dir, "metrics.jsonl")] if self._metrics_jsonl else []
            logs += [trainer.tb_log_dir] if self._tensorboard else []
        seconds = time.perf_counter() - self._train_start
        self._train_start = None
        iters = trainer.cur_iter + 1 - trainer.start_iter
        waited = trainer.data_seconds - self._data_start
        logger.info("\n" + _summary_table(trainer, seconds, waited, iters, self._evals, logs))

    def state_dict(self) -> dict[str, Any]:
        """The evaluated metrics' final and best values (for the summary of a resumed run), and
        how many values of each metric were written (a resumed run writes the others), what
        your writers need to resume (a tracker's run id), by class name, and the CRC-32 of the
        lines of metrics.jsonl (a resumed run replays them to your writers if theirs matches)."""
        writers = {key: writer.state_dict() for key, writer in self._writer_keys()}
        evals = {name: dict(entry) for name, entry in self._evals.items()}
        rows_crc = next((w.crc for w in self._writers if isinstance(w, JSONLinesWriter)), None)
        return {
            "evals": {"metrics": evals},
            "written": dict(self._written),
            "writers": writers,
            "rows_crc": rows_crc,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned."""
        self._evals = {name: dict(entry) for name, entry in state["evals"]["metrics"].items()}
        written = state.get("written")
        self._resumed_written = None if written is None else dict(written)
        self._resumed_rows_crc = state.get("rows_crc")  # None: saved before it was kept
        saved = state.get("writers", {})
        for key, writer in self._writer_keys():
            writer.load_state_dict(saved.get(key, {}))

    def _writer_keys(self) -> list[tuple[str, MetricWriter]]:
        """Your writers, each keyed by its class name (a second of a class: ``Name.1``...)."""
        keys: list[tuple[str, MetricWriter]] = []
        seen: dict[str, int] = {}
        for writer in self._extra:
            name = type(writer).__name__
            keys.append((name if name not in seen else f"{name}.{seen[name]}", writer))
            seen[name] = seen.get(name, 0) + 1
        return keys

    def _write(self, log_point: bool, names: Optional[set[str]] = None) -> None:
        """Write the metrics logged since the last write, at the step ``cur_iter + 1``: the
        value logged last (the console line: the window mean of a smoothed metric)."""
        storage = self.trainer.metric_storage
        if log_point:  # what hooks logged on the device after the log point's transfer, in
            storage.flush(every_rank=True)  # their after_iter: none most often, then no sync
        fresh = [
            name
            for name, buffer in storage.items()
            if (names is None or name in names) and buffer.count > self._written.get(name, 0)
        ]
        if not fresh:
            return
        logged = {name: storage[name].latest for name in fresh}
        shown = {name: storage.value_maybe_smooth(name) for name in fresh}
        self._written.update((name, storage[name].count) for name in fresh)
        step = self.trainer.cur_iter + 1
        for writer in self._writers:
            if log_point or not writer.log_points_only:
                writer.write(self.trainer, step, shown if writer.smoothed else logged)


# Settings a resumed run takes from its checkpoint, whatever was given: the optimizer's and the
# scheduler's state hold the LRs.
_RESTORED = ("base_lrs",)


def _read_run_json(path: str) -> Optional[dict[str, Any]]:
    """The settings a run saved in ``path``; None if there are none to read."""
    if os.path.islink(path):  # refused when it is written
        return None
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:  # none (resumed from elsewhere), or not what we wrote
        logger.debug(f"Not comparing the settings with {path}: {e}")
        return None
    return saved if isinstance(saved, dict) else None


def _log_changes(
    work_dir: str, saved: Optional[dict[str, Any]], now: dict[str, Any]
) -> dict[str, Any]:
    """Log, in one line, how the settings ``now`` differ from those the resumed run saved (a
    warning, or a calm line when only a larger ``max_epochs`` or ``max_iters``, the usual way to
    train longer, differs), and return the settings it trains with: ``now``, but for those its
    checkpoint restores."""
    if saved is None:
        return now
    changes = []
    longer = True  # only a larger max_epochs or max_iters
    before, after = settings_to_compare(saved), settings_to_compare(now)  # as MLflowWriter's
    for key in [*after] + [k for k in before if k not in after]:
        old, new = before.get(key), after.get(key)
        if key == "hooks":  # class names, sorted: the same hooks, perhaps reordered, are equal
            if old == new:
                continue
            gone = [h for h in old or [] if h not in (new or [])]
            added = [h for h in new or [] if h not in (old or [])]
            changes.append(f"hooks {', '.join([f'+{h}' for h in added] + [f'-{h}' for h in gone])}")
        elif old == new:
            continue
        elif key in _RESTORED:
            restored = f"(given {json.dumps(new)}: the checkpoint restores it)"
            changes.append(f"{key} stays {json.dumps(old)} {restored}")
        else:
            changes.append(f"{key} {json.dumps(old)} -> {json.dumps(new)}")
        raised = isinstance(old, int) and isinstance(new, int) and new > old
        longer &= key in ("max_epochs", "max_iters") and raised
    used = {**now, **{key: saved[key] for key in _RESTORED if key in saved}}
    if not changes:
        return used
    if longer:
        logger.info(f"Resuming the run in {work_dir} to train longer: {', '.join(changes)}.")
        return used
    logger.warning(
        f"Resuming the run in {work_dir} with settings that differ from its run.json: "
        f"{', '.join(changes)}. To start a new run, pass another work_dir or "
        "train(auto_resume=False)."
    )
    return used


def _markdown_table(config: dict[str, Any]) -> str:
    """``config`` as a two-column Markdown table, which TensorBoard's text tab renders."""
    rows = "\n".join(f"| {key} | {json.dumps(value)} |" for key, value in config.items())
    return f"| setting | value |\n|---|---|\n{rows}"


def _summary_table(
    trainer: Any,
    seconds: float,
    waited: float,
    iters: int,
    evals: dict[str, dict[str, Any]],
    logs: list[str],
) -> str:
    """The table logged when training ends: the wall time of this ``train()`` (``seconds``, for
    ``iters`` iterations) and where it went (``waited`` for batches), the evaluated metrics'
    final and best values (``evals``), the checkpoints on disk and the ``logs`` written."""
    wall = format_seconds(seconds)
    if seconds >= 60:
        wall = str(datetime.timedelta(seconds=round(seconds)))
    done = f"iteration {trainer.cur_iter + 1} of {trainer.max_iters}"
    if iters:
        speed = f"{wall} for {iters} iterations ({iters / max(seconds, 1e-9):.3g} it/s), {done}"
        data = _share(waited, seconds)
        rows = [["wall time", speed], ["data loading", data]]
        hooks = sorted(trainer.hooks.seconds_by_class().items(), key=lambda item: -item[1])
        rows += [[f"hook {name}", _share(s, seconds)] for name, s in hooks]
    else:
        rows = [["wall time", f"{wall}, no iteration to train: {done}"]]
    for name, entry in evals.items():
        value = f"final {entry['final']:.5g}"
        if entry["best"] is not None:
            value += f", best {entry['best']:.5g} (after iteration {entry['best_iter']})"
        rows.append([name, value])
    last = trainer.checkpointer.last_path
    rows.append(["last checkpoint", os.path.abspath(last) if last else "none"])
    for hook in trainer.hooks:  # a BestCheckpointHook's, once on disk (train() waits for it)
        best = getattr(hook, "best_checkpoint", None)
        if isinstance(best, str) and os.path.exists(best):
            rows.append(["best checkpoint", os.path.abspath(best)])
            break
    folders = {os.path.dirname(path) for path in logs}
    if len(folders) == 1:  # the usual: all in work_dir
        logs = [f"{', '.join(map(os.path.basename, logs))} in {folders.pop()}"]
    rows.append(["logs", ", ".join(logs)])
    return tabulate(rows, headers=["Run summary", ""], tablefmt="simple")


def _share(part: float, whole: float) -> str:
    return f"{format_seconds(part)} ({100 * part / max(whole, 1e-9):.1f}%)"
