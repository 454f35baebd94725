import os

import pytest
import torch

from trainer import HookBase
from trainer.hooks import BestCheckpointHook, CheckpointHook, EvalHook, checkpoint_hook
from trainer.hooks.hookbase import Priority

from conftest import save_checkpoint_file


def listing(trainer):
    return sorted(os.listdir(trainer.ckpt_dir))


def latest(trainer):
    with open(os.path.join(trainer.ckpt_dir, "latest.txt")) as f:
        return f.read()


def test_iteration_based_training_counts_the_period_in_passes_by_default(make_trainer):
    trainer = make_trainer(max_iters=20, checkpoint_period=2)
    trainer.train()
    assert listing(trainer) == ["iter_16.pth", "iter_20.pth", "latest.txt"]  # 8 per pass


def test_epoch_checkpoints_with_period_and_final(make_trainer):
    trainer = make_trainer(max_epochs=5, checkpoint_period=2)
    trainer.train()
    assert listing(trainer) == ["epoch_2.pth", "epoch_4.pth", "epoch_5.pth", "latest.txt"]
    assert latest(trainer) == "epoch_5.pth"


def test_period_0_saves_at_the_end_only(make_trainer):
    trainer = make_trainer(max_epochs=3, checkpoint_period=0)  # no default CheckpointHook
    trainer.register_hook(CheckpointHook(period=0))
    trainer.train()
    assert listing(trainer) == ["epoch_3.pth", "latest.txt"]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"period": 1.0}, TypeError, r"an int >= 0 \(0 saves at the end only\), got float 1.0"),
        ({"period": -2}, ValueError, r"period must be an int >= 0 .*, got -2"),
        ({"max_to_keep": 0}, ValueError, r"max_to_keep must be a positive int \(or None to"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        CheckpointHook(**kwargs)


def test_iteration_checkpoints_wait_for_the_epoch_end(make_trainer):
    progress = {}
    trainer = make_trainer(
        max_iters=20, checkpoint_period=4, checkpoint_by_epoch=False, max_num_checkpoints=None
    )  # None keeps them all
    trainer.train()
    assert listing(trainer) == [
        "iter_12.pth",
        "iter_16.pth",
        "iter_20.pth",
        "iter_4.pth",
        "iter_8.pth",
        "latest.txt",
    ]
    for name in ("iter_4.pth", "iter_8.pth", "iter_12.pth"):
        data = torch.load(os.path.join(trainer.ckpt_dir, name), weights_only=True)
        progress[name] = (data["progress"]["epoch"], data["progress"]["inner_iter"])
    # iter_8 is the end of epoch 0 (8 iterations): saved after after_epoch, so it resumes at epoch 1
    assert progress == {"iter_4.pth": (0, 4), "iter_8.pth": (1, 0), "iter_12.pth": (1, 4)}
    assert latest(trainer) == "iter_20.pth"


def test_the_newest_3_checkpoints_are_kept_by_default(make_trainer):
    trainer = make_trainer(max_epochs=5)
    trainer.train()
    assert listing(trainer) == ["epoch_3.pth", "epoch_4.pth", "epoch_5.pth", "latest.txt"]


def test_max_to_keep_deletes_oldest_and_survives_resume(make_trainer):
    make_trainer(max_epochs=3, max_num_checkpoints=2).train()
    trainer = make_trainer(max_epochs=5, max_num_checkpoints=2)
    trainer.train()
    assert trainer.start_iter == 24
    assert listing(trainer) == ["epoch_4.pth", "epoch_5.pth", "latest.txt"]


def test_atomic_writes_leave_no_temporary_files(make_trainer):
    trainer = make_trainer(max_epochs=2)
    trainer.train()
    assert not [n for n in os.listdir(trainer.ckpt_dir) if n.startswith(".")]


@pytest.mark.parametrize("crafted", ["/abs", "../victim.pth", "../../work/victim.pth"])
def test_a_crafted_state_never_deletes_outside_the_checkpoint_folder(
    make_trainer, tmp_path, caplog, crafted
):
    make_trainer(max_epochs=1, max_num_checkpoints=1).train()
    ckpt_dir = make_trainer(max_epochs=1).ckpt_dir
    victim = tmp_path / "victim.pth" if crafted == "/abs" else tmp_path / "work" / "victim.pth"
    victim.write_text("keep me")
    name = str(victim) if crafted == "/abs" else crafted
    assert os.path.samefile(os.path.join(ckpt_dir, name), victim)  # what joining would delete
    path = os.path.join(ckpt_dir, "epoch_1.pth")
    data = torch.load(path, weights_only=True)
    data["hooks"]["CheckpointHook"]["saved"] = [name, "epoch_1.pth"]
    save_checkpoint_file(data, path)
    resumed = make_trainer(max_epochs=3, max_num_checkpoints=1)
    resumed.train()  # its saves delete the listed names beyond the newest one
    assert victim.read_text() == "keep me"
    assert listing(resumed) == ["epoch_3.pth", "latest.txt"]
    warned = [r for r in caplog.records if "among the checkpoints the loaded" in r.message]
    assert f"Ignoring {name!r} among the checkpoints the loaded state lists" in caplog.text
    assert {r.name for r in warned} == {"trainer.hooks.checkpoint_hook"}


def test_a_checkpoint_that_cannot_be_deleted_is_a_warning(make_trainer, monkeypatch, caplog):
    remove = os.remove

    def refuse(path):
        if path.endswith("epoch_1.pth"):
            raise PermissionError(1, "Operation not permitted", path)
        remove(path)

    monkeypatch.setattr(os, "remove", refuse)
    trainer = make_trainer(max_epochs=3, max_num_checkpoints=1)
    trainer.train()  # the failed delete of epoch_1.pth does not fail the write of epoch_2.pth
    assert listing(trainer) == ["epoch_1.pth", "epoch_3.pth", "latest.txt"]
    assert "Could not delete the old checkpoint" in caplog.text
    assert "epoch_1.pth (Operation not permitted); it stays, and training goes on." in caplog.text


# Timed checkpoints: the clock is injected (one minute per iteration), never slept on


def minute_per_iteration(monkeypatch, trainer):
    """The hook's clock reads one minute per iteration done."""
    monkeypatch.setattr(checkpoint_hook, "monotonic", lambda: 60.0 * (trainer.cur_iter + 1))


def timed(make_trainer, monkeypatch, max_iters=20, max_to_keep=None, **overrides):
    """Log points every 4 iterations, a timed save every 5 minutes (iterations)."""
    trainer = make_trainer(max_iters=max_iters, checkpoint_period=0, **overrides)
    trainer.register_hook(CheckpointHook(0, max_to_keep, every_minutes=5))
    minute_per_iteration(monkeypatch, trainer)
    return trainer


def test_a_timed_save_comes_at_the_first_log_point_after_the_interval(make_trainer, monkeypatch):
    trainer = timed(make_trainer, monkeypatch)
    trainer.train()
    # 5 minutes are up at iteration 5; the log points are 4, 8, ...: saved at 8, then 16
    # (8 minutes after the save at 8), and at the end
    assert listing(trainer) == ["iter_16.pth", "iter_20.pth", "iter_8.pth", "latest.txt"]
    # iteration 8 ends the first pass of 8: saved after its end, so it resumes exactly
    data = torch.load(os.path.join(trainer.ckpt_dir, "iter_8.pth"), weights_only=True)
    assert (data["progress"]["epoch"], data["progress"]["inner_iter"]) == (1, 0)


def test_the_clock_restarts_at_another_hooks_save(make_trainer, monkeypatch):
    trainer = timed(make_trainer, monkeypatch)
    accs = iter([0.5, 0.6, 0.7, 0.8])
    trainer.register_hook(EvalHook(6, lambda: {"acc": next(accs)}))
    trainer.register_hook(BestCheckpointHook("acc"))  # saves at 6, 12, 18 and 20
    trainer.train()
    # 2 minutes after best.pth at 6, not 8 after the start: 12 is the first timed save
    assert listing(trainer) == ["best.pth", "iter_12.pth", "iter_20.pth", "latest.txt"]


def test_timed_checkpoints_rotate_and_resume_exactly(make_trainer, monkeypatch, tmp_path):
    whole = timed(make_trainer, monkeypatch, 28, max_to_keep=2, work_dir=tmp_path / "whole")
    whole.train()
    assert listing(whole) == ["iter_24.pth", "iter_28.pth", "latest.txt"]  # saved at 8, 16, 24

    class Crash(HookBase):
        def after_iter(self):
            if self.trainer.cur_iter + 1 == 19:
                raise RuntimeError("crash")

    crashed = timed(make_trainer, monkeypatch, 28, max_to_keep=2, work_dir=tmp_path / "resumed")
    crashed.register_hook(Crash())
    with pytest.raises(RuntimeError, match="crash"):
        crashed.train()
    resumed = timed(make_trainer, monkeypatch, 28, max_to_keep=2, work_dir=tmp_path / "resumed")
    resumed.train()  # from iter_16.pth; the clock counts from the resume
    assert resumed.start_iter == 16
    assert listing(resumed) == listing(whole)
    for name in ("iter_24.pth", "iter_28.pth"):
        a = torch.load(os.path.join(whole.ckpt_dir, name), weights_only=True)
        b = torch.load(os.path.join(resumed.ckpt_dir, name), weights_only=True)
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert a["optimizer"]["state"][0]["momentum_buffer"].equal(
            b["optimizer"]["state"][0]["momentum_buffer"]
        )


def test_rotation_keeps_the_newest_and_every_kept_best(make_trainer, monkeypatch):
    """Periodic, timed and best checkpoints together, max_to_keep=1: what is deleted is an older
    periodic or timed checkpoint only."""
    accs = [0.9, 0.8, 0.3, 0.7]
    trainer = make_trainer(max_epochs=4, checkpoint_period=0)
    trainer.register_hook(CheckpointHook(1, max_to_keep=1, every_minutes=3))  # at 4, 12, ...
    trainer.register_hook(EvalHook(1, lambda: {"acc": accs[trainer.cur_epoch]}))
    trainer.register_hook(BestCheckpointHook("acc", top_k=2))
    minute_per_iteration(monkeypatch, trainer)
    saved = []

    class Listing(HookBase):
        priority = Priority.LOGGER

        def after_iter(self):  # after every save of the iteration, once they are on disk
            self.trainer.checkpointer.wait()
            saved.append(listing(self.trainer))

        def after_epoch(self):  # after every save of the epoch, once they are on disk
            self.trainer.checkpointer.wait()
            saved.append(listing(self.trainer))

    trainer.register_hook(Listing())
    trainer.train()
    best = ["best-iter=16-acc=0.8.pth", "best-iter=8-acc=0.9.pth"]
    periodic = []  # the periodic and timed checkpoints on disk, as they change
    for names in saved:
        names = [n for n in names if n.startswith(("epoch_", "iter_"))]
        if names and (not periodic or names != periodic[-1]):
            periodic.append(names)
    timed_and_epochs = "iter_4 epoch_1 iter_12 epoch_2 iter_20 epoch_3 iter_28 epoch_4".split()
    assert periodic == [[f"{name}.pth"] for name in timed_and_epochs]
    assert saved[-1] == [*best, "epoch_4.pth", "latest.txt"]


@pytest.mark.parametrize(
    "minutes, error",
    [
        (0, ValueError),
        (-1.5, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("30", TypeError),
        (True, TypeError),
    ],
)
def test_a_bad_every_minutes_is_refused(minutes, error):
    with pytest.raises(error, match="every_minutes must be a number of minutes"):
        CheckpointHook(every_minutes=minutes)
