import json
import os
import re

import pytest
import torch

from trainer import HookBase
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
        ([0.9], "^eval_func must return a dict .*list"),
        ({"acc": "high"}, "^eval_func returned 'acc'='high', not a number"),
        ({"acc": torch.ones(2)}, "^eval_func returned 'acc'=tensor"),
    ],
)
def test_non_numbers_raise_type_errors(make_trainer, result, message):
    trainer = make_trainer(max_epochs=1)
    trainer.register_hook(EvalHook(1, lambda: result))
    with pytest.raises(TypeError, match=message):
        trainer.train()


def test_eval_func_must_be_callable():
    with pytest.raises(TypeError, match="^eval_func must be callable, got dict"):
        EvalHook(1, {"acc": 1})


def test_eval_func_runs_with_the_model_in_eval_mode(make_trainer):
    """As in core-pytorch-utils: dropout off during evaluation, back to train mode after."""
    seen = []
    trainer = make_trainer(max_epochs=2)
    x = torch.ones(64, 4)

    def evaluate():  # does not call model.eval() itself
        model = trainer.model
        with torch.no_grad():
            outputs = [model.linear(model.dropout(x)) for _ in range(2)]
        seen.append((model.training, torch.equal(*outputs)))
        return {"acc": 0.5}

    trainer.register_hook(EvalHook(1, evaluate))
    trainer.train()
    assert seen == [(False, True), (False, True)]  # no dropout: the same output twice
    assert trainer.model.training


def test_after_eval_can_be_fired_through_the_public_call_hooks(make_trainer):
    from trainer import HookBase

    received = []

    class Listener(HookBase):
        def after_eval(self, results):
            received.append(results)

    trainer = make_trainer(max_epochs=1)
    trainer.register_hook(Listener())
    trainer.hooks.call("after_eval", {"acc": 0.25})
    assert received == [{"acc": 0.25}]


def test_period_0_evaluates_at_the_end_only(make_trainer):
    iters = []
    trainer = make_trainer(max_epochs=3)
    trainer.register_hook(EvalHook(0, lambda: iters.append(trainer.cur_iter)))
    trainer.train()
    assert iters == [trainer.max_iters - 1]


@pytest.mark.parametrize(
    "period, error, message",
    [
        ("2", TypeError, r"^period .*got str"),
        (-1, ValueError, r"^period .*got -1"),
    ],
)
def test_a_bad_period_is_refused(period, error, message):
    with pytest.raises(error, match=message):
        EvalHook(period, lambda: None)


@pytest.mark.parametrize("name", ["total_loss", "lr", "iter_time", "loss_cls"])
def test_results_named_like_the_trainers_own_metrics_are_refused_when_first_logged(
    make_trainer, name
):
    class TwoLosses(torch.nn.Module):  # logs "loss_cls" in training
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, batch):
            x, y = batch
            return {"loss_cls": torch.nn.functional.mse_loss(self.linear(x), y)}

    trainer = make_trainer(model=TwoLosses(), max_epochs=3)
    trainer.register_hook(EvalHook(1, lambda: {name: 0.5}))
    with pytest.raises(ValueError, match=f"^eval_func returned '{name}', which would mix with"):
        trainer.train()
    assert trainer.cur_iter == 7  # at the first evaluation, not later


