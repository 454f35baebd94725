import pytest
import torch

from trainer.hooks import EvalHook, HookBase


def plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)


def test_plateau_reads_the_eval_metric_once_per_new_value(make_trainer):
    lrs = []
    values = iter([1.0, 2.0, 3.0])  # worse every evaluation

    trainer = make_trainer(max_epochs=6, scheduler=plateau, plateau_metric="val_loss")
    trainer.register_hook(
        EvalHook(2, lambda: (lrs.append(trainer.lr), {"val_loss": next(values)})[1])
    )
    trainer.train()
    # evaluations at epochs 2, 4, 6: the first sets the best, each later one halves the LR;
    # epochs without a new value do not count as bad epochs
    assert lrs == pytest.approx([0.1, 0.1, 0.05])
    assert trainer.lr == pytest.approx(0.025)


def test_plateau_without_a_metric_name_judges_eval_metric_as_cpu_does(make_trainer):
    values = iter([1.0, 2.0, 3.0])
    trainer = make_trainer(max_epochs=3, scheduler=plateau)
    trainer.register_hook(EvalHook(1, lambda: {"Eval Metric": next(values)}))
    trainer.train()
    assert trainer.lr == pytest.approx(0.025)  # two worse evaluations after the first


def test_plateau_without_eval_metric_names_both_fixes(make_trainer):
    trainer = make_trainer(max_epochs=2, scheduler=plateau)
    trainer.register_hook(EvalHook(1, lambda: {"val_loss": 1.0}))
    with pytest.raises(RuntimeError) as error:
        trainer.train()
    message = str(error.value)
    assert "'Eval Metric'" in message and "by epoch 1" in message and "plateau_metric" in message


def test_plateau_metric_without_reduce_lr_on_plateau_is_refused(make_trainer, caplog):
    trainer = make_trainer(plateau_metric="acc")  # replaces the default LRUpdateHook
    with pytest.raises(ValueError, match="^plateau_metric is for ReduceLROnPlateau, not StepLR"):
        trainer.train()
    assert trainer.cur_iter == -1  # refused before the first iteration
    assert "Run summary" not in caplog.text  # LoggerHook never started: no summary to give


def test_iteration_schedule_steps_every_iteration(make_trainer):
    def step(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.1)

    trainer = make_trainer(max_iters=7, scheduler=step, by_epoch=False)
    trainer.train()
    assert trainer.lr == pytest.approx(0.1 * 0.1**2)  # 7 steps: two decays


def test_an_epoch_schedule_is_not_called_after_iterations_but_counts_them(make_trainer):
    def step(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    calls = []
    trainer = make_trainer(max_epochs=2, scheduler=step)
    scheduler = trainer.lr_scheduler
    original = scheduler.iter_update
    scheduler.iter_update = lambda: (calls.append(1), original())
    assert not scheduler.changes_per_iter
    trainer.train()
    assert calls == []  # nothing to do after an iteration
    assert scheduler.last_iter == 16  # counted at the epoch ends all the same
    assert trainer.lr == pytest.approx(0.1 * 0.5**2)

    warm = make_trainer(max_epochs=1, scheduler=step, warmup_t=4, work_dir=trainer.work_dir + "w")
    assert warm.lr_scheduler.changes_per_iter  # a warmup counted in iterations needs each one
    per_iter = make_trainer(
        max_iters=3, scheduler=step, by_epoch=False, work_dir=trainer.work_dir + "i"
    )
    assert per_iter.lr_scheduler.changes_per_iter


def test_a_plateau_metric_that_never_came_is_warned_about(make_trainer, caplog):
    trainer = make_trainer(max_epochs=2, scheduler=plateau, plateau_metric="val_los")  # a typo
    trainer.register_hook(EvalHook(1, lambda: {"val_loss": 1.0}))
    trainer.train()
    assert trainer.lr == pytest.approx(0.1)  # never stepped
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "'val_los'" in warning and "gave only: val_loss; set plateau_metric" in warning


def test_a_plateau_metric_logged_with_trainer_log_counts(make_trainer, caplog):
    class LogValLoss(HookBase):
        def after_epoch(self):  # after the evaluation, which gives other names
            self.trainer.log(self.trainer.cur_iter, smooth=False, val_loss=1.0)

    trainer = make_trainer(max_epochs=3, scheduler=plateau, plateau_metric="val_loss")
    trainer.register_hooks([EvalHook(1, lambda: {"acc": 0.5}), LogValLoss()])
    trainer.train()
    assert [r for r in caplog.records if r.levelname == "WARNING"] == []
