"""The hook registry: default hooks switched off or replaced, in one argument or call."""

import gc
import os

import pytest

from trainer.hooks import CheckpointHook, HookBase, LoggerHook, LRUpdateHook


def test_default_outputs_are_one_argument_away(make_trainer, tmp_path):
    trainer = make_trainer(
        max_epochs=1, tensorboard=False, metrics_jsonl=False, checkpoint_period=0
    )
    trainer.train()
    work = tmp_path / "work"
    assert sorted(os.listdir(work)) == [".lock", "checkpoints", "log.txt", "run.json"]
    assert os.listdir(work / "checkpoints") == []
    assert "CheckpointHook (priority 80)" not in trainer.hooks.info()
    assert trainer.metric_storage["total_loss"].count == 8  # logging goes on

    with_all = make_trainer(max_epochs=1, work_dir=tmp_path / "all")
    with_all.train()
    assert sorted(os.listdir(tmp_path / "all")) == [
        ".lock", "checkpoints", "log.txt", "metrics.jsonl", "run.json", "tb_logs",
    ]  # fmt: skip


def test_a_default_hook_is_replaced_by_unregistering_its_class(make_trainer):
    class EveryFourIterations(CheckpointHook):
        pass

    trainer = make_trainer(max_epochs=1)
    removed = trainer.unregister_hook(CheckpointHook)
    assert [type(h) for h in removed] == [CheckpointHook]
    trainer.register_hook(EveryFourIterations(period=4, by_epoch=False))
    trainer.train()
    assert sorted(os.listdir(trainer.ckpt_dir)) == ["epoch_1.pth", "iter_4.pth", "latest.txt"]
    assert trainer.hooks.info()[3] == "EveryFourIterations (priority 80)"


def test_unregister_one_instance_keeps_the_others(make_trainer):
    calls = []

    class Count(HookBase):
        def after_epoch(self):
            calls.append(self)

    first, second = Count(), Count()
    trainer = make_trainer(max_epochs=1)
    trainer.register_hooks([first, second])
    assert trainer.unregister_hook(first) == [first]
    trainer.train()
    assert calls == [second]
    assert [type(h) for h in trainer.unregister_hook(LoggerHook)] == [LoggerHook]


def test_a_hook_is_registered_once_and_on_one_trainer(make_trainer, tmp_path):
    trainer = make_trainer()
    hook = HookBase()
    trainer.register_hook(hook)
    with pytest.raises(ValueError, match="This HookBase is registered already: it would run twice"):
        trainer.register_hook(hook)
    other = make_trainer(work_dir=tmp_path / "other")
    with pytest.raises(ValueError, match="belongs to another trainer"):
        other.register_hook(hook)
    assert hook.trainer.work_dir == trainer.work_dir  # not re-pointed
    trainer.unregister_hook(hook)
    other.register_hook(hook)  # moved on purpose
    assert hook.trainer.work_dir == other.work_dir
    del trainer, other
    gc.collect()
    make_trainer(work_dir=tmp_path / "third").register_hook(hook)  # its trainer is gone


def test_an_after_iter_of_period_0_is_never_called(make_trainer):
    calls = []

    class EpochsOnly(HookBase):
        def after_iter_period(self):
            return 0

        def after_iter(self):
            calls.append("after_iter")

        def after_epoch(self):
            calls.append("after_epoch")

    trainer = make_trainer(max_epochs=2)
    trainer.register_hook(EpochsOnly())
    trainer.train()
    assert calls == ["after_epoch", "after_epoch"]


def test_checkpoints_are_called_after_the_iterations_of_their_period_only(make_trainer):
    calls = []

    class Recording(CheckpointHook):
        def after_iter(self):
            calls.append(self.trainer.cur_iter)
            super().after_iter()

    trainer = make_trainer(max_epochs=1)
    trainer.unregister_hook(CheckpointHook)
    trainer.register_hook(Recording(period=1, by_epoch=True))
    trainer.train()
    assert calls == []
    assert sorted(os.listdir(trainer.ckpt_dir)) == ["epoch_1.pth", "latest.txt"]

    calls.clear()
    by_iter = make_trainer(max_epochs=1, work_dir=trainer.work_dir + "_iter")
    by_iter.unregister_hook(CheckpointHook)
    by_iter.register_hook(Recording(period=4, by_epoch=False))
    by_iter.train()
    assert calls == [3, 7]  # its period, and the last iteration
    assert sorted(os.listdir(by_iter.ckpt_dir)) == ["epoch_1.pth", "iter_4.pth", "latest.txt"]


