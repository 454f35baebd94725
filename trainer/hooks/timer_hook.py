"""Times the iterations and logs the LR, at each log point."""

import time
from typing import Optional

from ..lr_scheduler import param_group_lrs
from .hookbase import HookBase, Priority


class TimerHook(HookBase):
    """At each log point (every ``log_period`` iterations and at the last): logs the period's
    mean seconds per iteration (``iter_time``, hooks included) and waiting for batches
    (``data_time``), each the slowest rank's under torchrun, and the LR each parameter group
    used in the iteration (``lr``, ``lr/group1``...), then moves the period's metrics off the
    device in one transfer (reduced over ranks), so that the hooks after it read them.

    Example::

        >>> hook = TimerHook()  # the Trainer registers one by default
    """

    priority = Priority.TIMER

    def __init__(self) -> None:
        self._start: Optional[tuple[float, int, float]] = None  # the period's (clock, iter, wait)

    def before_train(self) -> None:
        """Start the first period's clock."""
        self._start = (time.perf_counter(), self.trainer.cur_iter, self.trainer.data_seconds)

    def after_iter_period(self) -> int:
        """Every log point: every ``log_period``-th iteration, and the last."""
        return self.trainer.log_period

    def after_iter(self) -> None:
        """Log the period's times and the LRs, and make the log point."""
        trainer = self.trainer
        now = time.perf_counter()
        it = trainer.cur_iter
        waited = trainer.data_seconds
        start, before, waited_before = self._start
        n = it - before
        # the period's own means, not smoothed: a logged time says what this period took
        times = {"data_time": (waited - waited_before) / n, "iter_time": (now - start) / n}
        trainer.log(it, smooth=False, reduce=True, **times)
        # the LR this iteration used: LRUpdateHook, after this hook, sets the next one's
        trainer.log(it, smooth=False, **param_group_lrs(trainer.optimizer))
        trainer.metric_storage.flush(every_rank=True)  # note: the log period's one sync
        self._start = (now, it, waited)
