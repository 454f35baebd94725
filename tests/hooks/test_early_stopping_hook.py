"""EarlyStoppingHook: stops after `patience` evaluations without improvement, across resume."""

import os

import pytest

from trainer.hooks import EarlyStoppingHook

from conftest import evaluating, load


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
    with pytest.raises(ValueError, match="^patience .*got 0"):
        EarlyStoppingHook("acc", patience=0)
    with pytest.raises(TypeError, match="^patience .*got str"):
        EarlyStoppingHook("acc", patience="5")
    with pytest.raises(ValueError, match="^mode .*got 'up'"):
        EarlyStoppingHook("acc", mode="up")
