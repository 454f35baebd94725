"""What the step needs besides the Trainer: the losses a model returned, the unwrapped model."""

import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel


def total_loss(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to back-propagate and the detached values to log, from a scalar loss or a dict
    of them; in a dict, values without a gradient beside ones with are metrics, not losses."""
    losses = {"total_loss": out} if isinstance(out, torch.Tensor) else out
    if not isinstance(losses, dict) or not losses:
        raise TypeError(
            "model must return a scalar loss tensor or a non-empty dict of scalar loss tensors, "
            f"got {type(out).__name__}."
        )
    for name, value in losses.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Loss {name!r} must be a tensor, got {type(value).__name__}.")
        if value.dim() != 0:
            raise ValueError(
                f"Loss {name!r} must be a scalar tensor, got shape {tuple(value.shape)}; "
                "reduce it in the model (e.g. .mean())."
            )
    logged = {name: value.detach() for name, value in losses.items()}
    if any(value.requires_grad for value in losses.values()):
        losses = {name: value for name, value in losses.items() if value.requires_grad}
    first, *rest = losses.values()
    total = sum(rest, first)  # not sum(values): 0 + loss would cost an extra op
    logged["total_loss"] = total.detach()
    return total, logged


def unwrapped(model: nn.Module) -> nn.Module:
    """``model`` without its torch.compile and DDP / DataParallel wrappers."""
    *_, module = wrappers(model)
    return module


def wrappers(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` and the modules torch.compile / DDP / DataParallel wrap, outermost first."""
    # torch._dynamo is slow to import; a compiled model has imported it
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    while True:
        yield model
        if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        else:
            return
