import contextlib
import glob
import io
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer import HookBase, Priority, writers
from trainer.hooks import EvalHook, ProgressBarHook
from trainer.writers import (
    MetricWriter,
    MLflowWriter,
    TensorBoardWriter,
    WandbWriter,
    tensorboard_tag,
)

from conftest import communicate, cpu_env, free_port, load, popen


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now

    def time(self):
        return 1_000_000.0 + self.now


def test_tensorboard_events_are_handed_over_in_batches_with_their_own_wall_time(
    tmp_path, monkeypatch
):
    clock = Clock()
    monkeypatch.setattr(writers, "time", clock)
    writer = TensorBoardWriter(str(tmp_path), handoff_secs=5.0)
    handed = []
    real_add = writer._writer.file_writer.add_summary
    monkeypatch.setattr(
        writer._writer.file_writer,
        "add_summary",
        lambda summary, step, wall_time: (
            handed.append((step, wall_time)) or real_add(summary, step, wall_time)
        ),
    )
    for step in range(3):  # 3 log points within 5 s: kept back
        writer.write(None, step, {"loss": float(step), "lr": 0.1})
        clock.now += 1.0
    assert handed == []
    clock.now += 3.0  # 6 s after the last hand-over: this write hands all four over
    writer.write(None, 3, {"loss": 3.0, "lr": 0.1})
    assert handed == [(0, 1_000_100.0), (1, 1_000_101.0), (2, 1_000_102.0), (3, 1_000_106.0)]
    writer.write(None, 4, {"loss": 4.0, "lr": 0.1})
    assert len(handed) == 4
    writer.close()  # hands over the rest
    assert handed[-1] == (4, 1_000_106.0)

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (s, float(s)) for s in range(5)
    ]
    assert [e.wall_time for e in acc.Scalars("train/lr")] == [w for _, w in handed]


def test_a_new_run_replaces_the_trainers_old_events_whatever_their_names_sort_as(tmp_path):
    # TensorBoard reads event files in name order; an old run's file from this very second whose
    # counter sorts after the new one's (9 after 10) would be read last and its curves kept
    old = TensorBoardWriter(str(tmp_path))
    for step in range(1, 5):
        old.write(None, step, {"loss": 1.0})
    old.close()
    (old_file,) = os.listdir(tmp_path)
    assert old_file.endswith(".trainer")
    # as if made in the coming second, by this process, with a counter that sorts last
    old_name = f"events.out.tfevents.{int(time.time()) + 1}.{socket.gethostname()}.{os.getpid()}"
    os.rename(tmp_path / old_file, tmp_path / f"{old_name}.z.trainer")
    new = TensorBoardWriter(str(tmp_path), start_iter=0)
    new.write(None, 1, {"loss": 2.0})
    new.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0)]
    assert len(os.listdir(tmp_path)) == 1  # the old file, left without events, is gone


def test_a_resumed_run_keeps_the_steps_before_it_and_other_writers_events(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    old = TensorBoardWriter(str(tmp_path))
    for step in range(1, 7):  # steps count the iterations done
        old.write(None, step, {"loss": float(step)})
    old.close()
    own = SummaryWriter(str(tmp_path))  # a user's writer in the same folder
    own.add_histogram("weights", torch.arange(4.0), 5)
    own.close()
    resumed = TensorBoardWriter(str(tmp_path), start_iter=3)  # after 3 iterations
    resumed.write(None, 4, {"loss": 40.0})
    resumed.write(None, 5, {"loss": 50.0})
    resumed.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    steps = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert steps == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]
    assert [e.step for e in acc.Histograms("weights")] == [5]


def test_files_a_resumed_run_rewrites_keep_the_permissions_open_gives(tmp_path):
    """Rewritten through a temporary file (0o600), they stayed private to the user."""
    umask = os.umask(0o022)
    try:
        old = TensorBoardWriter(str(tmp_path / "tb"))
        rows = writers.JSONLinesWriter(str(tmp_path / "metrics.jsonl"))
        for step in range(1, 7):
            old.write(None, step, {"loss": float(step)})
            rows.write(types.SimpleNamespace(cur_epoch=0), step, {"loss": float(step)})
        old.close()
        rows.close()
        TensorBoardWriter(str(tmp_path / "tb"), start_iter=4).close()
        writers.JSONLinesWriter(str(tmp_path / "metrics.jsonl"), start_iter=4).close()
    finally:
        os.umask(umask)
    rewritten, new = sorted(os.listdir(tmp_path / "tb"))  # no temporary file left either
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "tb"]
    for path in (tmp_path / "tb" / rewritten, tmp_path / "tb" / new, tmp_path / "metrics.jsonl"):
        assert os.stat(path).st_mode & 0o777 == 0o644, path
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_a_resume_keeps_every_row_of_metrics_jsonl_past_a_line_it_cannot_use(make_trainer, caplog):
    stopped = make_trainer(max_epochs=2)  # rows at iterations 4, 8, 12, 16
    stopped.train()
    path = os.path.join(stopped.work_dir, "metrics.jsonl")
    with open(path) as f:
        lines = f.readlines()
    # lines of another program's after the first row, and one cut short by a crash
    lines[1:1] = ['{"note": "lr lowered"}\n', '{"iter": 5, "note": "x"}\n', '{"iter": 5, "a\n']
    with open(path, "w") as f:
        f.writelines(lines)
    os.remove(os.path.join(stopped.ckpt_dir, "epoch_2.pth"))  # it resumes after iteration 8
    with open(os.path.join(stopped.ckpt_dir, "latest.txt"), "w") as f:
        f.write("epoch_1.pth")
    resumed = make_trainer(max_epochs=2)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        resumed.train()
    assert resumed.start_iter == 8
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    assert [row["iter"] for row in rows] == [4, 8, 12, 16]
    assert rows[:2] == [json.loads(line) for line in lines[:1] + lines[4:5]]  # kept as they were
    (warning,) = warnings(caplog)
    assert path in warning and "3 line(s)" in warning and "line 2, 3, 4" in warning


