"""Rank helpers over ``torch.distributed``; every function also works in a single process."""

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group that ``torchrun`` describes in the environment (a no-op without
    it), binding each process to a GPU by its ``LOCAL_RANK``; returns ``(rank, world_size)``.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; None: nccl if every local process has a GPU of its
            own, else gloo.
        timeout_s: How long a collective may wait for the other ranks before it fails (and with
            it the job): bounds the hang when a rank stalls.

    Example::

        >>> init_distributed()  # a single process
        (0, 1)
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    from .process_group import join

    return join(backend, timeout_s)


def destroy_distributed() -> None:
    """Tear down what :func:`init_distributed` joined: call it at the end of a torchrun script,
    after ``main()`` has returned (docs/internals.md: gloo teardown). A no-op in one process."""
    if _is_distributed():
        from .process_group import leave

        leave()


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
    """Gather a picklable object from every rank, to every rank (over ``group``, a group of
    every rank; None: the default group)."""
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_tensor(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape everywhere), stacked: shape ``(world_size, *shape)``
    (over ``group``, a group of every rank; None: the default group)."""
    if get_world_size() == 1:
        return tensor.unsqueeze(0)
    out = [torch.empty_like(tensor) for _ in range(get_world_size())]
    dist.all_gather(out, tensor, group=group)
    return torch.stack(out)


def gather(obj: Any, dst: int = 0, group: Any = None) -> list[Any]:
    """Gather a picklable object from every rank on rank ``dst``; other ranks get ``[]`` (over
    ``group``, a group of every rank; None: the default group)."""
    if get_world_size() == 1:
        return [obj]
    out: Optional[list[Any]] = [None] * get_world_size() if get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out if out is not None else []


def reduce_dict(tensors: dict[str, torch.Tensor], average: bool = True) -> dict[str, torch.Tensor]:
    """Sum (or average) a dict of same-shaped tensors over all ranks, in one collective. Every
    rank gets the result; the keys must be the same on every rank."""
    if get_world_size() == 1:
        return dict(tensors)
    names = sorted(tensors)
    packed = torch.stack([tensors[n] for n in names])
    dist.all_reduce(packed)
    if average:
        packed = packed / get_world_size()
    return dict(zip(names, packed))


class CpuGroup:
    """A gloo group of every rank for the trainer's own collectives while it trains, released
    when :meth:`open` ends (docs/internals.md: gloo teardown). ``group`` is None outside
    :meth:`open` and in one process, where the default group serves."""

    def __init__(self) -> None:
        self.group: Any = None

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
