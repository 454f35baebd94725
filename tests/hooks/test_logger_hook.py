import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer import HookBase
from trainer.hooks import BestCheckpointHook, EvalHook
from trainer.writers import MetricWriter

from conftest import FakeClock, Tick, communicate, cpu_env, popen, read_scalars


def test_tensorboard_scalars_are_written_at_log_points(make_trainer):
    trainer = make_trainer(max_epochs=2, log_period=4)
    trainer.register_hook(EvalHook(1, lambda: {"val_acc": 0.25 * (trainer.cur_epoch + 1)}))
    trainer.train()
    scalars = read_scalars(trainer.tb_log_dir)
    # grouped: training, evaluation and times apart
    assert set(scalars) == {"train/lr", "train/total_loss", "time/data_time", "time/iter_time",
                            "eval/val_acc"}  # fmt: skip
    # at the steps that count the iterations done: the evaluation after iteration 8 at step 8
    assert [step for step, _ in scalars["train/total_loss"]] == [4, 8, 12, 16]
    assert scalars["eval/val_acc"] == [(8, 0.25), (16, 0.5)]
    assert scalars["train/lr"][-1] == (16, pytest.approx(0.05))  # StepLR halves after epoch 1
    # the value logged at the log point's iteration, not the console's window mean
    assert scalars["train/total_loss"][-1][1] == trainer.metric_storage["total_loss"].latest


def test_console_and_log_file_lines(make_trainer, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="trainer")
    trainer = make_trainer(max_epochs=2, log_period=4)
    trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.hooks.logger_hook"]
    progress = [line for line in lines if line.startswith("epoch")]
    assert len(progress) == 4
    # times with their units
    number, ms = r"[\d.e-]+", r"[\d.e-]+ m?s"
    pattern = (
        rf"epoch 2/2 \[4/8\]  iter 12/16  ETA \d+:\d\d:\d\d  lr 0\.05  total_loss {number}  "
        rf"data_time {ms}  iter_time {ms}"
    )
    assert re.fullmatch(pattern, progress[2]), progress[2]
    log_text = (tmp_path / "work" / "log.txt").read_text()
    assert progress[-1] in log_text
    assert "Run summary" in log_text
    # each save has a line of its own, after the log point it covers; deletions have none
    ckpt_dir = tmp_path / "work" / "checkpoints"
    saves = [line for line in lines if line.startswith("Writing")]
    assert saves == []  # LoggerHook's logger writes the metric lines; the trainer logs saves
    messages = [r.getMessage() for r in caplog.records]
    for n, it in ((1, 8), (2, 16)):
        line = (
            f"Writing checkpoint {ckpt_dir}/epoch_{n}.pth (after iteration {it}) in the background."
        )
        assert messages.count(line) == 1 and line in log_text
        assert messages.index(line) > messages.index(progress[2 * n - 1])
        done = f"Saved checkpoint {ckpt_dir}/epoch_{n}.pth (on disk)."
        assert messages.count(done) == 1 and done in log_text
        assert messages.index(done) > messages.index(line)
    assert "Deleted" not in log_text


class Recorder(MetricWriter):
    def __init__(self):
        self.calls, self.closed = [], False

    def write(self, trainer, iter, metrics):
        self.calls.append((iter, sorted(metrics)))

    def close(self):
        self.closed = True


def test_metrics_go_to_metrics_jsonl_and_to_your_writers(make_trainer):
    recorder = Recorder()
    trainer = make_trainer(max_epochs=2, log_period=4, metric_writers=[recorder])
    trainer.register_hook(EvalHook(1, lambda: {"val_acc": 0.25 * (trainer.cur_epoch + 1)}))
    trainer.train()
    lines = [json.loads(line) for line in open(os.path.join(trainer.work_dir, "metrics.jsonl"))]
    pairs = [(r["iter"], r["epoch"]) for r in lines]
    assert pairs == [(4, 1), (8, 1), (8, 1), (12, 2), (16, 2), (16, 2)]
    assert lines[1].keys() == {"iter", "epoch", "lr", "total_loss", "data_time", "iter_time"}
    assert lines[2] == {"iter": 8, "epoch": 1, "val_acc": 0.25}  # the epoch-end evaluation
    assert all("lr" in line for line in lines if "val_acc" not in line)  # log points, whole
    assert lines[-2]["total_loss"] == trainer.metric_storage["total_loss"].latest
    assert [(it, names) for it, names in recorder.calls] == [
        (r["iter"], sorted(set(r) - {"iter", "epoch"})) for r in lines
    ]
    assert recorder.closed