def test_a_resumed_runs_event_file_sorts_after_the_old_ones(tmp_path):
    # TensorBoard reads event files in name order: the old steps must come first
    old = TensorBoardWriter(str(tmp_path))
    for step in range(1, 7):  # steps count the iterations done
        old.write(None, step, {"loss": float(step)})
    old.close()
    (old_file,) = os.listdir(tmp_path)
    # as if made in this second, by this process, with a counter that sorts last
    old_name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.z"
    os.rename(tmp_path / old_file, tmp_path / f"{old_name}.trainer")
    resumed = TensorBoardWriter(str(tmp_path), start_iter=3)
    resumed.write(None, 4, {"loss": 40.0})
    resumed.close()
    assert sorted(os.listdir(tmp_path))[0] == f"{old_name}.trainer"
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    steps = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert steps == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_tensorboard_events_are_not_written_through_a_linked_folder(tmp_path):
    # a rerun rewrites the event files of its folder: one linked elsewhere stays untouched
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "events.out.tfevents.1.host.1.trainer").write_bytes(b"theirs")
    os.symlink(tmp_path / "elsewhere", tmp_path / "tb_logs")
    with pytest.raises(RuntimeError, match="tb_logs is a symbolic link.*remove it"):
        TensorBoardWriter(str(tmp_path / "tb_logs"))
    assert os.listdir(tmp_path / "elsewhere") == ["events.out.tfevents.1.host.1.trainer"]


# ----------------------------------------------------------------------------------------------
# Trackers: MLflow on a local SQLite store (the one MLflow recommends), W&B offline, each the
# real package


