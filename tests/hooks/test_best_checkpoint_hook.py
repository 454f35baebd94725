"""BestCheckpointHook: best.pth at each new best, remembered across resume."""

import os
import re
import time

import pytest
import torch

from trainer.hooks import BestCheckpointHook, EvalHook

from conftest import evaluating, load


@pytest.mark.slow  # three runs in one work dir: ~2.7 s
def test_best_checkpoint_keeps_the_best_epoch_across_resume(make_trainer):
    values = [0.5, 0.7, 0.6, 0.65, 0.69, 0.71]
    trainer = evaluating(make_trainer(max_epochs=4), values, BestCheckpointHook("acc"))
    trainer.train()
    ckpt = trainer.ckpt_dir
    best = load(os.path.join(ckpt, "best.pth"))
    assert best["progress"]["epoch"] == 2 and best["hooks"]["BestCheckpointHook"]["best"] == 0.7
    assert all(
        torch.equal(v, load(os.path.join(ckpt, "epoch_2.pth"))["model"][k])
        for k, v in best["model"].items()
    )
    # resumed, 0.69 does not beat the 0.7 it remembers; 0.71 does
    resumed = evaluating(make_trainer(max_epochs=5), values, BestCheckpointHook("acc"))
    resumed.train()
    assert load(os.path.join(ckpt, "best.pth"))["progress"]["epoch"] == 2
    evaluating(make_trainer(max_epochs=6), values, BestCheckpointHook("acc")).train()
    assert load(os.path.join(ckpt, "best.pth"))["progress"]["epoch"] == 6


def test_best_checkpoint_in_iteration_based_training_resumes_exactly(make_trainer, tmp_path):
    # evaluated every 3 iterations; best.pth is saved after the LR update and resumes exactly
    def build(work_dir, max_iters):
        t = make_trainer(max_iters=max_iters, work_dir=work_dir, by_epoch=False)
        t.register_hook(EvalHook(3, lambda: {"loss_seen": float(t.cur_iter)}))
        t.register_hook(BestCheckpointHook("loss_seen", mode="min"))
        return t

    first = build(tmp_path / "a", 12)
    first.train()
    best = load(os.path.join(first.ckpt_dir, "best.pth"))
    assert best["progress"]["inner_iter"] == 3  # the first evaluation was the best (2)
    resumed = build(tmp_path / "b", 12)
    resumed.train(resume_from_checkpoint=os.path.join(first.ckpt_dir, "best.pth"))
    for a, b in zip(resumed.model.parameters(), first.model.parameters()):
        assert torch.equal(a, b)


def test_every_save_is_named_once_and_a_new_best_names_its_file(make_trainer, caplog):
    trainer = evaluating(make_trainer(max_epochs=3), [0.5, 0.7, 0.6], BestCheckpointHook("acc"))
    trainer.train()
    messages = [r.getMessage() for r in caplog.records]
    saves = [
        m.split(" (")[0].removeprefix("Writing checkpoint ")
        for m in messages
        if m.startswith("Writing checkpoint")
    ]
    names = ["epoch_1.pth", "best.pth", "epoch_2.pth", "best.pth", "epoch_3.pth"]
    assert saves == [os.path.join(trainer.ckpt_dir, name) for name in names]
    on_disk = [
        m.split(" (")[0].removeprefix("Saved checkpoint ")
        for m in messages
        if m.startswith("Saved checkpoint")
    ]
    assert on_disk == saves  # one write at a time, each done before the next starts
    assert "New best acc: 0.5: saving best.pth." in messages
    assert "New best acc: 0.7 (was 0.5): saving best.pth." in messages
    log = open(trainer.log_file).read()
    assert log.count("Writing checkpoint") == 5 and log.count(" (on disk).") == 5


def test_the_summary_names_a_best_checkpoint_still_being_written(make_trainer, caplog, monkeypatch):
    """The first best, found at the last evaluation, is the last save, written in the
    background while the summary is logged: the summary left out its 'best checkpoint' row."""
    real = torch.save

    def slow(obj, f, *args, **kwargs):
        time.sleep(0.3 if f.name.endswith(".best.pth.tmp") else 0)
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", slow)
    trainer = evaluating(make_trainer(max_epochs=1), [0.7], BestCheckpointHook("acc"))
    trainer.train()
    best = os.path.join(trainer.ckpt_dir, "best.pth")
    assert re.search(rf"\nbest checkpoint +{re.escape(best)}\n", caplog.text)


def test_a_nan_is_never_a_new_best_nor_infinity_after_infinity(make_trainer, caplog):
    nan, inf = float("nan"), float("inf")
    trainer = make_trainer(max_epochs=5)
    evaluating(trainer, [nan, 0.5, nan, inf, inf], BestCheckpointHook("acc")).train()
    news = [r.getMessage() for r in caplog.records if r.getMessage().startswith("New best")]
    assert news == [
        "New best acc: 0.5: saving best.pth.",
        "New best acc: inf (was 0.5): saving best.pth.",
    ]
    assert load(os.path.join(trainer.ckpt_dir, "best.pth"))["progress"]["epoch"] == 4


@pytest.mark.parametrize(
    "name",
    [
        "latest.txt",  # the summary called the pointer the best checkpoint
        "epoch_1.pth",  # it held iteration 16, the epoch-1 checkpoint gone
        "epoch_3.pth",  # the final save overwrote the best
        "iter_8.pth",
        ".best.pth.tmp",  # deleted at the next start
        "best.pth.tmp.old",
        "epoch_2.pth/trainer.pth",  # in a sharded checkpoint's folder
        "best/latest.txt",  # a save in best/ points best/latest.txt at itself
        "previous/best.pth",  # where a fresh start moves the earlier run's checkpoints
    ],
)
def test_a_name_the_trainer_writes_itself_is_refused(name):
    with pytest.raises(ValueError, match=f"^file_name={re.escape(repr(name))} is a name the tr"):
        BestCheckpointHook("acc", file_name=name)


@pytest.mark.parametrize(
    "name", ["best.pth", "epoch_best.pth", "best_iter_8.pth", "iter_8.pt", "best/acc.pth"]
)
def test_other_names_hold_the_best_checkpoint(make_trainer, name):
    """In a sub-folder too: its save failed, blaming the disk, as the folder did not exist."""
    values = [0.5, 0.9, 0.7]
    trainer = make_trainer(max_epochs=3)
    evaluating(trainer, values, BestCheckpointHook("acc", file_name=name)).train()
    assert load(os.path.join(trainer.ckpt_dir, name))["progress"]["epoch"] == 2
    assert load(os.path.join(trainer.ckpt_dir, "epoch_3.pth"))["progress"]["epoch"] == 3
