"""Collectives of tensors (``trainer.distributed``'s :func:`all_gather_tensor` and
:func:`reduce_dict`): imported when first named. Every function also works in one process."""

from typing import Any

import torch
import torch.distributed as dist

from .distributed import get_world_size


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