def jsonl_rows(trainer):
    with open(os.path.join(trainer.work_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def by_step(rows):
    """What a tracker shows at each step: the rows written at that ``iter``, merged (a log point
    and an evaluation after the same iteration)."""
    steps = {}
    for row in rows:
        steps.setdefault(row["iter"], {}).update(
            {k: v for k, v in row.items() if k not in ("iter", "epoch")}
        )
    return steps


def as_params(config):
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory):
    """An MLflow database with its tables, made once: MLflow makes them by running its
    migrations, about 1 s of CPU, where a copy takes 0.03 s."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_store(tmp_path, empty_mlflow_db):
    """A SQLite tracking URI under tmp_path, as docs/logging.md's recipe uses (what it needs,
    SQLAlchemy and Alembic, comes with the mlflow extra)."""
    shutil.copy(empty_mlflow_db, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def mlflow_history(client, run_id, name):
    """``(step, value)`` of metric ``name`` in the order written: by timestamp, then step (the
    writes reach MLflow in the background, not necessarily in order)."""
    history = client.get_metric_history(run_id, name)
    return [(m.step, m.value) for m in sorted(history, key=lambda m: (m.timestamp, m.step))]


def train_with(make_trainer, writer, max_epochs, *hooks):
    """A tiny run with ``writer``, logging every 4 iterations and evaluating after each epoch."""
    trainer = make_trainer(max_epochs=max_epochs, log_period=4, metric_writers=[writer])
    trainer.register_hook(EvalHook(1, lambda: {"val_acc": 0.25 * (trainer.cur_epoch + 1)}))
    trainer.register_hooks(list(hooks))
    trainer.train()
    return trainer


def as_if_crashed_before_the_last_checkpoint(trainer):
    """The run logged its last epoch, then died before its checkpoint was on disk."""
    checkpoints = os.path.join(trainer.work_dir, "checkpoints")
    os.remove(os.path.join(checkpoints, f"epoch_{trainer.cur_epoch + 1}.pth"))
    with open(os.path.join(checkpoints, "latest.txt"), "w") as f:
        f.write(f"epoch_{trainer.cur_epoch}.pth")


def test_mlflow_gets_the_settings_and_every_row_of_metrics_jsonl(make_trainer, mlflow_store):
    from mlflow.tracking import MlflowClient

    writer = MLflowWriter(mlflow_store, experiment_name="tiny", run_name="first")
    trainer = train_with(make_trainer, writer, max_epochs=2)
    client = MlflowClient(mlflow_store)
    run = client.get_run(writer.run_id)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"
    with open(os.path.join(trainer.work_dir, "run.json")) as f:
        assert run.data.params == as_params(json.load(f))
    rows = jsonl_rows(trainer)
    names = {name for row in rows for name in row} - {"iter", "epoch"}
    assert names == {"total_loss", "lr", "data_time", "iter_time", "val_acc"}
    for name in names:
        assert mlflow_history(client, writer.run_id, name) == [
            (row["iter"], row[name]) for row in rows if name in row
        ]


def test_mlflow_a_resumed_run_logs_to_the_same_run_repeating_the_steps_after_its_checkpoint(
    make_trainer, mlflow_store, caplog
):
    from mlflow.tracking import MlflowClient

    first = MLflowWriter(mlflow_store, experiment_name="tiny")
    stopped = train_with(make_trainer, first, max_epochs=2)
    before = jsonl_rows(stopped)
    as_if_crashed_before_the_last_checkpoint(stopped)
    resumed_writer = MLflowWriter(mlflow_store, experiment_name="tiny")
    with caplog.at_level(logging.WARNING, logger="trainer"):
        resumed = train_with(make_trainer, resumed_writer, max_epochs=3)
    assert resumed.start_iter == 8 and resumed_writer.run_id == first.run_id
    checkpoint = load(os.path.join(resumed.work_dir, "checkpoints", "epoch_1.pth"))
    assert checkpoint["hooks"]["LoggerHook"]["writers"] == {
        "MLflowWriter": {"run_id": first.run_id}
    }
    client = MlflowClient(mlflow_store)
    experiment = client.get_experiment_by_name("tiny").experiment_id
    assert [run.info.run_id for run in client.search_runs([experiment])] == [first.run_id]
    # MLflow keeps every value: steps 12 and 16, logged before the crash, have two each
    after = [row for row in jsonl_rows(resumed) if row["iter"] > resumed.start_iter]
    history = mlflow_history(client, first.run_id, "total_loss")
    assert history == [
        (row["iter"], row["total_loss"]) for row in before + after if "total_loss" in row
    ]
    assert [step for step, _ in history] == [4, 8, 12, 16, 12, 16, 20, 24]
    assert history[2] == history[4]  # the resume is exact: the same loss again
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["max_epochs"] == "2"  # params cannot change
    assert warnings(caplog) == [
        f"MLflow run {first.run_id} keeps max_epochs=2 (now 3): MLflow's params cannot change; "
        f"{resumed.work_dir}/run.json has the new values; train(auto_resume=False) or another "
        "work_dir starts a new tracked run."
    ]
    # a rerun of the finished run: nothing to train, no tracked run opened, the id kept
    rerun_writer = MLflowWriter(mlflow_store, experiment_name="tiny")
    rerun = train_with(make_trainer, rerun_writer, max_epochs=3)
    assert rerun.start_iter == 24 and rerun_writer.run_id is None
    assert rerun_writer.state_dict() == {"run_id": first.run_id}  # what a checkpoint would keep
    assert client.get_run(first.run_id).info.end_time == run.info.end_time
    assert len(client.get_metric_history(first.run_id, "total_loss")) == 8


def test_mlflow_a_relaunch_warns_of_no_change_that_is_not_a_setting(
    make_trainer, mlflow_store, tmp_path, caplog
):
    # What differs between launches of one run (LoggerHook does not compare it either): the
    # seed of a script that sets none, the torch version of another machine, a moved work_dir,
    # a progress bar drawn on a terminal
    from mlflow.tracking import MlflowClient

    first = MLflowWriter(mlflow_store, experiment_name="tiny")
    stopped = train_with(make_trainer, first, max_epochs=2)
    with open(os.path.join(stopped.work_dir, "run.json")) as f:
        first_config = json.load(f)
    as_if_crashed_before_the_last_checkpoint(stopped)
    os.rename(stopped.work_dir, tmp_path / "moved")
    resumed_writer = MLflowWriter(mlflow_store, experiment_name="tiny")
    resumed = make_trainer(
        work_dir=tmp_path / "moved", max_epochs=2, log_period=4, metric_writers=[resumed_writer]
    )
    resumed.register_hook(EvalHook(1, lambda: {"val_acc": 0.25 * (resumed.cur_epoch + 1)}))
    resumed.register_hook(ProgressBarHook(stream=io.StringIO()))
    # as another launch records them (build() seeds every trainer of the tests alike)
    resumed.run_config.update(seed=first_config["seed"] + 1, torch="9.9.9")
    with caplog.at_level(logging.WARNING, logger="trainer"):
        resumed.train()
    assert resumed.start_iter == 8 and resumed_writer.run_id == first.run_id
    assert warnings(caplog) == []
    # the params are the first launch's settings; run.json has this one's
    params = MlflowClient(mlflow_store).get_run(first.run_id).data.params
    assert params == as_params(first_config)
    with open(tmp_path / "moved" / "run.json") as f:
        config = json.load(f)
    assert (config["seed"], config["torch"]) == (first_config["seed"] + 1, "9.9.9")
    assert config["work_dir"] == str(tmp_path / "moved") != first_config["work_dir"]


class EndAt(HookBase):
    """Ends training after the log point of iteration ``n`` (it runs after LoggerHook), as
    ``how`` says: an error, a preemption signal, Ctrl-C or ``stop()``."""

    priority = Priority.LOGGER + 5

    def __init__(self, n, how):
        self.n, self.how = n, how

    def after_iter(self):
        if self.trainer.cur_iter + 1 != self.n:
            return
        if self.how == "error":
            raise RuntimeError("a bug in a hook")
        if self.how == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer saves, then exits with 143
        elif self.how == "Ctrl-C":
            raise KeyboardInterrupt  # as the handler raises it; the trainer exits with 130
        elif self.how == "stop":
            self.trainer.stop()


ENDINGS = [  # how training ends, what train() raises, the MLflow status, W&B's exit code
    ("error", RuntimeError, "FAILED", 1),
    ("SIGTERM", SystemExit, "KILLED", 255),
    ("Ctrl-C", SystemExit, "KILLED", 255),
    ("stop", None, "FINISHED", 0),
    ("the end", None, "FINISHED", 0),
]


@pytest.mark.parametrize("how, raises, status, exit_code", ENDINGS)
def test_trackers_mark_their_runs_as_training_ended(
    make_trainer, mlflow_store, monkeypatch, how, raises, status, exit_code
):
    # W&B's own run in the slow test below; here, the exit code the writer passes to it
    import wandb
    from mlflow.tracking import MlflowClient

    class Run:
        id = "run1"
        exit_codes = []

        def log(self, metrics, step):
            pass

        def finish(self, exit_code=None):
            self.exit_codes.append(exit_code)

    monkeypatch.setattr(wandb, "init", lambda **kwargs: Run())
    mlflow_writer = MLflowWriter(mlflow_store, experiment_name="tiny")
    wandb_writer = WandbWriter(project="tiny", mode="offline")
    trainer = make_trainer(max_epochs=2, log_period=4, metric_writers=[mlflow_writer, wandb_writer])
    trainer.register_hook(EndAt(6, how))
    if raises is None:
        trainer.train()
    else:
        with pytest.raises(raises):
            trainer.train()
    client = MlflowClient(mlflow_store)
    assert client.get_run(mlflow_writer.run_id).info.status == status
    assert Run.exit_codes == [exit_code]
    rows = jsonl_rows(trainer)  # what was logged before the end is there
    assert mlflow_history(client, mlflow_writer.run_id, "total_loss") == [
        (row["iter"], row["total_loss"]) for row in rows if "total_loss" in row
    ]


def test_a_tracker_added_on_resume_gets_the_rows_before_the_checkpoint(
    make_trainer, mlflow_store, monkeypatch
):
    import wandb
    from mlflow.tracking import MlflowClient

    inits, logged = [], []

    class Run:  # W&B's run (its own in the kill test): what the writer asks of it
        id = "run1"

        def log(self, metrics, step):
            logged.append((step, metrics))

        def finish(self, exit_code=None):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: inits.append(kwargs) or Run())
    stopped = make_trainer(max_epochs=1, log_period=4)  # no tracker: rows at 4 and 8
    stopped.register_hook(EvalHook(1, lambda: {"val_acc": 0.5}))
    stopped.train()
    mlflow_writer = MLflowWriter(mlflow_store, experiment_name="tiny")
    wandb_writer = WandbWriter(project="tiny", mode="offline")
    resumed = make_trainer(max_epochs=2, log_period=4, metric_writers=[mlflow_writer, wandb_writer])
    resumed.register_hook(EvalHook(1, lambda: {"val_acc": 0.5}))
    resumed.train()
    assert resumed.start_iter == 8
    rows = jsonl_rows(resumed)
    assert [row["iter"] for row in rows] == [4, 8, 8, 12, 16, 16]
    client = MlflowClient(mlflow_store)
    for name in ("total_loss", "val_acc"):
        assert mlflow_history(client, mlflow_writer.run_id, name) == [
            (row["iter"], row[name]) for row in rows if name in row
        ]
    (init,) = inits
    assert "resume_from" not in init  # a new W&B run
    assert logged == [(row["iter"], row_metrics(row)) for row in rows]


class HistoryRecorder(MetricWriter):
    """A writer of your own that records the rows ``load_history`` gives it."""

    def __init__(self):
        self.history = None

    def load_history(self, rows):
        self.history = rows

    def write(self, trainer, step, metrics):
        pass


def test_a_resume_replays_only_the_rows_its_checkpoints_run_wrote(make_trainer, caplog):
    """Resumed from a checkpoint that a fresh start had set aside, the writers got the fresh
    run's rows of metrics.jsonl as the checkpoint's run's (W&B logged them into its run)."""
    first = make_trainer(max_epochs=2, log_period=4)
    first.train()
    other = make_trainer(max_epochs=2, log_period=4, lr=0.05)  # a fresh start, which fails
    other.register_hook(EndAt(10, "error"))
    with pytest.raises(RuntimeError, match="a bug in a hook"):
        other.train(auto_resume=False)
    rows = [row for row in jsonl_rows(other) if row["iter"] <= 8]  # up to its checkpoint's
    assert [row["iter"] for row in rows] == [4, 8]
    # the failed run resumed: its rows are replayed
    recorder = HistoryRecorder()
    make_trainer(max_epochs=2, log_period=4, lr=0.05, metric_writers=[recorder]).train()
    assert recorder.history == rows
    assert not [w for w in warnings(caplog) if "metrics.jsonl" in w]
    # the first run resumed from its set-aside checkpoint: metrics.jsonl holds the other's rows
    (aside,) = glob.glob(os.path.join(first.ckpt_dir, "previous", "*", "epoch_1.pth"))
    recorder = HistoryRecorder()
    resumed = make_trainer(max_epochs=2, log_period=4, metric_writers=[recorder])
    resumed.train(resume_from_checkpoint=aside)
    assert resumed.start_iter == 8 and recorder.history == []
    (warning,) = [w for w in warnings(caplog) if "metrics.jsonl" in w]
    assert aside in warning


