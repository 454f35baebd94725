import os

import pytest

from trainer.hooks import BestCheckpointHook, EarlyStoppingHook, EvalHook
from trainer.hooks.metric_watch import MetricWatch, infer_mode


@pytest.mark.parametrize(
    "names, mode",
    [
        (["val_loss", "eval/loss", "valError", "top1_err", "wer", "val_mse"], "min"),
        (["acc", "val_accuracy", "mAP50", "bbox_mAP", "f1_macro", "mIoU", "AP50"], "max"),
        (["step", "Eval Metric", "top5", "loss_acc", "lossy"], None),  # says nothing, or both
        # negated or a change: which way is better depends on the sign (scikit-learn's neg_
        # scorers are better high; they were taken for "min", accuracy_drop for "max")
        (["neg_log_loss", "neg_mean_squared_error", "accuracy_drop", "recall_neg"], None),
        (["loss_delta", "valAccGain", "error_reduction", "acc_diff", "gap_f1"], None),
    ],
)
def test_the_mode_is_inferred_from_the_words_of_the_name(names, mode):
    assert [infer_mode(name) for name in names] == [mode] * len(names)


def test_a_hook_without_mode_judges_a_loss_by_its_minimum(make_trainer):
    # val_loss falls, then rises: a hook that took it for "max" would stop after 2 epochs
    values = [3.0, 2.0, 1.0, 2.0, 3.0, 4.0]
    trainer = make_trainer(max_epochs=6)
    trainer.register_hook(EvalHook(1, lambda: {"val_loss": values[trainer.cur_epoch]}))
    trainer.register_hook(EarlyStoppingHook("val_loss", patience=2))
    trainer.train()
    assert trainer.cur_epoch == 4  # stopped 2 evaluations after the best (epoch 2)


@pytest.mark.parametrize("hook", [EarlyStoppingHook, BestCheckpointHook, MetricWatch])
@pytest.mark.parametrize("name", ["step", "neg_log_loss", "accuracy_drop", "brier_score"])
def test_a_name_that_does_not_tell_the_mode_is_refused(hook, name):
    with pytest.raises(ValueError, match=f"^mode: is '{name}' better high or low"):
        hook(name)
    hook(name, mode="max")


def test_the_mode_is_logged_once_by_each_hook(make_trainer, caplog):
    trainer = make_trainer(max_epochs=3)
    trainer.register_hook(EvalHook(1, lambda: {"val_loss": 1.0, "neg_log_loss": -1.0}))
    trainer.register_hooks(
        [EarlyStoppingHook("val_loss"), BestCheckpointHook("neg_log_loss", mode="max")]
    )
    trainer.train()
    lines = [r.getMessage() for r in caplog.records if " judges " in r.getMessage()]
    assert sorted(lines) == [
        "BestCheckpointHook judges neg_log_loss: higher is better (mode='max', given).",
        "EarlyStoppingHook judges val_loss: lower is better (mode='min', from the name).",
    ]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_misnamed_metric_is_warned_about_once_at_the_first_evaluation(make_trainer, caplog):
    trainer = make_trainer(max_epochs=3)
    evaluation = EvalHook(1, lambda: {"loss": 1.0, "acc": 0.5})
    trainer.register_hooks(
        [evaluation, BestCheckpointHook("val_acc"), EarlyStoppingHook("val_acc")]
    )
    trainer.train()
    warnings = warnings_of(caplog)
    assert len(warnings) == 2  # once per hook, not once per evaluation
    for hook, warning in zip(["EarlyStoppingHook", "BestCheckpointHook"], warnings):
        assert warning.startswith(f"{hook} watches 'val_acc'")
        assert "gave only: acc, loss; set metric" in warning
    messages = [r.getMessage() for r in caplog.records]
    evaluations = [i for i, m in enumerate(messages) if m.startswith("Evaluation after")]
    assert messages.index(warnings[-1]) < evaluations[1]  # at the first evaluation
    assert not os.path.exists(os.path.join(trainer.ckpt_dir, "best.pth"))


@pytest.mark.parametrize(
    "periods",
    [
        (1, None),  # one EvalHook
        (1, 3),  # a quick evaluation every epoch, the full one (with val_acc) every third
        (3, 1),  # the same, val_acc evaluated first
        (1, 1),  # both every epoch, the one with val_acc second
    ],
)
def test_the_right_name_is_not_warned_about(make_trainer, caplog, periods):
    quick, full = periods
    trainer = make_trainer(max_epochs=3)
    hooks = [EvalHook(full or quick, lambda: {"val_acc": 0.5})]
    if full is not None:
        hooks.insert(0, EvalHook(quick, lambda: {"acc": 0.5}))
    trainer.register_hooks([*hooks, BestCheckpointHook("val_acc"), EarlyStoppingHook("val_acc")])
    trainer.train()
    assert warnings_of(caplog) == []
    assert os.path.exists(os.path.join(trainer.ckpt_dir, "best.pth"))


def test_a_metric_that_came_before_the_resume_is_not_warned_about(make_trainer, caplog):
    values = iter([{"val_acc": 0.5}, {"val_acc": 0.6}, {"acc": 0.5}])  # the last without it

    def run(max_epochs):
        trainer = make_trainer(max_epochs=max_epochs)
        trainer.register_hooks([EvalHook(1, lambda: next(values)), BestCheckpointHook("val_acc")])
        trainer.train()

    run(2)
    run(3)  # its one evaluation lacks val_acc, which the metric storage holds from before
    assert warnings_of(caplog) == []
