"""trainer: a minimal, hook-based PyTorch training loop."""

from .env import collect_env
from .hooks import HookBase
from .logger import setup_logger
from .lr_scheduler import LRWarmupScheduler
from .metric_storage import HistoryBuffer, MetricStorage
from .seed import set_random_seed
from .trainer import Trainer

__version__ = "0.1.0"

__all__ = [
    "HistoryBuffer",
    "HookBase",
    "LRWarmupScheduler",
    "MetricStorage",
    "Trainer",
    "collect_env",
    "set_random_seed",
    "setup_logger",
]