def row_metrics(row):
    return {k: v for k, v in row.items() if k not in ("iter", "epoch")}


def test_mlflow_writes_in_the_background_and_a_checkpoint_waits_for_the_writes(
    make_trainer, mlflow_store, monkeypatch
):
    """A write does not wait for MLflow's store (a server's round trip); the flush before each
    checkpoint does, so that a checkpoint covers no step that MLflow lacks."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking import MlflowClient
    from mlflow.utils.async_logging.run_operations import RunOperations

    # MLflow's store holds the metrics it gets until the first wait for a write
    waited, on_main_thread = threading.Event(), []
    store_log_batch, wait = SqlAlchemyStore.log_batch, RunOperations.wait

    def held_log_batch(self, run_id, metrics, params, tags):
        if metrics and threading.current_thread() is threading.main_thread():
            on_main_thread.append([m.step for m in metrics])  # training waits for it
        elif metrics:
            assert waited.wait(timeout=60), "no wait for the writes"
        return store_log_batch(self, run_id, metrics, params, tags)

    def first_waiting(self):
        waited.set()
        return wait(self)

    monkeypatch.setattr(SqlAlchemyStore, "log_batch", held_log_batch)
    monkeypatch.setattr(RunOperations, "wait", first_waiting)
    client = MlflowClient(mlflow_store)
    seen = {}

    class Look(HookBase):
        priority = Priority.LOGGER + 5  # after LoggerHook has written, and flushed at a save

        def after_iter(self):
            if self.trainer.cur_iter + 1 == 8:  # the 2nd log point: both written, none stored
                seen["written"] = mlflow_history(client, writer.run_id, "total_loss")

        def before_save_checkpoint(self):
            seen.setdefault("saved", []).append(
                (self.trainer.cur_iter + 1, mlflow_history(client, writer.run_id, "total_loss"))
            )

    writer = MLflowWriter(mlflow_store, experiment_name="tiny")
    trainer = make_trainer(max_epochs=2, log_period=4, metric_writers=[writer])
    trainer.register_hook(Look())
    trainer.train()
    rows = [(row["iter"], row["total_loss"]) for row in jsonl_rows(trainer) if "total_loss" in row]
    assert on_main_thread == []
    assert seen["written"] == []
    assert seen["saved"] == [(8, rows[:2]), (16, rows)]  # each checkpoint's steps are stored
    assert mlflow_history(client, writer.run_id, "total_loss") == rows


def test_mlflow_an_error_of_a_write_in_the_background_fails_training(
    make_trainer, mlflow_store, monkeypatch
):
    from mlflow.exceptions import MlflowException
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking import MlflowClient

    store_log_batch = SqlAlchemyStore.log_batch

    def failing_log_batch(self, run_id, metrics, params, tags):
        if any(m.step == 8 for m in metrics):
            raise MlflowException("the server said no")
        return store_log_batch(self, run_id, metrics, params, tags)

    monkeypatch.setattr(SqlAlchemyStore, "log_batch", failing_log_batch)
    writer = MLflowWriter(mlflow_store, experiment_name="tiny")
    trainer = make_trainer(max_epochs=2, log_period=4, metric_writers=[writer])
    with pytest.raises(MlflowException, match="the server said no"):
        trainer.train()
    assert trainer.cur_iter + 1 == 8  # surfaced at the save after it, before the checkpoint
    assert not os.path.exists(os.path.join(trainer.ckpt_dir, "epoch_1.pth"))
    assert MlflowClient(mlflow_store).get_run(writer.run_id).info.status == "FAILED"


NAMES = ["acc", "val/acc", "top-1 acc (%)", "loss:ce", "é", "a" * 250, "a" * 251, "acc@1", ""]
NAMES += [".", "..", "...", "..a", ".a", "a/..", "a/./b", "a//b", "/a", "a/", "//a", "a\nb", "x/"]


@pytest.mark.parametrize("name", NAMES)
def test_mlflow_takes_a_name_as_mlflow_itself_judges_it(name):
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_metric

    def refused(name):
        try:
            _validate_metric(name, 1.0, 0, 0)  # what MLflow checks of a metric it is given
        except MlflowException:
            return True
        return False

    mapped = writers._mlflow_name(name)
    assert (mapped == name) == (not refused(name))
    assert not refused(mapped)


def test_a_metric_name_mlflow_refuses_goes_under_one_it_takes_said_once(
    make_trainer, mlflow_store, caplog
):
    from mlflow.tracking import MlflowClient

    writer = MLflowWriter(mlflow_store, experiment_name="tiny")
    trainer = make_trainer(max_epochs=2, log_period=4, metric_writers=[writer])
    # MLflow refuses "acc@1"; its name there, "acc_1", is another result's
    results = {"acc@1": 0.5, "acc_1": 0.25, "val/acc": 0.75}
    trainer.register_hook(EvalHook(1, lambda: results))
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer.train()  # it used to fail at the first evaluation, before the first checkpoint
    assert warnings(caplog) == [
        "Metric 'acc@1' goes to MLflow as 'acc_1' (a name MLflow refuses).",
        "Metric 'acc_1' goes to MLflow as 'acc_1_2' (MLflow has 'acc_1' for 'acc@1').",
    ]
    client = MlflowClient(mlflow_store)
    rows = jsonl_rows(trainer)
    for name, tracked in (("acc@1", "acc_1"), ("acc_1", "acc_1_2"), ("val/acc", "val/acc")):
        assert mlflow_history(client, writer.run_id, tracked) == [
            (row["iter"], row[name]) for row in rows if name in row
        ]
    assert client.get_run(writer.run_id).info.status == "FINISHED"
    # the checkpoints keep the names, so that a resumed run meeting "acc_1" first keeps them
    checkpoint = load(os.path.join(trainer.ckpt_dir, "epoch_1.pth"))
    state = checkpoint["hooks"]["LoggerHook"]["writers"]["MLflowWriter"]
    assert state["names"] == {"acc@1": "acc_1", "acc_1": "acc_1_2"}
    as_if_crashed_before_the_last_checkpoint(trainer)
    resumed_writer = MLflowWriter(mlflow_store, experiment_name="tiny")
    resumed = make_trainer(max_epochs=2, log_period=4, metric_writers=[resumed_writer])
    resumed.register_hook(EvalHook(1, lambda: {"acc_1": 0.25, "acc@1": 0.5, "val/acc": 0.75}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        resumed.train()
    assert resumed.start_iter == 8 and warnings(caplog) == []
    assert [s for s, _ in mlflow_history(client, writer.run_id, "acc_1_2")] == [8, 16, 16]
    assert {v for _, v in mlflow_history(client, writer.run_id, "acc_1_2")} == {0.25}


def test_a_metric_name_wandb_drops_or_overwrites_goes_under_one_it_keeps(
    make_trainer, monkeypatch, caplog
):
    # W&B (0.31) drops a metric named "" and writes _step, _runtime, _timestamp and _wandb itself
    import wandb

    logged = []

    class Run:
        id = "run1"

        def log(self, metrics, step):
            logged.append((step, metrics))

        def finish(self, exit_code=None):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: Run())
    writer = WandbWriter(project="tiny", mode="offline")
    trainer = make_trainer(max_epochs=1, log_period=4, metric_writers=[writer])
    results = {"_step": 1.0, "": 2.0, "_timestamp": 3.0, "_private": 4.0}
    trainer.register_hook(EvalHook(1, lambda: results))
    with caplog.at_level(logging.WARNING, logger="trainer"):
        trainer.train()
    assert logged[-1] == (8, {"_step_": 1.0, "_": 2.0, "_timestamp_": 3.0, "_private": 4.0})
    assert warnings(caplog) == [
        f"Metric {name!r} goes to W&B as {name + '_'!r} (a name W&B refuses)."
        for name in ("_step", "", "_timestamp")
    ]


def test_mlflow_a_tracking_server_that_does_not_answer_fails_the_start_naming_it(
    make_trainer, monkeypatch
):
    """MLflow retried the first request for 4 minutes in silence."""
    nothing = f"http://127.0.0.1:{free_port()}"  # no server there
    trainer = make_trainer(max_epochs=1, metric_writers=[MLflowWriter(nothing)])
    with pytest.raises(
        RuntimeError, match=rf"server {nothing} did not answer.*refused.*tracking_uri="
    ):
        trainer.train()
    assert jsonl_rows(trainer) == [] and os.listdir(trainer.ckpt_dir) == []
    # one that takes the connection and never answers, named by MLFLOW_TRACKING_URI
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        silent = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", silent)
        monkeypatch.setattr(MLflowWriter, "_ANSWER_SECS", 0.1)
        trainer = make_trainer(max_epochs=1, metric_writers=[MLflowWriter()])
        with pytest.raises(RuntimeError, match=rf"server {silent} did not answer within 0.1 s"):
            trainer.train()


@contextlib.contextmanager
def answering_once(status=200, authorizations=None):
    """A local HTTP server that answers one HEAD request with ``status`` (noting its
    ``Authorization`` header in ``authorizations``); yields its ``host:port``."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            if authorizations is not None:
                authorizations.append(self.headers["Authorization"])
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Handler) as server:
        thread = threading.Thread(target=server.handle_request)
        thread.start()
        yield f"127.0.0.1:{server.server_address[1]}"
        thread.join(timeout=10)


