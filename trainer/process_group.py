"""Joining and leaving the process group of a torchrun launch: imported under torchrun only."""

import datetime
import gc
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("trainer.distributed")  # the public module, in log lines


def join(backend: Optional[str], timeout_s: float) -> tuple[int, int]:
    """:func:`~trainer.distributed.init_distributed` once torchrun's variables are set."""
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


def leave() -> None:
    """:func:`~trainer.distributed.destroy_distributed` in a process group. Not a barrier of
    the default group, which could abort the exiting process (docs/internals.md: gloo
    teardown)."""
    gc.collect()  # models in reference cycles, freed while every group is alive and idle
    group = dist.new_group(backend="gloo")
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    del group  # the last reference: its threads end now, while Python is alive
    dist.destroy_process_group()
