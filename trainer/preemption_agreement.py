"""How the ranks agree on a preemption under torchrun: every ``check_period`` iterations, an
asynchronous all-reduce of a CPU flag over the trainer's gloo group, started at one check and
read at the next, so that it never waits on the device nor stalls the loop."""

from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from .distributed import CpuGroup


class Agreement:
    """The ranks' checks: :meth:`check` starts one and returns the previous one's result."""

    def __init__(self, check_period: int, cpu: CpuGroup) -> None:
        self._check_period = check_period
        self._cpu = cpu  # open while training: its group is read at each check
        self._pending: Optional[tuple[Any, np.ndarray]] = None  # the check in flight

    def check(self, iteration: int, local: int) -> int:
        """After ``iteration``: the ranks' maximum of ``local`` at the previous check, if this
        is a check, else 0."""
        if (iteration + 1) % self._check_period:
            return 0
        agreed = self.finish()
        flag = np.array([local], dtype=np.int32)  # numpy-backed: reading it needs no device sync
        work = dist.all_reduce(
            torch.from_numpy(flag), op=dist.ReduceOp.MAX, group=self._cpu.group, async_op=True
        )
        self._pending = (work, flag)
        return agreed

    def finish(self) -> int:
        """Wait for the check in flight; its result, or 0 when there is none."""
        if self._pending is None:
            return 0
        (work, flag), self._pending = self._pending, None
        work.wait()
        return int(flag[0])
