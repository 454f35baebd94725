"""trainer: a minimal, hook-based PyTorch training loop, with core-pytorch-utils' public names."""

from typing import TYPE_CHECKING

from .distributed import all_gather, gather, get_rank, get_world_size, is_main_process
from .env import collect_env
from .hooks import CheckpointHook, DistributedHook, HookBase, LoggerHook, LRUpdateHook
from .lazy import lazy_exports as _lazy_exports
from .lr_scheduler import LRWarmupScheduler
from .metric_storage import HistoryBuffer, MetricStorage
from .trainer import Trainer

__version__ = "0.1.0"

# imported when first named: a default run uses none of them
_LAZY = {"EvalHook": "hooks", "set_random_seed": "seed", "setup_logger": "script_logging"}
_LAZY |= dict.fromkeys(["init_distributed", "reduce_dict"], "distributed")

if TYPE_CHECKING:
    from .distributed import init_distributed, reduce_dict
    from .hooks import EvalHook
    from .script_logging import setup_logger
    from .seed import set_random_seed
else:  # hidden from type checkers, which would take any name through it
    __getattr__, __dir__ = _lazy_exports(globals(), _LAZY)

__all__ = [
    "CheckpointHook", "DistributedHook", "EvalHook", "HistoryBuffer", "HookBase", "LoggerHook",
    "LRUpdateHook", "LRWarmupScheduler", "MetricStorage", "Trainer", "all_gather", "collect_env",
    "gather", "get_rank", "get_world_size", "init_distributed", "is_main_process", "reduce_dict",
    "set_random_seed", "setup_logger",
]  # fmt: skip
