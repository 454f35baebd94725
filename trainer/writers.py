"""Where the metrics of each log point go: the console, TensorBoard, a JSON Lines file, MLflow,
Weights & Biases, or a writer of your own behind the same small interface; and what a rerun
drops of the files it finds (the steps it will write again)."""

import datetime
import functools
import json
import logging
import os
import posixpath
import re
import time
import urllib.parse
import zlib
from collections.abc import Collection
from typing import Any, Callable, Optional

import torch

from .checkpoint_io import atomic_write
from .logger import LOG_POINT, open_no_follow, refuse_link
from .misc import check_type

logger = logging.getLogger("trainer.hooks.logger_hook")

_SUFFIX = ".trainer"  # the end of the trainer's event file names


class MetricWriter:
    """Receives metrics from ``LoggerHook``: override [`write`][], and [`close`][] if the
    writer holds a resource (see docs/logging.md). Writers of your own run on rank 0 only; what
    [`state_dict`][] returns is saved in the checkpoints (rank 0's) and given back to
    [`load_state_dict`][] on resume, before [`start`][]. A writer that records how training
    ended (as the trackers mark their runs) reads ``trainer.progress.outcome`` in [`close`][]:
    ``"finished"``, ``"failed"`` or ``"killed"``, keeping ``trainer.progress`` from
    [`start`][]."""

    #: Only at log points (the console line), not for an evaluation's results.
    log_points_only = False
    #: Gets the window mean of a smoothed metric (the console line) instead of the value logged.
    smoothed = False

    def start(self, trainer: Any, start_iter: int, config: dict[str, Any]) -> None:
        """Called on rank 0 when training starts, before the first write: ``start_iter`` is the
        number of iterations done before this run (it writes the steps after it, a resumed run
        from ``start_iter + 1`` on again), ``config`` the run's settings as in
        ``work_dir/run.json``."""

    def write(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """Record ``metrics`` (the values new since the last call) at ``step``: the number of
        iterations done, ``trainer.cur_iter + 1`` (the evaluation after iteration 32 at step
        32). ``LoggerHook`` passes it positionally."""
        raise NotImplementedError

    def flush(self) -> None:
        """Put what was written on disk; called before every checkpoint is saved."""

    def close(self) -> None:
        """Flush and release what the writer holds; called when training ends, however it ends
        (``trainer.progress.outcome`` says how)."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this writer, as plain data; empty for most writers."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned (from the checkpoint resumed from)."""

    def load_history(self, rows: list[dict[str, Any]]) -> None:
        """Given before [`start`][]: the rows of ``work_dir/metrics.jsonl`` (``iter``,
        ``epoch`` and the metrics) up to ``start_iter``, which a resumed run logged before its
        checkpoint, for a writer whose store may have lost some (a process killed outright loses
        what it had not sent); none where ``LoggerHook`` writes no metrics.jsonl, or where its
        rows are not those of the checkpoint's run (another run wrote it since)."""


def time_left(elapsed: float, iters_done: int, iters_left: int) -> datetime.timedelta:
    """The ETA of ``iters_left`` at the pace of ``iters_done`` in ``elapsed`` seconds
    (evaluations and checkpoints included)."""
    return datetime.timedelta(seconds=int(elapsed / max(iters_done, 1) * iters_left))


def format_seconds(seconds: float) -> str:
    """A duration with its unit: ``"12.3 ms"``, ``"4.56 s"``."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


#: The keys of a metrics.jsonl row besides its metrics (the step, the epoch): names the trainer
#: writes itself, which EvalHook refuses as results, as it refuses TRAINER_METRICS.
ROW_KEYS = ("iter", "epoch")
#: The beginnings of the trainer's metrics per parameter group or optimizer (lr/group1,
#: grad_norm/optimizer_d...), refused as results too.
PER_GROUP = ("lr/", "grad_norm/")
_GROUP_LR = re.compile(r"lr/group[0-9]+")  # an LR the console line leaves out


def trainer_writes(name: str) -> bool:
    """Whether metrics.jsonl's rows hold ``name`` from the trainer itself: a row key (``iter``,
    ``epoch``) or a metric per parameter group or optimizer (``lr/...``, ``grad_norm/...``)."""
    return name in ROW_KEYS or name.startswith(PER_GROUP)


def tensorboard_tag(name: str, evaluated: bool) -> str:
    """The TensorBoard tag of metric ``name``: ``eval/`` for an evaluation's result, ``time/``
    for a time, ``train/`` for the rest, the trainer's metrics per parameter group or optimizer
    included (``train/lr/group1``, ``train/grad_norm/optimizer_d``); another name with a ``/``
    is its own tag."""
    if "/" in name and not name.startswith(PER_GROUP):
        return name
    if evaluated:
        return f"eval/{name}"
    return f"time/{name}" if name.endswith("_time") else f"train/{name}"


class ConsoleWriter(MetricWriter):
    """The log line: progress, ETA, LR (of the first parameter group), metrics (times with
    their units) and peak CUDA memory, to the console and ``log.txt``.

    Args:
        start_time: ``time.perf_counter()`` when training started.
        start_iter: The iterations done before it started.
    """

    log_points_only = True
    smoothed = True

    def __init__(self, start_time: float, start_iter: int) -> None:
        self._start_time = start_time
        self._start_iter = start_iter

    def write(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return  # the line would go nowhere: no need to format it
        epoch = trainer.cur_epoch + 1
        inner = trainer.inner_iter + 1
        elapsed = time.perf_counter() - self._start_time
        eta = time_left(elapsed, step - self._start_iter, trainer.max_iters - step)
        if trainer.max_epochs is None:  # a stream: its passes have no known length
            parts = [f"epoch {epoch} [{inner}]"]
        else:
            parts = [f"epoch {epoch}/{trainer.max_epochs} [{inner}/{trainer.progress.epoch_iters}]"]
        parts += [f"iter {step}/{trainer.max_iters}", f"ETA {eta}"]
        lr_first = sorted(metrics.items(), key=lambda item: item[0] != "lr")  # sorted is stable
        parts += [
            f"{name} {format_seconds(value) if name.endswith('_time') else f'{value:.4g}'}"
            for name, value in lr_first
            if not _GROUP_LR.fullmatch(name)
        ]
        device = next(trainer.model.parameters()).device
        if device.type == "cuda":  # reads the allocator's counters: no device sync
            parts.append(f"max_mem {torch.cuda.max_memory_allocated(device) / 2**20:.0f}M")
        logger.info("  ".join(parts), extra={LOG_POINT: True})


class TensorBoardWriter(MetricWriter):
    """Scalars in TensorBoard event files under ``log_dir`` (tagged by [`tensorboard_tag`][])
    ending in ``.trainer``: a run that starts after ``start_iter`` iterations drops their events
    of later steps (those it writes again), and changes no other event file.

    Args:
        log_dir: Where the event files go.
        start_iter: The iterations done before this run (``trainer.start_iter``).
        handoff_secs: Seconds between hand-overs to ``SummaryWriter``.
        eval_names: The names of evaluation results (read at each write).
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
        refuse_link(log_dir)  # a rerun rewrites the event files it holds
        new_writer = functools.partial(
            SummaryWriter, log_dir=log_dir, max_queue=1000, filename_suffix=_SUFFIX
        )
        if os.path.isdir(log_dir):  # a rerun's or a resumed run's
            self._writer = _rewind_event_files(log_dir, start_iter + 1, new_writer)
        else:
            self._writer = new_writer()
        # Events reach the SummaryWriter in batches: each hand-over wakes its thread, which
        # computes checksums in Python while training waits for the GIL.
        self._handoff_secs = handoff_secs
        self._next_handoff = time.monotonic() + handoff_secs
        self._events: list[tuple[Any, int, float]] = []  # (summary, step, wall time)
        self._eval_names = eval_names

    def write(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        evaluated = self._eval_names
        values = [
            self._summary.Value(tag=tensorboard_tag(name, name in evaluated), simple_value=value)
            for name, value in metrics.items()
        ]
        self._events.append((self._summary(value=values), step, time.time()))
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


class JSONLinesWriter(MetricWriter):
    """A flushed line ``{"iter": ..., "epoch": ..., <metric>: ...}`` per write in ``path``:
    ``iter`` is the step (iterations done), ``epoch`` the number of the epoch it is in (from 1).
    A run that starts after ``start_iter`` iterations drops the lines of later steps, and those
    that hold no row (said once)."""

    def __init__(self, path: str, start_iter: int = 0) -> None:
        #: The rows it kept, of the steps up to ``start_iter`` (what a resumed run logged).
        self.history: list[dict[str, Any]] = []
        #: The CRC-32 (``zlib.crc32``) of the lines the file holds: those kept, then those
        #: written. A checkpoint keeps it: a resumed run's kept rows are its run's if it matches.
        self.crc = 0
        if os.path.isfile(path) and not os.path.islink(path):
            self.history, self.crc = _keep_lines_up_to(path, start_iter)
        self._file = open_no_follow(path, append=True)

    def write(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        # the keys before the metrics: ROW_KEYS
        line = json.dumps({"iter": step, "epoch": trainer.cur_epoch + 1, **metrics}) + "\n"
        self._file.write(line)
        self._file.flush()
        self.crc = zlib.crc32(line.encode("utf-8"), self.crc)

    def close(self) -> None:
        self._file.close()


# run.json keys that are not the run's settings, which a resumed run does not compare (LoggerHook
# and MLflowWriter alike): the seed (random unless set, and a resume restores every RNG from the
# checkpoint), the torch version (the machine's), the work_dir (the same folder, perhaps moved).
_NOT_SETTINGS = ("seed", "torch", "work_dir")
# Drawn only on a terminal or in a notebook: it comes and goes with where the output goes.
_TERMINAL_HOOKS = ("ProgressBarHook",)


def _hook_names(hooks: Any) -> list[str]:
    """The class names in run.json's ``hooks`` (``"EvalHook (priority 60)"``), those of hooks
    drawn only on a terminal left out."""
    names = [str(h).split(" (")[0] for h in hooks] if isinstance(hooks, list) else []
    return [name for name in names if name not in _TERMINAL_HOOKS]


def settings_to_compare(config: dict[str, Any]) -> dict[str, Any]:
    """What a resumed run compares of run.json's ``config`` with the stopped run's: every key but
    ``_NOT_SETTINGS``, the hooks as their class names (``_hook_names``), sorted (their
    order aside)."""
    settings = {key: value for key, value in config.items() if key not in _NOT_SETTINGS}
    if "hooks" in settings:
        settings["hooks"] = sorted(_hook_names(settings["hooks"]))
    return settings


def _metrics(row: dict[str, Any]) -> dict[str, float]:
    """The metrics of a row of metrics.jsonl."""
    return {name: value for name, value in row.items() if name not in ROW_KEYS}


def _as_param(value: Any) -> str:
    """A setting as a tracker's param: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


# MLflow's rule for a metric's name (mlflow.utils.validation): at most 250 of these characters
# (":" not on Windows), and no name that reads as another as a path ("a//b", "a/", "/a", "..a")
_MLFLOW_REFUSED = re.compile(r"[^/\w.\- :]" if os.name != "nt" else r"[^/\w.\- ]")


def _mlflow_name(name: str) -> str:
    """``name`` if MLflow takes it as a metric's name, else one it takes: its last 250
    characters, those MLflow refuses as ``_``, and its slashes too if it reads as a path."""
    mapped = _MLFLOW_REFUSED.sub("_", name[-250:])
    if posixpath.normpath(mapped) != mapped or mapped == "." or mapped.startswith(("/", "..")):
        mapped = mapped.replace("/", "_")
        if mapped in ("", ".") or mapped.startswith(".."):
            mapped = "_" + mapped[1:]
    return mapped


# The keys W&B writes in each step of a run's history itself: a metric's value under one is
# overwritten, or overwrites W&B's (and a metric named "" is dropped)
_WANDB_KEYS = ("_step", "_runtime", "_timestamp", "_wandb")


def _wandb_name(name: str) -> str:
    """``name`` if W&B keeps a metric under it, else one it keeps."""
    return f"{name}_" if name in ("", *_WANDB_KEYS) else name


class _TrackerWriter(MetricWriter):
    """A writer to a tracker's run, whose id the checkpoints keep for a resumed run to go on. A
    metric whose name the tracker refuses, or has for another metric, goes to the tracker under
    a name of its own, said once and kept in the checkpoints too (the same in a resumed run)."""

    run_id: Optional[str] = None  # the run written to
    _resume_id: Optional[str] = None  # the checkpoint's: the run the next start goes on with
    _progress: Any = None  # the trainer's, from start: how training ended, at close
    _tracker = ""  # its name, for messages
    _tracker_name: Callable[[str], str]  # a metric's name, or one that the tracker takes

    def __init__(self) -> None:
        self._names: dict[str, str] = {}  # each metric's name in the tracker
        self._history: list[dict[str, Any]] = []  # metrics.jsonl's rows, until start logs them

    def load_history(self, rows: list[dict[str, Any]]) -> None:
        self._history = rows

    def _tracked(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` under their names in the tracker."""
        names = self._names
        return {names.get(name) or self._name(name): value for name, value in metrics.items()}

    def _name(self, name: str) -> str:
        """The tracker's name for metric ``name``, met for the first time: ``name``, or if the
        tracker refuses it or has it for another metric, one that it takes (said once)."""
        taken = {tracked: metric for metric, tracked in self._names.items()}
        allowed = tracked = self._tracker_name(name)
        suffix = 1
        while tracked in taken:
            suffix += 1
            tracked = self._tracker_name(f"{allowed}_{suffix}")
        self._names[name] = tracked
        if tracked != name:
            why = f"a name {self._tracker} refuses"
            if allowed == name:
                why = f"{self._tracker} has {name!r} for {taken[name]!r}"
            logger.warning(f"Metric {name!r} goes to {self._tracker} as {tracked!r} ({why}).")
        return tracked

    def state_dict(self) -> dict[str, Any]:
        run_id = self._resume_id or self.run_id  # not started (a finished run): the saved one
        state: dict[str, Any] = {} if run_id is None else {"run_id": run_id}
        renamed = {name: tracked for name, tracked in self._names.items() if tracked != name}
        if renamed:
            state["names"] = renamed
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_id = state.get("run_id")
        self._names = dict(state.get("names", {}))


class MLflowWriter(_TrackerWriter):
    """Metrics to an MLflow run, each write's ``step`` as its step, and the run's settings
    (``work_dir/run.json``) as its params. Writes go to MLflow in the background: training
    waits for them only before each checkpoint is saved and when it ends, where an error of
    theirs is raised. The run's id is saved in the checkpoints: a resumed run logs to the same
    run. MLflow keeps every value logged, so the steps that the stopped run had logged after its
    last checkpoint have two values each; its params cannot change, so they keep the first
    launch's values (a setting that differs on resume, with a warning). When training ends, the
    run's status says how: ``FINISHED`` (to the end, or ``stop()``), ``FAILED`` (an error) or
    ``KILLED`` (a preemption signal or Ctrl-C). A metric name MLflow refuses goes under one it
    takes (``acc@1`` as ``acc_1``), said once. Needs ``pip install "hooktrainer[mlflow]"``.

    Args:
        tracking_uri: Where MLflow keeps its runs: a tracking server's URL (a server that does
            not answer within 5 s fails the start), ``sqlite:///mlflow.db`` (a local database,
            the store MLflow recommends), ``file:./mlruns`` (a folder: a store MLflow 3 keeps
            in maintenance, used only with ``MLFLOW_ALLOW_FILE_STORE=true``)...; None: MLflow's
            default (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``).
        experiment_name: The run's experiment, created if missing.
        run_name: The run's name; None: MLflow makes one up.
    """

    _STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}  # by outcome
    _MAX_PENDING = 100  # writes in flight before the oldest is waited for (long done by then)
    _tracker = "MLflow"
    _tracker_name = staticmethod(_mlflow_name)
    _ANSWER_SECS = 5.0  # how long the start waits for a tracking server's first answer

    def __init__(
        self,
        tracking_uri: Optional[str] = None,
        experiment_name: str = "Default",
        run_name: Optional[str] = None,
    ) -> None:
        check_type("tracking_uri", tracking_uri, (str, type(None)), "a URI as a str, or None")
        check_type("experiment_name", experiment_name, str, "a str")
        check_type("run_name", run_name, (str, type(None)), "a str or None")
        super().__init__()
        try:  # an optional extra: imported by the runs that use it
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ImportError(
                'MLflowWriter needs mlflow: pip install "hooktrainer[mlflow]".'
            ) from e
        self._metric = Metric
        self._param = Param
        self._client_class = MlflowClient
        self._uri = tracking_uri
        self._experiment = experiment_name
        self._run_name = run_name
        self._client: Any = None
        self._pending: list[Any] = []  # the writes in flight (MLflow's RunOperations)

    def start(self, trainer: Any, start_iter: int, config: dict[str, Any]) -> None:
        client = self._client_class(self._uri)
        if client.tracking_uri.startswith(("http://", "https://")):
            # MLflow retries a request that gets no answer for minutes, saying nothing
            _check_answers(client.tracking_uri, self._ANSWER_SECS)
        self._client = client
        self._progress = trainer.progress
        history, self._history = self._history, []
        params = {key: _as_param(value) for key, value in config.items()}
        if self._resume_id is None:
            experiment = client.get_experiment_by_name(self._experiment)
            experiment_id = (
                client.create_experiment(self._experiment)
                if experiment is None
                else experiment.experiment_id
            )
            self.run_id = client.create_run(experiment_id, run_name=self._run_name).info.run_id
        else:
            params = self._reopen(trainer.work_dir, config, params)
            # it holds the steps up to the checkpoint's: each save waited for their writes
            history = []
        items = [self._param(key, value) for key, value in params.items()]
        client.log_batch(self.run_id, params=items)  # once (MlflowClient splits it in 100s)
        # a new run of a resumed run (its checkpoint saved without this writer): the rows before
        self._log([(row["iter"], _metrics(row)) for row in history])

    def _reopen(
        self, work_dir: str, config: dict[str, Any], params: dict[str, str]
    ) -> dict[str, str]:
        """Go on with the checkpoint's run: warn of the settings that differ from its params
        (compared as LoggerHook compares run.json), and return the params it lacks."""
        client = self._client
        self.run_id = self._resume_id
        self._resume_id = None
        logged = client.get_run(self.run_id).data.params
        old: dict[str, Any] = dict(logged)
        if "hooks" in old:  # logged as JSON
            try:
                old["hooks"] = json.loads(old["hooks"])
            except ValueError:
                pass
        before = settings_to_compare(old)
        now = settings_to_compare(config)
        changed = [
            f"{key}={_as_param(before[key])} (now {_as_param(value)})"
            for key, value in now.items()
            if key in before and _as_param(before[key]) != _as_param(value)
        ]
        if changed:
            logger.warning(
                f"MLflow run {self.run_id} keeps {', '.join(changed)}: MLflow's params cannot "
                f"change; {work_dir}/run.json has the new values; train(auto_resume=False) or "
                "another work_dir starts a new tracked run."
            )
        client.update_run(self.run_id, status="RUNNING")
        return {key: value for key, value in params.items() if key not in logged}

    def write(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self._log([(step, metrics)])

    def _log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Log each ``(step, metrics)`` of ``rows``, in the background."""
        now = int(time.time() * 1000)  # MLflow's timestamps are in milliseconds
        batch = [
            self._metric(name, value, now, step)
            for step, metrics in rows
            for name, value in self._tracked(metrics).items()
        ]
        # in the background: a server's round trip would hold training up at every log point
        operations = self._client.log_batch(self.run_id, metrics=batch, synchronous=False)
        if operations is not None:  # None: nothing to write
            self._pending.append(operations)
        if len(self._pending) > self._MAX_PENDING:
            self._pending.pop(0).wait()

    def flush(self) -> None:
        """Wait for the writes in flight, raising the error of one that failed."""
        pending, self._pending = self._pending, []
        for operations in pending:
            operations.wait()

    def close(self) -> None:
        if self._client is None:
            return
        client, self._client = self._client, None
        status = self._STATUS[self._progress.outcome]
        try:
            self.flush()
        except Exception:
            status = "FAILED"  # the error ends training: some metrics are missing
            raise
        finally:
            client.set_terminated(self.run_id, status=status)


def _check_answers(uri: str, seconds: float) -> None:
    """Raise RuntimeError if nothing at ``uri`` answers an HTTP request within ``seconds``."""
    import requests  # mlflow's dependency: MLflow's own requests go through it, as this one

    try:
        requests.head(uri, timeout=seconds).close()  # any answer is one: MLflow's will tell
    except requests.exceptions.SSLError:
        pass  # it spoke TLS: MLflow has its own TLS settings
    except (requests.ConnectionError, requests.Timeout) as e:
        parts = urllib.parse.urlsplit(uri)
        shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()  # no password
        raise RuntimeError(
            f"MLflowWriter: the tracking server {shown} did not answer within {seconds:g} s "
            f"({e}). Start it, or pass tracking_uri= one that runs (None: MLFLOW_TRACKING_URI)."
        ) from e


class WandbWriter(_TrackerWriter):
    """Metrics to a Weights & Biases run, each write's ``step`` as W&B's step, and the run's
    settings (``work_dir/run.json``) in its config; its files go in ``work_dir`` unless ``dir``
    says otherwise. Each writer has a run of its own (``reinit="create_new"``), beside any
    other. The run's id is saved in the checkpoints: a resumed run continues the same run,
    rewound (``wandb.init(resume_from=...)``) to just before the first row of metrics.jsonl,
    and logs the rows up to its checkpoint's step again (W&B may have lost some with a process
    killed outright), so that the run holds each step of metrics.jsonl once.
    When training ends, the run finishes with exit code 0 (to the end, or ``stop()``), 1 (an
    error) or 255 (a preemption signal or Ctrl-C), W&B's own codes: W&B shows the last two as
    failed. A metric named as one of W&B's own keys (``_step``...) or ``""`` goes under another
    name (``_step_``), said once. Needs ``pip install "hooktrainer[wandb]"``.

    Args:
        **init_kwargs: ``wandb.init``'s arguments (``project``, ``name``, ``mode``, ``config``
            (more settings)...), but ``resume``, ``resume_from`` and ``fork_from``: the writer
            resumes the run itself.
    """

    # W&B's exit codes (its own for an uncaught exception and a Ctrl-C), by outcome
    _EXIT_CODE = {"finished": 0, "failed": 1, "killed": 255}
    _tracker = "W&B"
    _tracker_name = staticmethod(_wandb_name)

    def __init__(self, **init_kwargs: Any) -> None:
        for name in ("resume", "resume_from", "fork_from"):
            if name in init_kwargs:  # a resumed run continues its checkpoint's W&B run itself
                raise TypeError(f"WandbWriter resumes runs itself: leave out {name}.")
        check_type("config", init_kwargs.get("config", {}), dict, "a dict of settings")
        super().__init__()
        try:  # an optional extra: imported by the runs that use it
            import wandb
        except ImportError as e:
            raise ImportError('WandbWriter needs wandb: pip install "hooktrainer[wandb]".') from e
        self._wandb = wandb
        self._kwargs = init_kwargs
        self._run: Any = None

    def start(self, trainer: Any, start_iter: int, config: dict[str, Any]) -> None:
        self._progress = trainer.progress
        # a run of its own, beside another WandbWriter's or your script's wandb.init
        kwargs = {"dir": trainer.work_dir, "reinit": "create_new", **self._kwargs}
        kwargs["config"] = {**config, **self._kwargs.get("config", {})}
        history, self._history = self._history, []
        if self._resume_id is not None:
            # Rewound to step N, W&B's run goes on from step N + 1. It may lack steps of the
            # stopped run's (a process killed outright loses what W&B had not written, to its
            # file every 15 s, or sent): rewound to just before the first row of metrics.jsonl,
            # it gets each again; without one (no metrics.jsonl), to start_iter
            first = history[0]["iter"] if history else start_iter + 1
            kwargs.pop("id", None)
            kwargs["resume_from"] = f"{self._resume_id}?_step={first - 1}"
            self._resume_id = None
        self._run = self._wandb.init(**kwargs)
        self.run_id = self._run.id
        for row in history:  # a new run of a resumed run's too (a checkpoint without its id)
            self.write(trainer, row["iter"], _metrics(row))

    def write(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        self._run.log(self._tracked(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            run.finish(exit_code=self._EXIT_CODE[self._progress.outcome])


# What a rerun or a resumed run finds: it drops what it will write again, and its new
# TensorBoard event file sorts after the others.


def _rewind_event_files(log_dir: str, step: int, new_writer: Callable[[], Any]) -> Any:
    """Drop the events of ``step`` and later from the trainer's event files in ``log_dir``, then
    return ``new_writer()``, a ``SummaryWriter`` whose event file sorts after the others."""
    _drop_events_from(log_dir, step)
    old = _event_files(log_dir)
    writer = new_writer()
    # TensorBoard reads a folder's event files in name order (and applies a purge_step only to
    # those before its own). A name is events.out.tfevents.<second>.<host>.<pid>.<n>, with n
    # counting the process's writers unpadded: a file could sort before one of the same second
    # (n=10 before n=9, or another pid), and its curves mix with the old ones. The next second's
    # name sorts after; one more than 2 s ahead means a clock set back: no use waiting.
    for _ in range(2):
        new = max(_event_files(log_dir) - old)
        if all(name < new for name in old) or max(map(_second, old)) > time.time() + 2:
            break
        writer.close()
        os.remove(os.path.join(log_dir, new))
        time.sleep(1 - time.time() % 1)
        writer = new_writer()
    return writer


def _second(name: str) -> int:
    """The second in an event file's name (``events.out.tfevents.<second>.<host>...``)."""
    field = name.split(".")[3]
    return int(field) if field.isdigit() else 0


