"""Rank helpers over ``torch.distributed``; every function also works in a single process."""

import contextlib
import datetime
import gc
import logging
import os
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group that ``torchrun`` describes in the environment.

    Binds each process to a GPU by its ``LOCAL_RANK`` and picks nccl when every local process has a
    GPU of its own, gloo otherwise (CPU, or more processes than GPUs). Without torchrun's variables
    (a plain ``python script.py``) it does nothing.

    Args:
        backend: Force a backend (``"nccl"``, ``"gloo"``); None chooses as above.
        timeout_s: How long a collective may wait for the other ranks before it fails (and with
            it the job): bounds the hang when a rank stalls.

    Returns:
        ``(rank, world_size)``.

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
    """Tear down what :func:`init_distributed` joined, once every rank is done: call it at the end
    of a torchrun script, after ``main()`` has returned. A no-op in a single process.

    It frees what ``main()`` left in reference cycles (a ``fully_shard``-ed model is one), waits
    for every rank over a gloo group of its own, which it then frees, and destroys the default
    group. Not ``dist.barrier()``: a barrier of the default group keeps the collectives before
    it alive until its gloo thread frees them, tensors made in Python included. That thread
    needs the GIL then, and if the interpreter is exiting (FSDP2 keeps the default group, and
    its threads, to the end), the process aborts: "terminate called without an active
    exception".

    Example::

        >>> destroy_distributed()  # a single process: nothing to do
    """
    if not _is_distributed():
        return
    gc.collect()  # models in reference cycles, freed while every group is alive and idle
    group = dist.new_group(backend="gloo")
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    del group  # the last reference: its threads end now, while Python is alive
    dist.destroy_process_group()


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


def barrier() -> None:
    """Wait for every rank; a no-op in a single process."""
    if get_world_size() > 1:
        dist.barrier()


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Gather a picklable object from every rank, to every rank (over ``group``, a group of
    every rank; None: the default group).

    Example::

        >>> all_gather({"acc": 0.9})
        [{'acc': 0.9}]
    """
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_tensor(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape everywhere), stacked: shape ``(world_size, *shape)``
    (over ``group``, a group of every rank; None: the default group).

    Example::

        >>> all_gather_tensor(torch.tensor([1.0, 2.0]))
        tensor([[1., 2.]])
    """
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
    """Sum (or average) a dict of same-shaped tensors over all ranks, in one collective.

    Every rank gets the result. The keys must be the same on every rank.

    Example::

        >>> reduce_dict({"loss": torch.tensor(2.0)})
        {'loss': tensor(2.)}
    """
    if get_world_size() == 1:
        return dict(tensors)
    names = sorted(tensors)
    packed = torch.stack([tensors[n] for n in names])
    dist.all_reduce(packed)
    if average:
        packed = packed / get_world_size()
    return dict(zip(names, packed))


class CpuGroup:
    """A gloo group of every rank for the trainer's own collectives while it trains: the
    preemption checks, a stream's pass end, the checkpoints' gathers, ``EvalHook``'s gather of
    the results and, on CPU, the metrics' reduction (``Trainer.cpu_group`` lends it to hooks).
    ``group`` is None outside :meth:`open` and in one process; the default group then serves.

    Released when :meth:`open` ends, which joins the group's gloo threads while Python is fully
    alive. A gloo thread that runs on drops its last reference to a tensor made in Python
    whenever it gets to it, maybe during the interpreter's exit, when no thread can take the GIL:
    the process then aborts ("terminate called without an active exception"). The default
    group's threads run on past ``destroy_process_group()`` once a DDP model has been built.
    """

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
