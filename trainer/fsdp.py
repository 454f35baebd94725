"""Checkpoints and gradient sync for models sharded with FSDP2 (``fully_shard``).

A sharded model's parameters are DTensors, each rank holding a slice. Checkpoints hold the full,
unsharded state (gathered with torch's ``torch.distributed.checkpoint.state_dict`` helpers), so
a plain model loads them, and the sharded model loads them back slice by slice.
"""

import contextlib
import sys
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim import Optimizer

# torch.distributed.checkpoint and torch.distributed.tensor take most of a second to import, so
# they are imported when a sharded model needs them; a model with DTensors has imported them.
_DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a shard of a ``fully_shard``-ed model's state)."""
    dtensor = getattr(sys.modules.get(_DTENSOR_MODULE), "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (sharded by ``fully_shard``)."""
    return any(is_dtensor(p) for p in model.parameters())


def full_state_dicts(model: nn.Module, optimizer: Optimizer) -> tuple[dict, dict]:
    """The full model and optimizer state dicts, in CPU memory on rank 0 and empty elsewhere.

    A collective: every rank calls it. The optimizer's state is keyed by parameter names.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (
        get_model_state_dict(model, options=options),
        get_optimizer_state_dict(model, optimizer, options=options),
    )


def load_full_model_state(model: nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Load a full state dict (every rank has it) into the sharded ``model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # dict(): the helper turns the values it loads into DTensors in place
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, dict(state), options=options)


def load_full_optimizer_state(model: nn.Module, optimizer: Optimizer, state: dict) -> None:
    """Load an optimizer state dict keyed by parameter names (from :func:`full_state_dicts`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, state, options=options)


def keyed_by_name(optimizer_state: dict[str, Any]) -> bool:
    """Whether an optimizer state dict names its parameters (torch's own numbers them)."""
    groups = optimizer_state.get("param_groups") or [{}]
    return any(isinstance(p, str) for g in groups for p in g.get("params", ()))


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Keep the gradients of a ``fully_shard``-ed model unreduced in the backward passes under
    this context (all micro-batches but the last); a no-op for other models."""
    if not hasattr(model, "set_requires_gradient_sync"):  # not an FSDPModule
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a replicated DTensor (the gradient norm of sharded parameters)."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor
