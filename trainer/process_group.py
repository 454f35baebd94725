"""Joining and leaving the process group of a torchrun launch (``trainer.distributed``'s
:func:`init_distributed` and :func:`destroy_distributed`): imported when first named."""

import datetime
import gc
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("trainer.distributed")  # the public module, in log lines


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
    """Tear down what :func:`init_distributed` joined: call it at the end of a torchrun script,
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