@pytest.mark.parametrize("status", [200, 401, 404])
def test_mlflow_any_answer_of_a_tracking_server_is_one(status):
    with answering_once(status) as address:
        writers._check_answers(f"http://{address}", 10.0)


def test_mlflow_a_tracking_server_with_credentials_in_its_uri_is_reached():
    """urllib took "user:pw@127.0.0.1" for the host name, which MLflow's requests reaches."""
    authorizations = []
    with answering_once(authorizations=authorizations) as address:
        writers._check_answers(f"http://user:pw@{address}", 10.0)
    assert authorizations == ["Basic dXNlcjpwdw=="]  # base64 of user:pw


def test_mlflow_a_tracking_server_that_does_not_answer_is_named_without_its_password(
    make_trainer,
):
    port = free_port()  # no server there
    trainer = make_trainer(
        max_epochs=1, metric_writers=[MLflowWriter(f"http://user:secret@127.0.0.1:{port}")]
    )
    with pytest.raises(RuntimeError, match=rf"server http://127.0.0.1:{port} did not answer"):
        trainer.train()
    with open(trainer.log_file) as f:
        log = f.read()
    assert "did not answer" in log and "secret" not in log


def test_tracker_writers_refuse_bad_arguments_and_name_the_extra_to_install(monkeypatch):
    with pytest.raises(TypeError, match="^experiment_name .*got int 3"):
        MLflowWriter("file:./mlruns", experiment_name=3)
    with pytest.raises(TypeError, match="^tracking_uri .*got PosixPath"):
        MLflowWriter(tracking_uri=pathlib.Path("mlruns"))
    with pytest.raises(TypeError, match="^run_name .*got list"):
        MLflowWriter(run_name=["a"])
    with pytest.raises(TypeError, match="WandbWriter resumes runs itself: leave out resume"):
        WandbWriter(project="p", resume="allow")
    with pytest.raises(TypeError, match="^config .*got list"):
        WandbWriter(config=["a"])
    for name in ("mlflow", "mlflow.entities", "mlflow.tracking", "wandb"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install "hooktrainer\[mlflow\]"'):
        MLflowWriter("file:./mlruns")
    with pytest.raises(ImportError, match=r'pip install "hooktrainer\[wandb\]"'):
        WandbWriter(project="p")


def test_trackers_are_written_on_rank_0_only(make_trainer, mlflow_store, tmp_path, monkeypatch):
    # as rank 1 sees it
    monkeypatch.setattr("trainer.hooks.logger_hook.is_main_process", lambda: False)
    mlflow_writer = MLflowWriter(mlflow_store, experiment_name="tiny")
    wandb_writer = WandbWriter(project="tiny", mode="offline")
    trainer = make_trainer(max_epochs=1, metric_writers=[mlflow_writer, wandb_writer])
    trainer.train()  # W&B would start its service process: the test would fail (not slow)
    assert mlflow_writer.run_id is None and wandb_writer.run_id is None
    assert not os.path.exists(tmp_path / "mlruns")
    assert "wandb" not in os.listdir(trainer.work_dir) and "run.json" not in os.listdir(
        trainer.work_dir
    )


def wandb_segments(work_dir):
    """The records of each offline run folder under ``work_dir/wandb``, read by W&B's own
    reader (``wandb leet inspect --json``)."""
    segments = []
    for folder in sorted(glob.glob(os.path.join(work_dir, "wandb", "offline-run-*"))):
        proc = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", folder],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        segments.append([json.loads(line) for line in proc.stdout.splitlines()])
    return segments


def records(segment, kind):
    return [record[kind] for record in segment if record["type"] == kind]


def history(segment):
    """``{step: {metric: value}}`` of a segment's history, W&B's keys (``_step``...) left out."""
    rows = records(segment, "history")
    return {
        row["step"]["num"]: {k: v for k, v in row["item"].items() if not k.startswith("_")}
        for row in rows
    }


def branch_step(segment):
    """The step a segment rewound its run to (``wandb.init(resume_from=...)``); None if none
    (or if it has no run record: a process killed before W&B wrote any)."""
    branch = next(iter(records(segment, "run")), {}).get("branch_point")
    return None if branch is None else branch.get("value", 0)  # 0 is left out of the record


def tracked_history(segments):
    """The history of a W&B run whose segments are ``segments``, in the order they ran: each
    rewound to step N keeps the steps up to N and goes on from N + 1 (wandb-core ignores a
    write to N). Each step of the run shows once."""
    steps = {}
    for segment in segments:
        rewound = branch_step(segment)
        if rewound is not None:
            steps = {step: row for step, row in steps.items() if step <= rewound}
        assert not set(steps) & set(history(segment))
        steps.update(history(segment))
    return steps


@pytest.mark.slow  # W&B starts its service process (wandb-core), and the reader is another
def test_wandb_a_resumed_run_continues_the_same_run_rewound_each_step_once(
    make_trainer, tmp_path, monkeypatch
):
    import wandb

    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # not in $HOME
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    settings = wandb.Settings(console="off", silent=True)
    first = WandbWriter(project="tiny", mode="offline", settings=settings)
    # it fails after logging step 16, its last checkpoint being epoch 1's (step 8)
    with pytest.raises(RuntimeError, match="a bug in a hook"):
        train_with(make_trainer, first, 2, EndAt(16, "error"))
    work_dir = str(tmp_path / "work")
    with open(os.path.join(work_dir, "metrics.jsonl")) as f:
        before = by_step(json.loads(line) for line in f)
    assert list(before) == [4, 8, 12, 16]
    with open(os.path.join(work_dir, "run.json")) as f:
        first_config = json.load(f)
    second = WandbWriter(project="tiny", mode="offline", settings=settings)
    resumed = train_with(make_trainer, second, 3)
    assert resumed.start_iter == 8 and second.run_id == first.run_id
    with open(os.path.join(resumed.work_dir, "run.json")) as f:
        second_config = json.load(f)

    segments = wandb_segments(resumed.work_dir)
    assert len(segments) == 2
    (start,) = [s for s in segments if "branch_point" not in records(s, "run")[0]]
    (rewound,) = [s for s in segments if "branch_point" in records(s, "run")[0]]
    for segment, config in ((start, first_config), (rewound, second_config)):
        (run,) = records(segment, "run")
        assert run["run_id"] == first.run_id and run["project"] == "tiny"
        logged = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
        assert logged == config
    # the failed run's exit code, and the resumed run's
    assert [exit.get("exit_code", 0) for exit in records(start, "exit")] == [1]
    assert [exit.get("exit_code", 0) for exit in records(rewound, "exit")] == [0]
    # the first segment has each row the failed run wrote, steps 12 and 16 (after the
    # checkpoint it resumes from) included
    assert history(start) == before
    # The resumed run rewinds the W&B run to just before the first row of metrics.jsonl and
    # logs the rows up to its checkpoint's again (W&B may have lost some: see the kill test)
    branch = records(rewound, "run")[0]["branch_point"]
    assert branch == {"run": first.run_id, "metric": "_step", "value": 3}
    assert list(history(rewound)) == [4, 8, 12, 16, 20, 24]
    assert history(rewound)[8] == before[8] and "val_acc" in before[8]
    assert tracked_history([start, rewound]) == by_step(jsonl_rows(resumed))


KILLED_TRACKED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_writers import tracked_run
from trainer import HookBase, Priority

class Kill(HookBase):
    priority = Priority.LOGGER + 5  # after the log point is written

    def after_iter(self):
        if self.trainer.cur_iter + 1 == 13:
            self.trainer.checkpointer.wait()  # epoch_1.pth (8 iterations) on disk
            os.kill(os.getpid(), signal.SIGKILL)

tracked_run({work!r}, {store!r}, Kill()).train()
"""


def tracked_run(work_dir, mlflow_store, *hooks):
    """A run of 3 epochs of 8 iterations logging every 2 to MLflow and W&B (offline),
    evaluating after each epoch."""
    import wandb

    from conftest import build

    settings = wandb.Settings(console="off", silent=True)
    tracked = [
        MLflowWriter(mlflow_store, experiment_name="tiny"),
        WandbWriter(project="tiny", mode="offline", settings=settings),
    ]
    trainer = build(work_dir, max_epochs=3, log_period=2, metric_writers=tracked)
    trainer.register_hook(EvalHook(1, lambda: {"val_acc": 0.25 * (trainer.cur_epoch + 1)}))
    trainer.register_hooks(list(hooks))
    return trainer


@pytest.mark.slow  # a training process to kill, W&B's service process and W&B's reader
def test_after_a_kill_and_resume_the_tracked_runs_hold_every_row_of_metrics_jsonl(
    tmp_path, mlflow_store, monkeypatch
):
    """W&B had written none of the killed run's steps (its file is written every 15 s), and a
    resumed run rewound to its checkpoint's step: steps 2 to 8 were missing."""
    from mlflow.tracking import MlflowClient

    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # not in $HOME
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    work_dir = str(tmp_path / "work")
    script = tmp_path / "killed.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(KILLED_TRACKED.format(tests=tests, work=work_dir, store=mlflow_store))
    env = cpu_env()
    env.pop("WANDB_SERVICE", None)  # W&B's service of this process, if a test started one
    proc = popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True)
    _, err = communicate(proc, timeout=120)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    with open(os.path.join(work_dir, "metrics.jsonl")) as f:
        assert [json.loads(line)["iter"] for line in f] == [2, 4, 6, 8, 8, 10, 12]
    resumed = tracked_run(work_dir, mlflow_store)
    resumed.train()
    assert resumed.start_iter == 8
    rows = jsonl_rows(resumed)
    steps = by_step(rows)
    assert list(steps) == list(range(2, 25, 2))

    # W&B: each step once
    segments = wandb_segments(work_dir)
    assert len(segments) == 2
    assert tracked_history(segments) == steps
    # MLflow: every step, once up to the checkpoint's; it cannot rewind, so the steps logged
    # after the checkpoint, which the resumed run logs again, have two values
    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    for name in ("total_loss", "lr", "val_acc"):
        history = mlflow_history(client, run.info.run_id, name)
        logged = [(row["iter"], row[name]) for row in rows if name in row]
        assert sorted(set(history)) == logged
        assert [step for step, _ in history if step <= 8] == [s for s, _ in logged if s <= 8]


