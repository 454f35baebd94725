"""The hooks that ship with ``trainer``, one per file."""

from .checkpoint_hook import CheckpointHook
from .distributed_hook import DistributedHook
from .eval_hook import EvalHook
from .hookbase import HookBase, Priority
from .logger_hook import LoggerHook
from .lr_update_hook import LRUpdateHook

__all__ = [
    "CheckpointHook",
    "DistributedHook",
    "EvalHook",
    "HookBase",
    "LoggerHook",
    "LRUpdateHook",
    "Priority",
]
