"""Profiles a window of iterations with torch.profiler."""

import logging
import os
from typing import Any, Optional

import torch

from ..distributed import get_rank
from ..misc import check_int
from .hookbase import HookBase, Priority

logger = logging.getLogger(__name__)


class ProfilerHook(HookBase):
    """Runs ``torch.profiler`` over ``num_iters`` iterations after the first ``start_iter`` ones
    (those of ``cur_iter`` ``start_iter`` on) and writes a Chrome-format trace that Perfetto
    (ui.perfetto.dev), ``chrome://tracing`` and TensorBoard's profiler plugin open:
    ``work_dir/profiler/rank{R}_iter{A}-{B}.pt.trace.json``, iterations A to B counted from 1.
    Every rank writes its own.

    Args:
        start_iter: The iterations before the profiled ones; a few warm ones are best.
        num_iters: How many iterations to profile.
        profiler_kwargs: More ``torch.profiler.profile`` arguments (``record_shapes``,
            ``profile_memory``, ``with_stack``...). CUDA activity is recorded when there is a GPU.

    Example::

        >>> hook = ProfilerHook(start_iter=20, num_iters=5, profiler_kwargs={"record_shapes": True})
    """

    priority = Priority.NORMAL

    def __init__(
        self, start_iter: int = 10, num_iters: int = 5, profiler_kwargs: Optional[dict] = None
    ) -> None:
        check_int("start_iter", start_iter, minimum=0)
        check_int("num_iters", num_iters, minimum=1)
        self._start = start_iter
        self._end = start_iter + num_iters  # exclusive
        self._kwargs = dict(profiler_kwargs or {})
        self._profiler: Any = None

    def before_iter(self) -> None:
        """Start profiling after ``start_iter`` iterations."""
        if self.trainer.cur_iter == self._start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._kwargs.setdefault("activities", activities)
            self._profiler = torch.profiler.profile(**self._kwargs)
            self._profiler.__enter__()

    def after_iter(self) -> None:
        """Stop and write the trace after the window's last iteration."""
        if self._profiler is not None and self.trainer.cur_iter == self._end - 1:
            self._finish()

    def after_train(self) -> None:
        """Write what was profiled if training ended inside the window."""
        if self._profiler is not None:
            self._finish()

    def _finish(self) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        folder = os.path.join(self.trainer.work_dir, "profiler")
        os.makedirs(folder, exist_ok=True)
        first = self._start + 1  # numbers, from 1
        last = self.trainer.cur_iter + 1
        path = os.path.join(folder, f"rank{get_rank()}_iter{first}-{last}.pt.trace.json")
        profiler.export_chrome_trace(path)
        logger.info(f"Wrote the profile of iterations {first}-{last} to {path}.")
