"""The :class:`~trainer.progress.DataStream` of a data loader without a length (a stream)."""

import collections
import time
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist

from .distributed import CpuGroup, get_world_size
from .progress import DataStream

_END = object()  # what next() returns at the end of a pass


class UnsizedDataStream(DataStream):
    """Passes that end when the loader's iterator does, which :meth:`has_next` finds out by
    fetching an iteration's batches ahead."""

    sized = False

    def __init__(self, data_loader: Any, cpu: Optional[CpuGroup] = None) -> None:
        super().__init__(data_loader, cpu)
        self._ahead: collections.deque = collections.deque()  # the batches fetched early
        self._drawn = 0  # batches drawn from the current pass
        self._restored_pass = False  # the current pass went on from the loader's own state

    def next_batch(self) -> Any:
        if self._ahead:
            return self._ahead.popleft()
        return super().next_batch()

    def _ended_early(self) -> str:
        return (
            "data_loader's pass ended inside an iteration: train_one_iter asked for more "
            "batches than accumulation_steps, which is what an iteration fetches ahead "
            "from a data loader without a length. Pass that many accumulation_steps."
        )

    def has_next(self, n: int) -> bool:
        """Whether the current pass has the ``n`` batches of another iteration, fetched now
        (:meth:`next_batch` returns them); a pass that ends with fewer drops them, as a loader
        with a length drops what is left over. Under torchrun every rank ends the pass when one
        rank's ends (a CPU flag over gloo, no device sync)."""
        start = time.perf_counter()
        if self._iter is None:
            self._iter = self._start_pass()
        while len(self._ahead) < n:
            batch = next(self._iter, _END)
            if batch is _END:
                break
            self._ahead.append(batch)
            self._drawn += 1
        self.data_time += time.perf_counter() - start
        full = len(self._ahead) == n
        if get_world_size() > 1:
            everyone = torch.tensor([int(full)], dtype=torch.int32)
            dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self._cpu.group)
            full = bool(everyone.item())
        if not full:
            if self._drawn < n and not self._restored_pass:
                raise RuntimeError(
                    f"data_loader yielded {self._drawn} batches in a pass, fewer than the "
                    f"{n} of one iteration (accumulation_steps). A generator yields once only: "
                    "pass an iterable whose __iter__ starts a new pass (a DataLoader, say)."
                )
            self._ahead.clear()
            self.pass_ended = True
        return full

    def release(self) -> None:
        self._ahead.clear()
        super().release()

    def end_pass(self) -> None:
        self._ahead.clear()
        self._drawn, self.pass_ended = 0, False
        super().end_pass()

    def _start_pass(self) -> Any:
        self._restored_pass = self._restored
        return super()._start_pass()


def stream_notice(scheduler: Any, hooks: Iterable[Any]) -> Optional[str]:
    """For a stream: what counts in epochs, which end only with its passes; None if nothing."""
    from .hooks import CheckpointHook

    by_epoch = []
    if scheduler.by_epoch and scheduler.torch_scheduler is not None:
        by_epoch.append("by_epoch=True steps lr_scheduler")
    if any(isinstance(hook, CheckpointHook) and hook.saves_by_epoch for hook in hooks):
        by_epoch.append("the CheckpointHook saves checkpoints")
    if not by_epoch:
        return None
    return (
        "data_loader has no length, so an epoch is one pass until its stream ends (never, for "
        f"an endless one), and {' and '.join(by_epoch)} only at such ends and at the end of "
        "training. To count iterations instead, pass by_epoch=False and checkpoint_period=0, "
        "and register CheckpointHook(period, by_epoch=False)."
    )