@pytest.mark.parametrize("name", ["iter", "epoch", "lr/group1", "grad_norm/optimizer_d"])
def test_a_name_the_trainer_writes_itself_is_refused_as_a_result(make_trainer, name):
    """``epoch`` made metrics.jsonl's rows read epoch 0.5; ``iter`` died in the metric storage
    (``got multiple values for argument 'iter'``)."""
    trainer = make_trainer(max_epochs=2)
    trainer.register_hook(EvalHook(1, lambda: {"acc": 0.5, name: 0.5}))
    message = f"^eval_func returned '{name}', a name the trainer writes itself"
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert trainer.cur_iter == 7  # at the first evaluation
    with open(os.path.join(trainer.work_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [(row["iter"], row["epoch"]) for row in rows] == [(4, 1), (8, 1)]  # log points only


def test_results_named_like_the_logging_arguments_are_logged(make_trainer):
    """A result named ``smooth`` died in the metric storage (``got multiple values for argument
    'smooth'``)."""
    trainer = make_trainer(max_epochs=1)
    trainer.register_hook(EvalHook(0, lambda: {"smooth": 0.25, "reduce": 0.5}))
    trainer.train()
    with open(os.path.join(trainer.work_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert {"iter": 8, "epoch": 1, "smooth": 0.25, "reduce": 0.5} in rows


def test_the_exact_forms_clash_names_metric_fn(make_trainer):
    def losses(model, batch):
        return {"total_loss": torch.ones(len(batch[0]))}

    trainer = make_trainer(max_epochs=1)
    trainer.register_hook(EvalHook(1, data_loader=[(torch.zeros(2, 4),)], metric_fn=losses))
    with pytest.raises(ValueError, match="^metric_fn returned 'total_loss', which would mix"):
        trainer.train()


def test_a_metric_fn_returning_a_bare_tensor_is_told_to_name_it(make_trainer):
    def per_sample_error(model, batch):
        return model.linear(batch[0]).squeeze(1)  # the values, without a name

    trainer = make_trainer(max_epochs=1)
    loader = [(torch.zeros(2, 4),)]
    trainer.register_hook(EvalHook(1, data_loader=loader, metric_fn=per_sample_error))
    with pytest.raises(TypeError, match=r"^metric_fn must return \{name: tensor .*Tensor"):
        trainer.train()


def test_two_eval_hooks_returning_one_name_are_refused(make_trainer):
    trainer = make_trainer(max_epochs=2)
    trainer.register_hooks([EvalHook(1, lambda: {"acc": 0.5}), EvalHook(1, lambda: {"acc": 0.7})])
    with pytest.raises(ValueError, match="returned 'acc', which would mix with the 'acc'"):
        trainer.train()


class LogsStat(HookBase):
    """Logs ``stat`` as its latest value, as a user's own training metric."""

    def after_iter(self):
        self.trainer.log(self.trainer.cur_iter, smooth=False, stat=1.0)


@pytest.mark.parametrize(
    "name, clash",
    [
        ("train/total_loss", "total_loss"),
        ("time/iter_time", "iter_time"),
        ("stat", "stat"),  # logged unsmoothed
        ("train/stat", "stat"),
    ],
)
def test_results_whose_tensorboard_tag_training_has_are_refused(make_trainer, name, clash):
    trainer = make_trainer(max_epochs=2)
    trainer.register_hooks([LogsStat(), EvalHook(1, lambda: {name: 0.5})])
    with pytest.raises(
        ValueError, match=re.escape(f"returned '{name}', which would mix with the '{clash}'")
    ):
        trainer.train()


def test_two_eval_hooks_sharing_a_tensorboard_tag_are_refused(make_trainer):
    trainer = make_trainer(max_epochs=2)
    trainer.register_hooks(
        [EvalHook(1, lambda: {"val_acc": 0.5}), EvalHook(1, lambda: {"eval/val_acc": 0.7})]
    )
    with pytest.raises(ValueError, match="'eval/val_acc', which would mix with the 'val_acc'"):
        trainer.train()


def test_after_a_resume_results_are_told_from_training_metrics(make_trainer, tmp_path):
    """A resumed EvalHook knows its earlier results' names from the checkpoint."""
    first = make_trainer(max_epochs=1)
    first.register_hooks([LogsStat(), EvalHook(1, lambda: {"val_acc": 0.5})])
    first.train()
    clash = make_trainer(max_epochs=2)
    clash.register_hooks([LogsStat(), EvalHook(1, lambda: {"val_acc": 0.5, "stat": 2.0})])
    with pytest.raises(ValueError, match="returned 'stat', which would mix with the 'stat'"):
        clash.train()


def test_an_eval_hook_logs_its_own_names_again_after_a_resume(make_trainer):
    first = make_trainer(max_epochs=1)
    first.register_hook(EvalHook(1, lambda: {"val_acc": 0.5}))
    first.train()
    resumed = make_trainer(max_epochs=2)
    resumed.register_hook(EvalHook(1, lambda: {"val_acc": 0.75}))
    resumed.train()
    assert resumed.metric_storage["val_acc"].latest == 0.75
