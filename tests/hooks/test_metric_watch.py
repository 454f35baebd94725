import pytest

from trainer.hooks import BestCheckpointHook, EarlyStoppingHook, EvalHook
from trainer.hooks.metric_watch import MetricWatch, infer_mode


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
