"""trainer: a minimal, hook-based PyTorch training loop, with core-pytorch-utils' public names."""

from .distributed import (
    all_gather,
    destroy_distributed,
    gather,
    get_rank,
    get_world_size,
    init_distributed,
    is_main_process,
    reduce_dict,
)
from .history_buffer import HistoryBuffer
from .hooks import (
    BestCheckpointHook,
    CheckpointHook,
    DistributedHook,
    EarlyStoppingHook,
    EMAHook,
    EvalHook,
    HookBase,
    LoggerHook,
    LRUpdateHook,
    Priority,
    ProfilerHook,
    ProgressBarHook,
    TimerHook,
    WatchdogHook,
)
from .logger import setup_logger
from .lr_scheduler import LRWarmupScheduler
from .metric_storage import MetricStorage
from .misc import collect_env, set_random_seed
from .trainer import Trainer

__version__ = "0.1.0"

# core-pytorch-utils' names, every hook of trainer.hooks, and the process-group helpers
__all__ = [
    "BestCheckpointHook",
    "CheckpointHook",
    "DistributedHook",
    "EarlyStoppingHook",
    "EMAHook",
    "EvalHook",
    "HistoryBuffer",
    "HookBase",
    "LoggerHook",
    "LRUpdateHook",
    "LRWarmupScheduler",
    "MetricStorage",
    "Priority",
    "ProfilerHook",
    "ProgressBarHook",
    "TimerHook",
    "Trainer",
    "WatchdogHook",
    "all_gather",
    "collect_env",
    "destroy_distributed",
    "gather",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "reduce_dict",
    "set_random_seed",
    "setup_logger",
]