def test_the_after_iter_period_is_asked_again_when_training_starts(make_trainer):
    calls = []

    class Switchable(HookBase):
        active = True

        def after_iter_period(self):
            return 1 if self.active else 0

        def after_iter(self):
            calls.append(self.trainer.cur_iter)

    hook = Switchable()
    trainer = make_trainer(max_epochs=2)
    trainer.register_hook(hook)
    hook.active = False  # after registration: train() asks again
    trainer.train()
    assert calls == []


class EveryThird(HookBase):
    def __init__(self, calls, period=3):
        self.calls, self.period = calls, period

    def after_iter_period(self):
        return self.period

    def after_iter(self):
        self.calls.append(self.trainer.cur_iter)


def test_a_periodic_after_iter_is_called_after_its_period_and_the_last_iteration(
    make_trainer, tmp_path
):
    every, third = [], []
    trainer = make_trainer(max_iters=10)  # 8 iterations an epoch: the period crosses epochs
    trainer.register_hooks([EveryThird(every, period=1), EveryThird(third)])
    trainer.train()
    assert every == list(range(10))
    assert third == [2, 5, 8, 9]

    third.clear()
    resumed = make_trainer(max_iters=14)  # iterations 8 to 13
    resumed.register_hook(EveryThird(third))
    resumed.train(resume_from_checkpoint=os.path.join(trainer.ckpt_dir, "iter_8.pth"))
    assert third == [8, 11, 13]


def test_hooks_of_different_periods_are_each_called_after_their_own(make_trainer):
    third, fourth = [], []
    trainer = make_trainer(max_iters=13)
    trainer.register_hooks([EveryThird(third), EveryThird(fourth, period=4)])
    trainer.train()
    assert third == [2, 5, 8, 11, 12]
    assert fourth == [3, 7, 11, 12]


@pytest.mark.parametrize("period", [-1, 2.0, True])
def test_an_after_iter_period_that_is_not_an_int_of_0_or_more_is_refused(make_trainer, period):
    trainer = make_trainer()
    message = rf"EveryThird.after_iter_period\(\) must return an int >= 0, got {period!r}"
    with pytest.raises(ValueError, match=message):
        trainer.register_hook(EveryThird([], period=period))
    with pytest.raises(ValueError, match="period must be a positive int, got 0"):
        LoggerHook(period=0)
    with pytest.raises(TypeError, match="period must be a positive int, got float 50.0"):
        LoggerHook(period=50.0)


@pytest.mark.parametrize(
    "hook",
    [
        lambda: LRUpdateHook(),
        lambda: CheckpointHook(3, 2, by_epoch=False),
        lambda: LoggerHook(tensorboard=False),
    ],
)
def test_a_second_hook_of_a_default_hooks_class_is_refused_naming_the_swap(make_trainer, hook):
    trainer = make_trainer(max_epochs=1)
    new = hook()
    name = type(new).__name__
    match = rf"A {name} is registered already.*twice.*trainer.unregister_hook\({name}\)"
    with pytest.raises(ValueError, match=match):
        trainer.register_hook(new)
    trainer.unregister_hook(type(new))
    trainer.register_hook(new)  # in place of the default one
    assert sum(isinstance(h, type(new)) for h in trainer.hooks) == 1


def test_a_logger_hook_with_another_period_than_the_trainers_is_refused(make_trainer):
    trainer = make_trainer(max_epochs=1, log_period=4)
    trainer.unregister_hook(LoggerHook)
    trainer.register_hook(LoggerHook(period=3))
    with pytest.raises(ValueError, match=r"LoggerHook\(period=3\).* log_period=4"):
        trainer.train()


def test_a_hook_unregistered_by_an_earlier_one_in_the_same_event_is_not_called(make_trainer):
    calls = []

    class Remover(HookBase):
        priority = 10  # runs before the other

        def after_iter(self):
            if self.trainer.cur_iter == 2:
                self.trainer.unregister_hook(Removed)

    class Removed(HookBase):
        def after_iter(self):
            calls.append(self.trainer.cur_iter)  # self.trainer is None once unregistered

    trainer = make_trainer(max_iters=5)
    trainer.register_hooks([Remover(), Removed()])
    trainer.train()
    assert calls == [0, 1]
    assert not any(isinstance(hook, Removed) for hook in trainer.hooks)


def test_an_unknown_event_is_refused_naming_the_events(make_trainer):
    with pytest.raises(ValueError, match=r"event must be one of before_train, .*; got 'after_evl'"):
        make_trainer().hooks.call("after_evl", {})