class Tracker(MetricWriter):
    """A writer with a run id to keep across a resume, as MLflowWriter and WandbWriter have."""

    def __init__(self, run_id):
        self.run_id, self.started, self.loaded = run_id, None, None

    def write(self, trainer, iter, metrics):
        pass

    def start(self, trainer, start_iter, config):
        self.started = (start_iter, config)

    def state_dict(self):
        return {"run_id": self.run_id}

    def load_state_dict(self, state):
        self.loaded = state


def test_your_writers_start_with_the_settings_and_resume_with_their_saved_state(make_trainer):
    first = [Tracker("a"), Tracker("b")]
    stopped = make_trainer(max_epochs=1, metric_writers=first)
    stopped.train()
    with open(os.path.join(stopped.work_dir, "run.json")) as f:
        assert first[0].started == (0, json.load(f))
    saved = torch.load(stopped.checkpointer.last_path, weights_only=True)
    writers = saved["hooks"]["LoggerHook"]["writers"]
    assert writers == {"Tracker": {"run_id": "a"}, "Tracker.1": {"run_id": "b"}}
    resumed = [Tracker(None), Tracker(None), Recorder()]  # Recorder: no saved state, given {}
    trainer = make_trainer(max_epochs=2, metric_writers=resumed)
    trainer.train()
    assert [w.loaded for w in resumed[:2]] == [{"run_id": "a"}, {"run_id": "b"}]
    assert resumed[0].started[0] == trainer.start_iter == 8
    assert resumed[0].started[1]["max_epochs"] == 2


def test_resuming_drops_the_metrics_lines_of_repeated_iterations(make_trainer):
    make_trainer(max_epochs=1, log_period=4).train()
    path = os.path.join(make_trainer(max_epochs=1).work_dir, "metrics.jsonl")
    with open(path, "a") as f:  # as if the run had gone on after its checkpoint, then died
        f.write(json.dumps({"iter": 12, "epoch": 2, "total_loss": 123.0}) + "\n")
        f.write('{"iter": 16, "ep')  # cut short
    make_trainer(max_epochs=2, log_period=4).train()
    lines = [json.loads(line) for line in open(path)]
    assert [r["iter"] for r in lines] == [4, 8, 12, 16]
    assert all(r.get("total_loss") != 123.0 for r in lines)


