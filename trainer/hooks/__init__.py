"""The hooks that ship with ``trainer``, one per file."""

from .best_checkpoint_hook import BestCheckpointHook
from .checkpoint_hook import CheckpointHook
from .distributed_hook import DistributedHook
from .early_stopping_hook import EarlyStoppingHook
from .ema_hook import EMAHook
from .eval_hook import EvalHook
from .hookbase import HookBase, Priority
from .logger_hook import LoggerHook
from .lr_update_hook import LRUpdateHook
from .profiler_hook import ProfilerHook
from .progress_bar_hook import ProgressBarHook
from .timer_hook import TimerHook
from .watchdog_hook import WatchdogHook

__all__ = [
    "BestCheckpointHook",
    "CheckpointHook",
    "DistributedHook",
    "EarlyStoppingHook",
    "EMAHook",
    "EvalHook",
    "HookBase",
    "LoggerHook",
    "LRUpdateHook",
    "Priority",
    "ProfilerHook",
    "ProgressBarHook",
    "TimerHook",
    "WatchdogHook",
]
