import pytest
import torch

from trainer.hooks import EvalHook


def test_results_are_logged_and_train_mode_restored(make_trainer):
    modes = []

    def evaluate():
        trainer.model.eval()
        modes.append(trainer.model.training)
        return {"acc": 0.5 + 0.1 * len(modes), "n": torch.tensor(3)}

    trainer = make_trainer(max_epochs=3)
    trainer.register_hook(EvalHook(2, evaluate))
    trainer.train()
    assert modes == [False, False]  # epochs 2 and 3 (the last)
    assert trainer.model.training
    storage = trainer.metric_storage
    assert storage.values_maybe_smooth["acc"] == (23, pytest.approx(0.7))
    assert storage["acc"].count == 2 and storage["n"].latest == 3.0


def test_iteration_based_eval_runs_every_period_and_last(make_trainer):
    iters = []
    trainer = make_trainer(max_iters=10)
    trainer.register_hook(EvalHook(4, lambda: iters.append(trainer.cur_iter)))
    trainer.train()
    assert iters == [3, 7, 9]


@pytest.mark.parametrize(
    "result, message",
    [
        ([0.9], "eval_func must return a dict of numbers \\(or None\\), got list"),
        ({"acc": "high"}, "'acc'='high' of type str"),
        ({"acc": torch.ones(2)}, "of type Tensor"),
    ],
)
def test_non_numbers_raise_type_errors(make_trainer, result, message):
    trainer = make_trainer(max_epochs=1)
    trainer.register_hook(EvalHook(1, lambda: result))
    with pytest.raises(TypeError, match=message):
        trainer.train()


def test_eval_func_must_be_callable():
    with pytest.raises(TypeError, match="eval_func must be callable, got dict"):
        EvalHook(1, {"acc": 1})