def _event_files(log_dir: str) -> set[str]:
    return {name for name in os.listdir(log_dir) if "tfevents" in name}


def _drop_events_from(log_dir: str, step: int) -> None:
    """Remove the events of ``step`` and later from the trainer's event files in ``log_dir``
    (with TensorBoard's own reader and record writer); a file left with none is deleted."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    for name in sorted(os.listdir(log_dir)):
        path = os.path.join(log_dir, name)
        if not name.endswith(_SUFFIX) or not os.path.isfile(path) or os.path.islink(path):
            continue
        records = list(RawEventFileLoader(path).Load())  # a record cut short by a kill: dropped
        kept = [r for r in records if Event.FromString(r).step < step]
        # each record has a 16-byte header and footer: a size that differs means one cut short
        if len(kept) == len(records) and os.path.getsize(path) == sum(len(r) + 16 for r in records):
            continue
        if all(Event.FromString(r).HasField("file_version") for r in kept):  # no data left
            os.remove(path)
            continue

        def write(f: Any, kept: list[bytes] = kept) -> None:
            writer = RecordWriter(f)
            for record in kept:
                writer.write(record)

        atomic_write(path, write)


def _keep_lines_up_to(path: str, start_iter: int) -> tuple[list[dict[str, Any]], int]:
    """Keep the rows of ``metrics.jsonl`` of steps up to ``start_iter`` (iterations done), and
    return them and the CRC-32 of their lines. A line that is no row (cut short by a crash,
    without an integer ``iter``, or with a value that is not a number) is dropped, said once;
    the rows after it stay."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept: list[str] = []
    rows: list[dict[str, Any]] = []
    unread = []  # the numbers of the lines that are no row
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if (
            not isinstance(row, dict)
            or type(row.get("iter")) is not int
            or not all(type(value) in (int, float) for value in row.values())
        ):
            unread.append(number)
        elif row["iter"] <= start_iter:
            kept.append(line if line.endswith("\n") else line + "\n")
            rows.append(row)
    if unread:
        logger.warning(
            f"{path}: dropped {len(unread)} line(s) that hold no row of numbers with an integer "
            f"'iter' (line {', '.join(map(str, unread[:5]))}{', ...' if len(unread) > 5 else ''})."
        )
    data = "".join(kept).encode("utf-8")
    if kept != lines:
        atomic_write(path, lambda f: f.write(data))
    return rows, zlib.crc32(data)
