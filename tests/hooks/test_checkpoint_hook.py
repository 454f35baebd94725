import os

import pytest
import torch

from trainer.hooks import CheckpointHook

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
