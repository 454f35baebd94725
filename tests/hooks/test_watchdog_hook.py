import time

import pytest

from trainer import HookBase
from trainer.hooks import WatchdogHook


class Stall(HookBase):
    def after_iter(self):
        if self.trainer.cur_iter == 6:
            stall_here()


def stall_here():
    time.sleep(1.5)


def test_a_hanging_iteration_dumps_every_stack_once(make_trainer, caplog):
    trainer = make_trainer(max_epochs=1)
    trainer.register_hooks([WatchdogHook(factor=5, min_seconds=0.2), Stall()])
    trainer.train()
    dumps = [r.getMessage() for r in caplog.records if "Stacks of every thread" in r.getMessage()]
    assert len(dumps) == 1, dumps
    assert dumps[0].startswith("Rank 0: iteration 7 has run for")  # cur_iter 6: the 7th
    assert "in stall_here" in dumps[0] and "Thread MainThread" in dumps[0]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="factor must be > 1"):
        WatchdogHook(factor=1)
    with pytest.raises(ValueError, match="window must be a positive int, got 0"):
        WatchdogHook(window=0)
    with pytest.raises(TypeError, match="window must be a positive int, got float 10.0"):
        WatchdogHook(window=10.0)
