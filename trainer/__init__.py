"""trainer: a minimal, hook-based PyTorch training loop, with core-pytorch-utils' public names."""

from .distributed import (
    all_gather,
    gather,
    get_rank,
    get_world_size,
    init_distributed,
    is_main_process,
    reduce_dict,
)
from .history_buffer import HistoryBuffer
from .hooks import CheckpointHook, DistributedHook, EvalHook, HookBase, LoggerHook, LRUpdateHook
from .logger import setup_logger
from .lr_scheduler import LRWarmupScheduler
from .metric_storage import MetricStorage
from .misc import collect_env, set_random_seed
from .trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "CheckpointHook", "DistributedHook", "EvalHook", "HistoryBuffer", "HookBase", "LoggerHook",
    "LRUpdateHook", "LRWarmupScheduler", "MetricStorage", "Trainer", "all_gather", "collect_env",
    "gather", "get_rank", "get_world_size", "init_distributed", "is_main_process", "reduce_dict",
    "set_random_seed", "setup_logger",
]  # fmt: skip
