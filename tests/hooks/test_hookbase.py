import re
import weakref

import pytest

from trainer import HookBase
from trainer.hooks import Priority

from conftest import Recorder


def test_the_docstring_pseudocode_is_the_real_call_order(make_trainer):
    recorder = Recorder()
    trainer = make_trainer(max_epochs=2, loader=None)
    trainer.register_hook(recorder)
    original = trainer.train_one_iter
    trainer.train_one_iter = lambda: (recorder._record("train_one_iter"), original())
    trainer.train()

    # Rebuild the documented order from the pseudocode and compare event by event.
    expected = [("before_train", 0, -1)]
    for epoch in range(2):
        expected.append(("before_epoch", epoch, epoch * 8 - 1))
        for it in range(epoch * 8, epoch * 8 + 8):
            expected += [("before_iter", epoch, it), ("train_one_iter", epoch, it)]
            expected.append(("after_iter", epoch, it))
        expected.append(("after_epoch", epoch, epoch * 8 + 7))
    expected.append(("after_train", 1, 15))
    assert recorder.events == expected

    doc = HookBase.__doc__
    order = re.findall(
        r"(before_train|before_epoch|before_iter|train_one_iter|after_iter|"
        r"after_epoch|after_train)\(\)",
        doc,
    )
    assert order == [
        "before_train", "before_epoch", "before_iter", "train_one_iter", "after_iter",
        "after_epoch", "after_train",
    ]  # fmt: skip


def test_trainer_is_a_weak_proxy(make_trainer):
    hook = HookBase()
    trainer = make_trainer()
    trainer.register_hook(hook)
    assert isinstance(hook.trainer, weakref.ProxyType)
    del trainer
    with pytest.raises(ReferenceError):
        _ = hook.trainer.cur_iter


def test_period_helpers(make_trainer):
    seen = []

    class Periods(HookBase):
        def after_iter(self):
            seen.append(
                (
                    self.trainer.cur_iter,
                    self.every_n_iters(3),
                    self.every_n_inner_iters(3),
                    self.is_last_inner_iter(),
                    self.is_last_iter(),
                )
            )

        def after_epoch(self):
            seen.append(("epoch", self.every_n_epochs(2), self.is_last_epoch()))

    trainer = make_trainer(max_iters=10)
    trainer.register_hook(Periods())
    trainer.train()
    assert seen == [
        (0, False, False, False, False), (1, False, False, False, False),
        (2, True, True, False, False), (3, False, False, False, False),
        (4, False, False, False, False), (5, True, True, False, False),
        (6, False, False, False, False), (7, False, False, True, False),
        ("epoch", False, False),
        (8, True, False, False, False), (9, False, False, True, True),
        ("epoch", True, True),
    ]  # fmt: skip


def test_stateless_hooks_are_not_checkpointed():
    class WithState(HookBase):
        def state_dict(self):
            return {"n": 1}

    assert not HookBase().checkpointable
    assert WithState().checkpointable


def test_priorities_are_ordered_as_documented():
    assert (
        Priority.DISTRIBUTED < Priority.NORMAL < Priority.EVAL < Priority.LR_UPDATE
        < Priority.CHECKPOINT < Priority.LOGGER
    )  # fmt: skip


def test_hooks_use_the_trainers_public_api_only():
    """No shipped hook reaches into the trainer's private attributes."""
    import glob
    import os

    import trainer.hooks

    folder = os.path.dirname(trainer.hooks.__file__)
    offenders = {}
    for path in glob.glob(os.path.join(folder, "*.py")):
        found = re.findall(r"trainer\._[a-z]\w*", open(path).read())
        if found:
            offenders[os.path.basename(path)] = found
    assert offenders == {}
