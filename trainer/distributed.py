"""Rank helpers over ``torch.distributed``; every function also works in a single process.
The torchrun side and the collectives of tensors import when first named (``_LAZY``)."""

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from .lazy import lazy_exports as _lazy_exports


def _is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank, 0 without a process group."""
    return dist.get_rank() if _is_distributed() else 0


def get_world_size() -> int:
    """The number of processes, 1 without a process group."""
    return dist.get_world_size() if _is_distributed() else 1


def is_main_process() -> bool:
    """Whether this is rank 0, the one that writes checkpoints and TensorBoard files."""
    return get_rank() == 0


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a shard of a ``fully_shard``-ed model's state)."""
    # not imported here (most of a second): a model with DTensors has imported it
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (sharded by FSDP2's ``fully_shard``)."""
    return any(is_dtensor(p) for p in model.parameters())


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, on every rank (``group``: of every rank; None: default)."""
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def gather(obj: Any, dst: int = 0, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj`` on rank ``dst``, ``[]`` on the others (``group``: as in
    :func:`all_gather`)."""
    if get_world_size() == 1:
        return [obj]
    out: Optional[list[Any]] = [None] * get_world_size() if get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out if out is not None else []


class CpuGroup:
    """A gloo group of every rank for the trainer's own collectives while it trains, released
    when :meth:`open` ends (docs/internals.md: gloo teardown). ``group`` is None outside
    :meth:`open` and in one process, where the default group serves."""

    group: Any = None

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """The group, for the block (every rank enters it, in step)."""
        if get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")
        try:
            yield
        finally:
            group, self.group = self.group, None
            if group is not None and dist.is_initialized():
                # ours is then the last reference: dropping it joins the group's threads
                dist.destroy_process_group(group)


# imported when first named: a default run uses none of them
_LAZY = {"init_distributed": "process_group", "destroy_distributed": "process_group"}
_LAZY |= {"all_gather_tensor": "tensor_collectives", "reduce_dict": "tensor_collectives"}

if TYPE_CHECKING:
    from .process_group import destroy_distributed, init_distributed
    from .tensor_collectives import all_gather_tensor, reduce_dict
else:  # hidden from type checkers, which would take any name through it
    __getattr__, __dir__ = _lazy_exports(globals(), _LAZY)

__all__ = [
    "CpuGroup", "all_gather", "all_gather_tensor", "destroy_distributed", "gather", "get_rank",
    "get_world_size", "init_distributed", "is_dtensor", "is_main_process", "is_sharded",
    "reduce_dict",
]  # fmt: skip
