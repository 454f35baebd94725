import os

import pytest

from trainer.hooks import BestCheckpointHook, EarlyStoppingHook, EvalHook, HookBase, Priority
from trainer.hooks.metric_watch import MetricWatch, infer_mode

from conftest import load


@pytest.mark.parametrize(
    "names, mode",
    [
        (["val_loss", "eval/loss", "valError", "top1_err", "wer", "val_mse"], "min"),
        (["acc", "val_accuracy", "mAP50", "bbox_mAP", "f1_macro", "mIoU", "AP50"], "max"),
        (["step", "Eval Metric", "top5", "loss_acc", "lossy"], None),  # says nothing, or both
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
def test_a_name_that_does_not_tell_the_mode_is_refused(hook):
    with pytest.raises(ValueError) as error:
        hook("step")
    assert str(error.value) == (
        "mode: the name 'step' does not tell whether higher or lower is better. Pass mode='min' "
        "(a loss or an error) or mode='max' (an accuracy or a score)."
    )


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def warned_before_evaluation(caplog, n: int) -> bool:
    """Whether the first warning came before the n-th evaluation's line."""
    messages = [r.getMessage() for r in caplog.records]
    evaluations = [i for i, m in enumerate(messages) if m.startswith("Evaluation after")]
    return messages.index(warnings_of(caplog)[0]) < evaluations[n - 1]


def best_warning(when: str, names: str) -> str:
    return (
        f"BestCheckpointHook watches 'val_acc', but {when} gave only: {names}; no best.pth is "
        "written. Set metric to one of those."
    )


def test_a_misnamed_metric_is_warned_about_once_after_the_first_evaluation(make_trainer, caplog):
    trainer = make_trainer(max_epochs=3)
    trainer.register_hooks([
        EvalHook(1, lambda: {"loss": 1.0, "acc": 0.5}),
        BestCheckpointHook("val_acc"),
        EarlyStoppingHook("val_acc"),
    ])  # fmt: skip
    trainer.train()
    assert warnings_of(caplog) == [  # in the hooks' order
        "EarlyStoppingHook watches 'val_acc', but the evaluation after epoch 1 gave only: acc, "
        "loss; it never stops training early. Set metric to one of those.",
        best_warning("the evaluation after epoch 1", "acc, loss"),
    ]
    assert warned_before_evaluation(caplog, 2)  # by the end of epoch 1
    assert not os.path.exists(os.path.join(trainer.ckpt_dir, "best.pth"))


def test_the_right_name_is_not_warned_about(make_trainer, caplog):
    trainer = make_trainer(max_epochs=2)
    trainer.register_hooks([
        EvalHook(1, lambda: {"val_acc": 0.5}), BestCheckpointHook("val_acc"),
        EarlyStoppingHook("val_acc"),
    ])  # fmt: skip
    trainer.train()
    assert warnings_of(caplog) == []
    assert os.path.exists(os.path.join(trainer.ckpt_dir, "best.pth"))


def test_the_warning_waits_for_the_first_epoch_that_evaluated(make_trainer, caplog):
    trainer = make_trainer(max_epochs=4)
    trainer.register_hooks([EvalHook(2, lambda: {"acc": 0.5}), BestCheckpointHook("val_acc")])
    trainer.train()
    assert warnings_of(caplog) == [best_warning("the evaluation after epoch 2", "acc")]


def test_the_warning_waits_for_every_eval_hook_to_have_evaluated(make_trainer, caplog):
    # a quick evaluation every epoch, the full one every third: the first has no val_acc
    trainer = make_trainer(max_epochs=3)
    trainer.register_hooks([
        EvalHook(1, lambda: {"acc": 0.5}), EvalHook(3, lambda: {"val_acc": 0.5}),
        BestCheckpointHook("val_acc"),
    ])  # fmt: skip
    trainer.train()
    assert warnings_of(caplog) == []
    assert os.path.exists(os.path.join(trainer.ckpt_dir, "best.pth"))

    misnamed = make_trainer(max_epochs=4, work_dir=trainer.work_dir + "2")
    misnamed.register_hooks([
        EvalHook(1, lambda: {"acc": 0.5}), EvalHook(3, lambda: {"top1": 0.5}),
        BestCheckpointHook("val_acc"),
    ])  # fmt: skip
    misnamed.train()
    assert warnings_of(caplog) == [best_warning("the evaluations up to epoch 3", "acc, top1")]


class LateEvaluation(HookBase):
    """Gives ``val_acc`` to the after_eval hooks in its after_epoch, after the EvalHook's."""

    priority = Priority.LOGGER + 1

    def after_epoch(self):
        self.trainer.hooks.call("after_eval", {"val_acc": 0.5})


@pytest.mark.parametrize("first", ["judge", "eval"])
def test_a_metric_later_in_the_same_epoch_end_is_not_missing(make_trainer, caplog, first):
    judges = [BestCheckpointHook("val_acc"), EarlyStoppingHook("val_acc")]
    for judge in judges:  # before or after the EvalHook, which gives other names
        judge.priority = Priority.EVAL + (-1 if first == "judge" else 1)
    trainer = make_trainer(max_epochs=2)
    trainer.register_hooks([*judges, EvalHook(1, lambda: {"acc": 0.5}), LateEvaluation()])
    trainer.train()
    assert warnings_of(caplog) == []


def test_an_iteration_based_evaluation_is_judged_at_the_next_one(make_trainer, caplog):
    trainer = make_trainer(max_iters=24)  # 8 iterations per epoch, evaluated every 3
    trainer.register_hooks([EvalHook(3, lambda: {"acc": 0.5}), BestCheckpointHook("val_acc")])
    trainer.train()
    assert warnings_of(caplog) == [best_warning("the evaluation after iteration 3", "acc")]
    assert warned_before_evaluation(caplog, 3)  # at the second one


def test_a_metric_logged_with_trainer_log_is_not_judged_and_the_warning_says_so(
    make_trainer, caplog
):
    class LogValAcc(HookBase):
        def after_epoch(self):
            self.trainer.log(self.trainer.cur_iter, smooth=False, val_acc=0.5)

    trainer = make_trainer(max_epochs=2)
    trainer.register_hooks([
        EvalHook(1, lambda: {"acc": 0.5}), LogValAcc(), BestCheckpointHook("val_acc"),
    ])  # fmt: skip
    trainer.train()
    assert warnings_of(caplog) == [
        "BestCheckpointHook watches 'val_acc', but the evaluation after epoch 1 gave only: acc; "
        "no best.pth is written. Set metric to one of those, or return 'val_acc' from an "
        "EvalHook's function: BestCheckpointHook judges evaluation results, not values logged "
        "with trainer.log."
    ]


def test_a_run_without_evaluation_is_warned_about_at_its_end(make_trainer, caplog):
    trainer = make_trainer(max_epochs=2)
    trainer.register_hook(EarlyStoppingHook("val_acc"))
    trainer.train()
    assert warnings_of(caplog) == [
        "EarlyStoppingHook watches 'val_acc', but no evaluation ran, so it never stops training "
        "early. Register an EvalHook whose function returns it."
    ]


def test_a_resumed_run_knows_the_names_of_the_run_it_resumes(make_trainer, caplog):
    def run(max_epochs, metric):
        trainer = make_trainer(max_epochs=max_epochs)
        # the full evaluation every other epoch: after the resume, not yet evaluated
        trainer.register_hooks([
            EvalHook(1, lambda: {"acc": 0.5}), EvalHook(2, lambda: {"top1": 0.5}),
            BestCheckpointHook(metric),
        ])  # fmt: skip
        trainer.train()

    run(2, "top1_acc")
    assert warnings_of(caplog) == [
        "BestCheckpointHook watches 'top1_acc', but the evaluations up to epoch 2 gave only: "
        "acc, top1; no best.pth is written. Set metric to one of those."
    ]
    caplog.clear()
    run(3, "top1_acc")  # judged after epoch 3, whose evaluation gave acc: top1 came before
    assert warnings_of(caplog) == [
        "BestCheckpointHook watches 'top1_acc', but the evaluations so far gave only: "
        "acc, top1; no best.pth is written. Set metric to one of those."
    ]


def test_an_eval_hook_that_returns_none_does_not_hold_the_warning_back(make_trainer, caplog):
    """An EvalHook that only saves images, say, returns None: it has evaluated all the same."""
    trainer = make_trainer(max_epochs=3)
    trainer.register_hooks([
        EvalHook(1, lambda: {"val_loss": 0.5}), EvalHook(1, lambda: None),
        BestCheckpointHook("val_acc"),
    ])  # fmt: skip
    trainer.train()
    assert warnings_of(caplog) == [best_warning("the evaluation after epoch 1", "val_loss")]
    assert warned_before_evaluation(caplog, 2)
    state = load(os.path.join(trainer.ckpt_dir, "epoch_3.pth"))["hooks"]
    assert state["EvalHook_1"] == {"names": [], "evaluated": True}
