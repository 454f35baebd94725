"""Trainer.stop(), EarlyStoppingHook and BestCheckpointHook."""

import os

import pytest
import torch

from trainer import HookBase
from trainer.hooks import BestCheckpointHook, EarlyStoppingHook, EvalHook


def load(path):
    return torch.load(path, weights_only=True)


class Counter(HookBase):
    """Counts iterations and after_train calls; calls stop() after iteration ``stop_at``."""

    def __init__(self, stop_at=None):
        self.iters, self.trained, self.stop_at = 0, 0, stop_at

    def after_iter(self):
        self.iters += 1
        if self.trainer.cur_iter == self.stop_at:
            self.trainer.stop()

    def after_train(self):
        self.trained += 1


def test_stop_ends_after_the_iteration_and_a_rerun_stays_stopped(make_trainer, tmp_path):
    trainer = make_trainer(max_epochs=2)  # 8 iterations per epoch
    counter = Counter(stop_at=5)
    trainer.register_hook(counter)
    trainer.train()
    assert (trainer.cur_iter, counter.iters, counter.trained) == (5, 6, 1)
    saved = load(os.path.join(trainer.ckpt_dir, "iter_6.pth"))
    assert saved["progress"]["stopped"] and saved["progress"]["inner_iter"] == 6
    assert open(os.path.join(trainer.ckpt_dir, "latest.txt")).read().strip() == "iter_6.pth"

    again, counter = make_trainer(max_epochs=2), Counter()
    again.register_hook(counter)
    again.train()
    assert (again.start_iter, counter.iters, counter.trained) == (6, 0, 1)

    # asked to, it trains on, exactly as if it had never stopped
    on = make_trainer(max_epochs=2)
    on.train(continue_after_stop=True)
    full = make_trainer(max_epochs=2, work_dir=tmp_path / "full")
    full.train()
    for a, b in zip(on.model.parameters(), full.model.parameters()):
        assert torch.equal(a, b)


def evaluating(trainer, values, *hooks):
    """Registers an EvalHook returning values[epoch] as "acc" after every epoch, then hooks."""
    trainer.register_hook(EvalHook(1, lambda: {"acc": values[trainer.cur_epoch]}))
    trainer.register_hooks(list(hooks))
    return trainer


def test_early_stopping_stops_after_patience_evaluations_without_improvement(make_trainer):
    values = [0.5, 0.6, 0.55, 0.6, 0.59, 0.9, 0.9, 0.9]  # 0.6 again is no improvement
    trainer = evaluating(make_trainer(max_epochs=8), values, EarlyStoppingHook("acc", 3))
    trainer.train()
    assert trainer.cur_epoch == 4  # epochs 3, 4 and 5 brought no improvement
    saved = load(os.path.join(trainer.ckpt_dir, "epoch_5.pth"))
    assert saved["progress"]["stopped"]
    assert saved["hooks"]["EarlyStoppingHook"] == {"best": 0.6, "bad_evals": 3}


def test_early_stopping_counts_on_after_resume(make_trainer):
    values = [0.5, 0.6, 0.55, 0.58, 0.9]
    evaluating(make_trainer(max_epochs=3), values, EarlyStoppingHook("acc", 2)).train()
    resumed = evaluating(make_trainer(max_epochs=5), values, EarlyStoppingHook("acc", 2))
    resumed.train()  # one evaluation without improvement before the resume, one after
    assert (resumed.start_iter, resumed.cur_epoch) == (24, 3)


def test_early_stopping_refuses_bad_arguments():
    with pytest.raises(ValueError, match="patience must be an int >= 1, got 0"):
        EarlyStoppingHook("acc", patience=0)
    with pytest.raises(ValueError, match="mode must be 'min' or 'max', got 'up'"):
        EarlyStoppingHook("acc", mode="up")


def test_best_checkpoint_keeps_the_best_epoch_across_resume(make_trainer):
    values = [0.5, 0.7, 0.6, 0.65, 0.69, 0.71]
    trainer = evaluating(make_trainer(max_epochs=4), values, BestCheckpointHook("acc"))
    trainer.train()
    ckpt = trainer.ckpt_dir
    best = load(os.path.join(ckpt, "best.pth"))
    assert best["progress"]["epoch"] == 2 and best["hooks"]["BestCheckpointHook"]["best"] == 0.7
    assert all(torch.equal(v, load(os.path.join(ckpt, "epoch_2.pth"))["model"][k])
               for k, v in best["model"].items())  # fmt: skip
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
