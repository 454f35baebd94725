"""What the step's building blocks share, for the built-in ``train_one_iter`` and overrides
alike: autocast, the float16 GradScaler, gradient clipping and the gradient sync of DDP and FSDP2
(MMEngine's ``OptimWrapper`` holds the same)."""

import contextlib
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from .distributed import is_sharded
from .fsdp import local_value, no_gradient_sync
from .misc import wrappers

NO_OP = contextlib.nullcontext()  # reusable: one for every step that needs no context


class StepTools:
    """Autocast, the GradScaler, clipping and the gradient sync of one model's training step.

    Args:
        model: The model as trained (compiled, DDP-wrapped or sharded, perhaps).
        device: Where the model's parameters are.
        optimizer: The trainer's optimizer, whose skipped float16 steps are counted.
        enable_amp: Mixed precision: True picks float16 (with a GradScaler) on CUDA and bfloat16
            elsewhere; a dtype picks that dtype.
        clip_grad_norm: Clip the gradient norm to this value; 0 disables clipping.
        cuda_graph: The step runs in a CUDA graph, where autocast must not cache casts.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        optimizer: Optimizer,
        enable_amp: Union[bool, torch.dtype],
        clip_grad_norm: float,
        cuda_graph: bool = False,
    ) -> None:
        amp_dtype = enable_amp if isinstance(enable_amp, torch.dtype) else None
        if enable_amp is True:  # float16 needs a GradScaler, and is the fast one on GPUs
            amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        #: The autocast dtype, or None without AMP.
        self.amp_dtype = amp_dtype
        #: It, as checkpoints and the run's settings name it: "bfloat16", "float16" or "off".
        self.amp_name = str(amp_dtype).replace("torch.", "") if amp_dtype else "off"
        self._device_type = device.type
        self._cache_autocast = not cuda_graph
        # bfloat16 has float32's range: only float16 needs loss scaling
        self.grad_scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        #: Whether float16 losses are scaled (and steps with inf or NaN gradients skipped).
        self.scaling = self.grad_scaler.is_enabled()
        self.clip_grad_norm = clip_grad_norm
        self._optimizer = optimizer
        # DDP (also under torch.compile) skips its gradient all-reduce with no_sync()
        ddp = [m for m in wrappers(model) if isinstance(m, DistributedDataParallel)]
        #: The DDP wrapper among the model's, or None.
        self.ddp = ddp[0] if ddp else None
        self._sharded = model if is_sharded(model) else None  # FSDP2's fully_shard
        #: Whether the GradScaler skipped the trainer's optimizer's last step: a device tensor
        #: with fused optimizers, which read the inf flag on the device.
        self.skipped: Union[bool, torch.Tensor] = False
        self._update_due = False  # the scaler stepped an optimizer since its last update

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision for the forward pass; a no-op without AMP."""
        if self.amp_dtype is None:
            return NO_OP
        return torch.autocast(self._device_type, self.amp_dtype, cache_enabled=self._cache_autocast)

    def no_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        """Keep the gradients of the backward passes in the block local when ``skip``."""
        if skip and self.ddp is not None:
            return self.ddp.no_sync()
        if skip and self._sharded is not None:
            return no_gradient_sync(self._sharded)
        return NO_OP

    def clip_and_step(self, optimizer: Optimizer) -> Optional[torch.Tensor]:
        """Unscale, clip and step ``optimizer``; the norm before clipping, or None."""
        norm = None
        if self.clip_grad_norm > 0:
            self.grad_scaler.unscale_(optimizer)  # first, so the threshold means what it says
            params = [p for group in optimizer.param_groups for p in group["params"]]
            norm = local_value(nn.utils.clip_grad_norm_(params, self.clip_grad_norm).detach())
        if not self.scaling:
            optimizer.step()
            return norm
        if optimizer is self._optimizer:
            self.skipped = True  # until _on_optimizer_step says otherwise
        self.grad_scaler.step(optimizer)  # skipped if the float16 gradients overflowed
        self._update_due = True
        return norm

    def update_scaler(self) -> None:
        """Adjust the float16 loss scale, if an optimizer stepped since the last update (a no-op
        without float16)."""
        if self._update_due:
            self.grad_scaler.update()
            self._update_due = False

    @contextlib.contextmanager
    def counting_skips(self) -> Iterator[None]:
        """For the block, tell [`skipped`][] from the optimizer's step: the GradScaler calls
        ``step()`` only for finite gradients, except a fused optimizer's, which it hands the inf
        flag as ``found_inf``."""
        if not self.scaling:
            yield
            return
        # removed when training ends, so that the optimizer never keeps the trainer alive
        handle = self._optimizer.register_step_post_hook(self._on_optimizer_step)
        try:
            yield
        finally:
            handle.remove()

    def _on_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        found_inf = getattr(optimizer, "found_inf", None)
        self.skipped = False if found_inf is None else found_inf