@pytest.mark.parametrize(
    "name, evaluated, tag",
    [
        ("total_loss", False, "train/total_loss"),
        ("lr", False, "train/lr"),
        ("lr/group1", False, "train/lr/group1"),
        ("grad_norm/optimizer_d", False, "train/grad_norm/optimizer_d"),
        ("iter_time", False, "time/iter_time"),
        ("acc", True, "eval/acc"),
        ("media/loss", False, "media/loss"),  # a name of yours with a / is its own tag
        ("val/acc", True, "val/acc"),
    ],
)
def test_one_rule_tags_every_metric(name, evaluated, tag):
    assert tensorboard_tag(name, evaluated) == tag


def test_the_console_line_leaves_out_only_the_lrs_of_other_groups(make_trainer, caplog):
    class Logs(HookBase):
        def after_iter(self):
            self.log(self.trainer.cur_iter, **{"lr/group_b": 0.5, "lr/group2x": 0.25}, smooth=False)

    trainer = make_trainer(max_iters=4, log_period=4, by_epoch=False)
    trainer.register_hook(Logs())
    with caplog.at_level(logging.INFO, logger="trainer"):
        trainer.train()
    (line,) = [m for m in caplog.messages if m.startswith("epoch") and "iter 4/4" in m]
    assert "  lr/group_b 0.5" in line and "  lr/group2x 0.25" in line


@pytest.mark.slow  # W&B starts its service process (wandb-core), and the reader is another
def test_two_wandb_writers_keep_a_run_each(make_trainer, tmp_path, monkeypatch):
    import wandb

    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):  # not in $HOME
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    settings = wandb.Settings(console="off", silent=True)
    a, b = (WandbWriter(project=p, mode="offline", settings=settings) for p in ("a", "b"))
    trainer = make_trainer(max_epochs=1, log_period=4, metric_writers=[a, b])
    trainer.train()
    assert a.run_id != b.run_id
    segments = wandb_segments(trainer.work_dir)
    runs = sorted((run["project"], run["run_id"]) for s in segments for run in records(s, "run"))
    assert runs == [("a", a.run_id), ("b", b.run_id)]
    assert [sorted(history(s)) for s in segments] == [[4, 8], [4, 8]]
