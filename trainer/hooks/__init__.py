"""The hooks that ship with ``trainer``, one per file; those beyond the core's import lazily."""

from typing import TYPE_CHECKING

from ..lazy import lazy_exports as _lazy_exports
from .checkpoint_hook import CheckpointHook
from .distributed_hook import DistributedHook
from .hookbase import HookBase, Priority
from .logger_hook import LoggerHook
from .lr_update_hook import LRUpdateHook

# name -> module of the hooks a run may add
_EXTRAS = {
    "BestCheckpointHook": "best_checkpoint_hook",
    "EarlyStoppingHook": "early_stopping_hook",
    "EMAHook": "ema_hook",
    "EvalHook": "eval_hook",
    "ProfilerHook": "profiler_hook",
    "ProgressBarHook": "progress_bar_hook",
    "WatchdogHook": "watchdog_hook",
}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from .best_checkpoint_hook import BestCheckpointHook
    from .early_stopping_hook import EarlyStoppingHook
    from .ema_hook import EMAHook
    from .eval_hook import EvalHook
    from .profiler_hook import ProfilerHook
    from .progress_bar_hook import ProgressBarHook
    from .watchdog_hook import WatchdogHook
else:  # hidden from type checkers, which would take any name through it
    __getattr__, __dir__ = _lazy_exports(globals(), _EXTRAS)

__all__ = [
    "BestCheckpointHook", "CheckpointHook", "DistributedHook", "EarlyStoppingHook", "EMAHook",
    "EvalHook", "HookBase", "LoggerHook", "LRUpdateHook", "Priority", "ProfilerHook",
    "ProgressBarHook", "WatchdogHook",
]  # fmt: skip
