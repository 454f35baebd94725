"""Rank helpers over ``torch.distributed``: joining and leaving a torchrun launch, the ranks,
collectives of objects and tensors, raising on every rank at once, and the trainer's gloo group.
Every function also works in a single process."""

import contextlib
import datetime
import gc
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = [
    "CpuGroup",
    "all_gather",
    "all_gather_tensor",
    "destroy_distributed",
    "gather",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_dtensor",
    "is_main_process",
    "is_sharded",
    "raise_on_every_rank",
    "reduce_dict",
]

logger = logging.getLogger(__name__)


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
    [`all_gather`][])."""
    if get_world_size() == 1:
        return [obj]
    out: Optional[list[Any]] = [None] * get_world_size() if get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out if out is not None else []


def all_gather_tensor(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape everywhere), stacked: shape ``(world_size, *shape)``
    (over ``group``, a group of every rank; None: the default group)."""
    if get_world_size() == 1:
        return tensor.unsqueeze(0)
    out = [torch.empty_like(tensor) for _ in range(get_world_size())]
    dist.all_gather(out, tensor, group=group)
    return torch.stack(out)


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


def raise_on_every_rank(
    error: Optional[Exception], value: Any = None, group: Any = None
) -> list[Any]:
    """Every rank's picklable ``value``, on every rank, unless a rank has an ``error``: then every
    rank raises at once, so that none goes on alone into a collective the others never join. The
    rank with the error raises it, the others a ``RuntimeError`` with its message that names
    that rank (``group``: as in [`all_gather`][])."""
    values = [value]
    if get_world_size() > 1:
        everyone = all_gather((None if error is None else str(error), value), group)
        failed = next((rank for rank, (message, _) in enumerate(everyone) if message), None)
        if error is None and failed is not None:
            raise RuntimeError(f"Rank {failed}: {everyone[failed][0]}")
        values = [own for _, own in everyone]
    if error is not None:
        raise error
    return values


class CpuGroup:
    """A gloo group of every rank for the trainer's own collectives while it trains, released
    when [`open`][] ends (docs/internals.md: gloo teardown). ``group`` is None outside
    [`open`][] and in one process, where the default group serves."""

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
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus:
        torch.cuda.set_device(local_rank % num_gpus)
    if backend is None:
        # nccl cannot put two ranks on one GPU
        backend = "nccl" if num_gpus >= local_world_size else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    # torchrun's store outlives a restart of the workers (--max-restarts): without a prefix of
    # its own, an attempt can read the previous attempt's addresses and fail to connect.
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"trainer/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    logger.info(
        f"Initialized {backend} rank {dist.get_rank()} of {dist.get_world_size()} "
        f"({num_gpus} GPUs for {local_world_size} local processes)."
    )
    return dist.get_rank(), dist.get_world_size()


def destroy_distributed() -> None:
    """Tear down what [`init_distributed`][] joined: call it at the end of a torchrun script,
    after ``main()`` has returned. A no-op in one process. Not a barrier of the default group,
    which could abort the exiting process (docs/internals.md: gloo teardown)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()  # models in reference cycles, freed while every group is alive and idle
    group = dist.new_group(backend="gloo")
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    del group  # the last reference: its threads end now, while Python is alive
    dist.destroy_process_group()
