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


def test_a_nan_metric_is_never_an_improvement(make_trainer, caplog):
    """NaN from the first evaluation on: it crashed formatting the best value, which was None."""
    values = [float("nan")] * 4
    trainer = evaluating(make_trainer(max_epochs=4), values, EarlyStoppingHook("acc", 2))
    trainer.train()
    assert trainer.cur_epoch == 1  # two evaluations of NaN, neither an improvement
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Early stopping")]
    assert "acc has not improved for 2 evaluations" in line and "NaN is never" in line


def test_after_a_best_nan_and_infinity_count_as_no_improvement(make_trainer):
    inf = float("inf")
    values = [0.5, float("nan"), 0.4, inf, inf, inf]
    trainer = evaluating(make_trainer(max_epochs=6), values, EarlyStoppingHook("acc", 3))
    trainer.train()
    assert trainer.cur_epoch == 5
    saved = load(os.path.join(trainer.ckpt_dir, "epoch_6.pth"))["hooks"]["EarlyStoppingHook"]
    assert saved == {"best": inf, "bad_evals": 2}  # inf once, then inf again: no better
