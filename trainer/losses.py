"""The built-in step's losses when a model returns more than one scalar loss tensor (a dict of
them), imported at the first such output; a scalar loss takes the Trainer's fast path."""

from typing import Any

import torch


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