def test_the_eta_spreads_evaluation_time_over_the_iterations(make_trainer, caplog, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("trainer.writers.time", clock)
    monkeypatch.setattr("trainer.hooks.logger_hook.time", clock)

    def evaluate():  # and every evaluation 8 s
        clock.now += 8.0
        return {"acc": 1.0}

    trainer = make_trainer(max_epochs=2, log_period=4)
    trainer.register_hooks([Tick(clock, 1.0), EvalHook(1, evaluate)])  # 1 s per iteration
    trainer.train()
    etas = re.findall(r"iter (\d+)/16  ETA (\S+)", caplog.text)
    # after 12 iterations: 12 s of steps + 8 s of evaluation = 20 s, so 4 more take 6.7 s
    assert etas == [("4", "0:00:12"), ("8", "0:00:08"), ("12", "0:00:06"), ("16", "0:00:00")]


def test_the_summary_table_gives_the_time_by_hook_and_the_evaluated_metrics(
    make_trainer, caplog, monkeypatch, tmp_path
):
    clock = FakeClock()
    for module in ("trainer.hooks.registry", "trainer.writers", "trainer.hooks.logger_hook"):
        monkeypatch.setattr(f"{module}.time", clock)

    class Slow(HookBase):  # 0.5 s at every epoch's end
        def after_epoch(self):
            clock.now += 0.5

    trainer = make_trainer(max_epochs=2, log_period=4)
    values = {0: (0.5, 0.9), 1: (0.75, 0.8)}  # (val_loss, val_acc): the best acc is the first
    trainer.register_hook(
        EvalHook(1, lambda: dict(zip(("val_loss", "val_acc"), values[trainer.cur_epoch])))
    )
    trainer.register_hooks([Slow(), Tick(clock, 0.25)])  # 0.25 s per iteration
    trainer.train()
    seconds = trainer.hooks.seconds_by_class()
    assert seconds["Slow"] == 1.0 and seconds["Tick"] == 4.0
    (summary,) = [r.getMessage() for r in caplog.records if "Run summary" in r.getMessage()]
    rows = dict(re.split(r"  +", line.strip(), maxsplit=1) for line in summary.splitlines()[3:])
    work = str(tmp_path / "work")
    assert rows["wall time"] == "5 s for 16 iterations (3.2 it/s), iteration 16 of 16"
    assert rows["hook Tick"] == "4 s (80.0%)" and rows["hook Slow"] == "1 s (20.0%)"
    assert rows["val_loss"] == "final 0.75, best 0.5 (after iteration 8)"
    assert rows["val_acc"] == "final 0.8, best 0.9 (after iteration 8)"
    assert rows["last checkpoint"] == os.path.join(work, "checkpoints", "epoch_2.pth")
    assert rows["logs"] == f"log.txt, metrics.jsonl, tb_logs in {work}"

    caplog.clear()  # a rerun: nothing to train, the same metrics from the checkpoint
    rerun = make_trainer(max_epochs=2, log_period=4)
    rerun.train()
    assert (
        f"Nothing to train: {work} holds a finished run of 2 epochs (16 iterations) "
        f"({work}/checkpoints/epoch_2.pth). To train longer, raise max_epochs or max_iters; to "
        "start afresh, pass another work_dir or train(auto_resume=False)."
    ) in caplog.messages
    (summary,) = [r.getMessage() for r in caplog.records if "Run summary" in r.getMessage()]
    assert "no iteration to train: iteration 16 of 16" in summary
    assert "final 0.8, best 0.9 (after iteration 8)" in summary


def test_the_summarys_best_follows_the_mode_a_hook_judges_the_metric_by(make_trainer, caplog):
    scores = iter([3.0, 1.0, 7.0])  # "score" alone tells no mode: the hook's is "min"
    trainer = make_trainer(max_epochs=3)
    trainer.register_hooks(
        [EvalHook(1, lambda: {"score": next(scores)}), BestCheckpointHook("score", mode="min")]
    )
    trainer.train()
    (summary,) = [r.getMessage() for r in caplog.records if "Run summary" in r.getMessage()]
    assert "final 7, best 1 (after iteration 16)" in summary


def jsonl_iters(trainer):
    with open(os.path.join(trainer.work_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["iter"] for line in f]


def test_rerunning_a_finished_run_writes_no_metric_again(make_trainer):
    first = make_trainer(max_epochs=2, log_period=4)
    first.train()
    lines, scalars = jsonl_iters(first), read_scalars(first.tb_log_dir)
    rerun = make_trainer(max_epochs=2, log_period=4)
    rerun.train()  # resumes at the end: nothing to train, nothing new to write
    assert jsonl_iters(rerun) == lines == [4, 8, 12, 16]
    assert read_scalars(rerun.tb_log_dir) == scalars


def test_a_resumed_run_replaces_the_steps_it_repeats(make_trainer, tmp_path):
    whole = make_trainer(max_epochs=2, log_period=4, work_dir=tmp_path / "whole")
    whole.train()
    crashed = make_trainer(max_epochs=2, log_period=4)
    crashed.train()
    # as if the run had crashed after logging epoch 2 but before its checkpoint
    ckpt_dir = tmp_path / "work" / "checkpoints"
    os.remove(ckpt_dir / "epoch_2.pth")
    (ckpt_dir / "latest.txt").write_text("epoch_1.pth")
    resumed = make_trainer(max_epochs=2, log_period=4)
    resumed.train()
    assert resumed.start_iter == 8
    assert jsonl_iters(resumed) == [4, 8, 12, 16]
    scalars = read_scalars(resumed.tb_log_dir)
    assert [step for step, _ in scalars["train/total_loss"]] == [4, 8, 12, 16]
    assert scalars["train/total_loss"] == read_scalars(whole.tb_log_dir)["train/total_loss"]


def test_a_fresh_run_in_the_same_work_dir_does_not_mix_with_the_old_curves(make_trainer):
    make_trainer(max_epochs=2, log_period=4, lr=0.1).train()
    fresh = make_trainer(max_epochs=1, log_period=4, lr=0.01)
    fresh.train(auto_resume=False)
    scalars = read_scalars(fresh.tb_log_dir)
    assert [step for step, _ in scalars["train/total_loss"]] == [4, 8]
    assert scalars["train/lr"] == [(4, pytest.approx(0.01)), (8, pytest.approx(0.01))]
    assert jsonl_iters(fresh) == [4, 8]


def test_the_run_settings_go_to_run_json_and_tensorboard(make_trainer, tmp_path):
    trainer = make_trainer(max_epochs=1, enable_amp=True, clip_grad_norm=1.0)
    trainer.train()
    config = json.loads((tmp_path / "work" / "run.json").read_text())
    assert config["max_epochs"] == 1 and config["clip_grad_norm"] == 1.0
    assert config["work_dir"] == str(tmp_path / "work")
    assert (config["optimizer"], config["base_lrs"], config["lr_scheduler"]) == (
        "SGD",
        [0.1],
        "StepLR",
    )
    assert (config["batch_size"], config["world_size"], config["amp_dtype"]) == (4, 1, "bfloat16")
    assert config["torch"] == torch.__version__ and config["model"] == "TinyModel"
    assert config["compiled"] is False
    # the hooks that carry the other options, in run order
    assert config["hooks"] == trainer.hooks.info()
    assert "CheckpointHook (priority 80)" in config["hooks"]
    acc = EventAccumulator(trainer.tb_log_dir)
    acc.Reload()
    (event,) = acc.Tensors("run/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert '| optimizer | "SGD" |' in text and "| accumulation_steps | 1 |" in text


class OwnWriter(HookBase):
    """Logs a histogram each epoch with a SummaryWriter of its own in trainer.tb_log_dir."""

    def before_train(self):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.trainer.tb_log_dir)

    def after_epoch(self):
        weight = self.trainer.model_or_module.linear.weight.detach()
        self.writer.add_histogram("weights", weight, self.trainer.cur_iter + 1)  # iterations done

    def after_train(self):
        self.writer.close()


def test_your_own_events_in_tb_logs_survive_fresh_and_resumed_runs(make_trainer):
    trainer = make_trainer(max_epochs=2, log_period=4)
    trainer.register_hook(OwnWriter())
    trainer.train()
    resumed = make_trainer(max_epochs=3, log_period=4)
    resumed.register_hook(OwnWriter())
    resumed.train()
    acc = EventAccumulator(resumed.tb_log_dir, size_guidance={"histograms": 0})  # keep all
    acc.Reload()
    assert [e.step for e in acc.Histograms("weights")] == [8, 16, 24]
    steps = [step for step, _ in read_scalars(resumed.tb_log_dir)["train/total_loss"]]
    assert steps == [4, 8, 12, 16, 20, 24]


KILLED_AT_AN_EPOCH_END = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from conftest import build
from trainer import HookBase

class Kill(HookBase):
    priority = 100  # after the epoch's checkpoint

    def after_epoch(self):
        if self.trainer.cur_epoch == 2:
            self.trainer.checkpointer.wait()  # durable, and latest
            os.kill(os.getpid(), signal.SIGKILL)

trainer = build({work!r}, max_epochs=5, log_period=2)
trainer.register_hook(Kill())
trainer.train()
"""


@pytest.mark.slow
def test_tensorboard_keeps_every_log_point_once_after_a_kill(make_trainer, tmp_path):
    script = tmp_path / "killed.py"
    tests = os.path.dirname(os.path.dirname(__file__))
    work = str(tmp_path / "work")
    script.write_text(KILLED_AT_AN_EPOCH_END.format(tests=tests, work=work))
    proc = popen([sys.executable, str(script)], env=cpu_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    communicate(proc, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    resumed = make_trainer(max_epochs=5, log_period=2)
    resumed.train()
    assert resumed.start_iter == 24
    whole = make_trainer(max_epochs=5, log_period=2, work_dir=tmp_path / "whole")
    whole.train()
    losses = read_scalars(resumed.tb_log_dir)["train/total_loss"]
    assert [step for step, _ in losses] == list(range(2, 41, 2))  # every log point, once
    assert losses == read_scalars(whole.tb_log_dir)["train/total_loss"]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


class Idle(HookBase):
    """A hook that does nothing."""


def test_a_resume_with_other_settings_names_them_in_one_warning(make_trainer, caplog):
    first = make_trainer(max_epochs=1, log_period=4)
    first.train()
    work = first.work_dir
    caplog.clear()
    resumed = make_trainer(max_epochs=3, lr=0.01, log_period=2, clip_grad_norm=1.0)
    resumed.register_hook(Idle())
    resumed.train()
    assert warnings_of(caplog) == [
        f"Resuming the run in {work} with settings that differ from its run.json: max_epochs 1 "
        "-> 3, log_period 4 -> 2, clip_grad_norm 0.0 -> 1.0, base_lrs stays [0.1] (given "
        "[0.01]: the checkpoint restores it), hooks +Idle. To start a new run, pass another "
        "work_dir or train(auto_resume=False)."
    ]
    # run.json now holds the settings the resumed run trained with: the LR its checkpoint
    # restored, which the logged LR shows, and the rest as given
    config = json.loads((Path(work) / "run.json").read_text())
    assert (config["log_period"], config["base_lrs"]) == (2, [0.1])
    rows = [json.loads(line) for line in open(Path(work) / "metrics.jsonl")]
    # the tiny trainer's schedule halves the LR each epoch: from 0.1, not from the 0.01 given
    assert sorted({row["lr"] for row in rows if "lr" in row}) == [0.025, 0.05, 0.1]


def test_a_resume_that_only_trains_longer_says_so_calmly(make_trainer, caplog):
    make_trainer(max_epochs=1).train()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        longer = make_trainer(max_epochs=2)
        longer.train()
    assert warnings_of(caplog) == []
    line = f"Resuming the run in {longer.work_dir} to train longer: max_epochs 1 -> 2."
    assert line in caplog.messages


def test_a_resume_ignores_what_only_describes_the_machine(make_trainer, caplog, monkeypatch):
    first = make_trainer(max_epochs=1)
    first.train()
    config = json.loads((Path(first.work_dir) / "run.json").read_text())
    config.update(seed=123, torch="1.0", hooks=config["hooks"] + ["ProgressBarHook (priority 95)"])
    (Path(first.work_dir) / "run.json").write_text(json.dumps(config))
    caplog.clear()
    make_trainer(max_epochs=1).train()  # finished: nothing to train, no difference to name
    assert warnings_of(caplog) == []
    assert "Nothing to train: " in caplog.text


def test_nothing_to_train_names_the_run_and_its_other_settings(make_trainer, caplog):
    first = make_trainer(max_iters=6)
    first.train()
    work = first.work_dir
    saved = (Path(work) / "run.json").read_text()
    caplog.clear()
    make_trainer(max_iters=6, lr=0.5).train()  # a new script, the same work_dir
    assert warnings_of(caplog) == [
        f"Resuming the run in {work} with settings that differ from its run.json: base_lrs "
        "stays [0.1] (given [0.5]: the checkpoint restores it). To start a new run, pass "
        "another work_dir or train(auto_resume=False)."
    ]
    assert (
        f"Nothing to train: {work} holds a finished run of 6 iterations "
        f"({work}/checkpoints/iter_6.pth)."
    ) in caplog.text
    assert (Path(work) / "run.json").read_text() == saved  # still the run that trained


def test_what_a_hook_logs_in_after_iter_is_written_at_that_iterations_step(make_trainer):
    """Tensors, reduced and NaN-checked values a hook logs after the log point's transfer are
    that iteration's: written at its step, once, not at the next log point's."""

    class Counts(HookBase):
        def after_iter(self):
            it = self.trainer.cur_iter
            done = float(it + 1)
            self.trainer.log(it, smooth=False, plain=done, tensor=torch.tensor(done))
            self.trainer.log(it, smooth=False, reduce=True, reduced=done)
            self.trainer.log(it, smooth=False, check_finite=True, checked=torch.tensor(done))

    trainer = make_trainer(max_iters=10, by_epoch=False, log_period=4)
    trainer.register_hook(Counts())
    trainer.train()
    rows = [json.loads(line) for line in open(Path(trainer.work_dir) / "metrics.jsonl")]
    names = ("plain", "tensor", "reduced", "checked")
    logged = [(row["iter"], *(row[n] for n in names)) for row in rows if "plain" in row]
    assert logged == [(step, *[float(step)] * 4) for step in (4, 8, 10)]


def test_a_rerun_asking_for_fewer_epochs_than_its_run_did_changes_no_file(make_trainer, caplog):
    make_trainer(max_epochs=4).train()  # 8 iterations per epoch
    work = Path(make_trainer().work_dir)
    files = {path: path.read_bytes() for path in work.rglob("*") if path.is_file()}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        make_trainer(max_epochs=3).train()
    after = {path: path.read_bytes() for path in work.rglob("*") if path.is_file()}
    assert after.keys() - files.keys() <= {work / "log.txt"}  # the log grows; nothing else
    # (and .lock names the process holding it, since when: each run's own)
    kept = ("log.txt", ".lock")
    assert {p: b for p, b in after.items() if p.name not in kept} == {
        p: b for p, b in files.items() if p.name not in kept
    }
    assert f"Resumed from checkpoint {work}/checkpoints/epoch_4.pth after iteration 32." in (
        caplog.messages
    )
    assert (
        f"Nothing to train: {work} holds a finished run of 4 epochs (32 iterations) "
        f"({work}/checkpoints/epoch_4.pth)."
    ) in caplog.text
