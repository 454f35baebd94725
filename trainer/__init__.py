"""trainer: a minimal, hook-based PyTorch training loop, with core-pytorch-utils' public names."""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .distributed import (
    all_gather,
    gather,
    get_rank,
    get_world_size,
    init_distributed,
    is_main_process,
    reduce_dict,
)
from .env import collect_env
from .hooks import CheckpointHook, DistributedHook, HookBase, LoggerHook, LRUpdateHook
from .lr_scheduler import LRWarmupScheduler
from .metric_storage import HistoryBuffer, MetricStorage
from .trainer import Trainer

__version__ = "0.1.0"

# imported when first named: a default run uses neither
_LAZY = {"EvalHook": "hooks", "set_random_seed": "seed", "setup_logger": "script_logging"}

if TYPE_CHECKING:
    from .hooks import EvalHook
    from .script_logging import setup_logger
    from .seed import set_random_seed
else:  # hidden from type checkers, which would take any name through it

    def __getattr__(name: str) -> Any:
        if name in _LAZY:
            return getattr(import_module(f".{_LAZY[name]}", __name__), name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "CheckpointHook", "DistributedHook", "EvalHook", "HistoryBuffer", "HookBase", "LoggerHook",
    "LRUpdateHook", "LRWarmupScheduler", "MetricStorage", "Trainer", "all_gather", "collect_env",
    "gather", "get_rank", "get_world_size", "init_distributed", "is_main_process", "reduce_dict",
    "set_random_seed", "setup_logger",
]  # fmt: skip
