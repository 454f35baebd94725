"""Gradient sync, and full (one-file) checkpoints, for models sharded with FSDP2
(``fully_shard``), whose parameters are DTensors; sharded checkpoints are
``sharded_checkpoint.py``'s."""

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.optim import Optimizer

from .distributed import is_dtensor


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor for a replicated DTensor (the gradient norm of sharded parameters)."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


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


def full_state_dicts(model: nn.Module, optimizer: Optimizer) -> dict[str, dict]:
    """``{"model": ..., "optimizer": ...}``, the full state dicts (the optimizer's keyed by
    parameter names), in CPU memory on rank 0 and empty elsewhere. A collective: every rank
    calls it."""
    from torch.distributed.checkpoint import state_dict as dcp

    options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": dcp.get_model_state_dict(model, options=options),
        "optimizer": dcp.get_optimizer_state_dict(model, optimizer, options=options),
    }


def load_full_model_state(model: nn.Module, state: dict[str, Any], strict: bool) -> None:
    """Load a full state dict (every rank has it), or this rank's shards of one (DTensors, from
    a sharded checkpoint), into ``model``."""
    from torch.distributed.checkpoint import state_dict as dcp

    # dict(): the helper turns the values it loads into DTensors in place
    options = dcp.StateDictOptions(full_state_dict=not _has_dtensors(state), strict=strict)
    dcp.set_model_state_dict(model, dict(state), options=options)


def load_full_optimizer_state(model: nn.Module, optimizer: Optimizer, state: dict) -> None:
    """Load an optimizer state dict keyed by parameter names (from [`full_state_dicts`][], or
    this rank's shards of one from a sharded checkpoint)."""
    from torch.distributed.checkpoint import state_dict as dcp

    saved = state.get("state", {})
    tensors = [t for s in saved.values() for t in s.values() if isinstance(t, torch.Tensor)]
    # shards (DTensors) load as they are, and so does a state without tensors (plain SGD's)
    full = bool(tensors) and not any(is_dtensor(t) for t in tensors)
    # not strict: a parameter that had no gradient when saved has no state to load
    options = dcp.StateDictOptions(full_state_dict=full, strict=False)
    dcp.set_optimizer_state_dict(model, optimizer, state, options=options)
    # ... and keeps none: torch's helper steps once with zero gradients to make every state
    for name, parameter in model.named_parameters():
        if name not in saved:
            optimizer.state.pop(parameter, None)


def _has_dtensors(state: dict[str, Any]) -> bool:
    return any(is_dtensor(v) for v in state.values() if isinstance(v, torch.Tensor))


def keyed_by_name(optimizer_state: dict[str, Any]) -> bool:
    """Whether an optimizer state dict names its parameters (torch's own numbers them)."""
    groups = optimizer_state.get("param_groups") or [{}]
    return any(isinstance(p, str) for g in groups for p in g.get("params", ()))
