"""The building blocks of a training step: autocast, backward with loss scaling, gradient-sync
skipping during accumulation, clipping, and the optimizer step through the GradScaler.

The Trainer has each of them as a public method (``trainer.autocast()``,
``trainer.backward(loss)``, ...): the built-in step, ``forward_backward_step`` below, is written
with them, and so is an override of ``train_one_iter``.
"""

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim import Optimizer

from .fsdp import is_sharded, local_value, no_gradient_sync

_NO_OP = contextlib.nullcontext()  # reusable: entering it does nothing
_NOTHING: dict[str, Any] = {}  # no extra metrics (never modified)


class StepMethods:
    """The public building blocks of a training step: the Trainer's :meth:`autocast`,
    :meth:`compute_losses`, :meth:`no_gradient_sync`, :meth:`backward`, :meth:`clip_and_step`
    and :meth:`update_scaler`.

    The built-in step, :meth:`forward_backward_step`, is written with them, and so is an
    override of ``train_one_iter``. One code path: with AMP off, autocast is a null context and
    the GradScaler a no-op.

    Args:
        model: The model as trained (wrapped in DDP, compiled or sharded, maybe).
        unpack_batch_dict: Call ``model(**batch)`` instead of ``model(batch)``.
        optimizer: The main optimizer; its steps skipped by the GradScaler are tracked.
        device: The model's device.
        amp_dtype: ``torch.float16`` (with loss scaling), ``torch.bfloat16``, or None for no AMP.
        clip_grad_norm: Clip gradients to this norm; 0 disables clipping.
        cuda_graph: Keep autocast's weight-cast cache off (a CUDA graph replays the casts).
    """

    def __init__(
        self,
        model: nn.Module,
        unpack_batch_dict: bool,
        optimizer: Optimizer,
        device: torch.device,
        amp_dtype: Optional[torch.dtype],
        clip_grad_norm: float,
        cuda_graph: bool = False,
    ) -> None:
        self.model = model
        self.unpack_batch_dict = unpack_batch_dict
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        # DDP (also under torch.compile) skips its gradient all-reduce with no_sync()
        self._ddp = next(
            (m for m in wrappers(model) if isinstance(m, DistributedDataParallel)), None
        )
        self._sharded_model = model if is_sharded(model) else None  # by FSDP2's fully_shard
        self._autocast = (
            functools.partial(torch.autocast, device.type, amp_dtype, cache_enabled=not cuda_graph)
            if amp_dtype is not None
            else None
        )
        # bfloat16 has float32's range, so only float16 needs loss scaling.
        self.grad_scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        self._scaling = self.grad_scaler.is_enabled()
        # Whether the GradScaler skipped the last step: a bool, or a device tensor with fused
        # optimizers, which skip on the device.
        self._skipped: Union[bool, torch.Tensor] = False
        self._update_due = False  # the scaler stepped an optimizer since its last update

    def autocast(self) -> contextlib.AbstractContextManager:
        """A context for the forward pass: mixed precision with AMP on, else a no-op."""
        return _NO_OP if self._autocast is None else self._autocast()

    def no_gradient_sync(self, skip: bool = True) -> contextlib.AbstractContextManager:
        """A context for the forward and backward of a micro-batch whose gradients stay local
        (all but the last, when accumulating): DDP's ``no_sync``, FSDP2's
        ``set_requires_gradient_sync(False)``; a no-op when not ``skip`` or in one process."""
        if skip and self._ddp is not None:
            return self._ddp.no_sync()
        if skip and self._sharded_model is not None:
            return no_gradient_sync(self._sharded_model)
        return _NO_OP

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss multiplied by the GradScaler's scale with float16 AMP."""
        (self.grad_scaler.scale(loss) if self._scaling else loss).backward()

    def clip_and_step(self, optimizer: Optional[Optimizer] = None) -> Optional[torch.Tensor]:
        """Unscale and clip (``clip_grad_norm``) the gradients of ``optimizer``'s parameters,
        then step it (the trainer's by default) through the GradScaler, which skips a step whose
        float16 gradients overflowed. Returns the gradient norm before clipping, as a device
        tensor, or None without clipping."""
        optimizer = self.optimizer if optimizer is None else optimizer
        norm = None
        if self.clip_grad_norm > 0:
            # unscaled first, so the threshold means what it says
            self.grad_scaler.unscale_(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            norm = nn.utils.clip_grad_norm_(params, self.clip_grad_norm).detach()
            if self._sharded_model is not None:
                norm = local_value(norm)  # FSDP2: a replicated DTensor
        if not self._scaling:
            optimizer.step()
            return norm
        if optimizer is self.optimizer:
            self._skipped = True  # until _on_optimizer_step says otherwise
        self.grad_scaler.step(optimizer)
        self._update_due = True
        return norm

    def update_scaler(self) -> None:
        """Adjust the float16 loss scale, once per iteration after every optimizer stepped (the
        trainer does it after ``train_one_iter`` if the iteration did not)."""
        if self._update_due:
            self.grad_scaler.update()
            self._update_due = False

    def compute_losses(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the model on ``batch`` (``model(**batch)`` with ``unpack_batch_dict``) under
        :meth:`autocast`; returns the loss to back-propagate and the detached losses to log,
        ``total_loss`` among them (see :func:`total_loss`)."""
        model, unpack = self.model, self.unpack_batch_dict
        if self._autocast is None:  # no AMP: not even a null context, this runs every step
            out = model(**batch) if unpack else model(batch)
        else:
            with self._autocast():
                out = model(**batch) if unpack else model(batch)
        if isinstance(out, torch.Tensor) and out.dim() == 0:  # the common case, kept short
            return out, {"total_loss": out.detach()}
        return total_loss(out)

    def forward_backward_step(
        self, batches: list[Any], set_to_none: bool = True
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The built-in step, in numbered steps with the public methods: forward, backward and
        step on ``batches`` (one per micro-step, gradients summed); returns the losses and the
        other metrics as device tensors. ``cuda_graph=True`` captures this whole method."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if len(batches) == 1:
            # 2. forward under autocast, 3. backward (the GradScaler multiplies the loss with
            # float16 AMP)
            loss, losses = self.compute_losses(batches[0])
            self.backward(loss)
        else:
            losses = self._accumulate(batches)  # 2. and 3. per micro-batch
        # 4. clip the gradients and step; float16 steps with inf or NaN gradients are skipped
        grad_norm = self.clip_and_step()
        if not self._scaling and grad_norm is None:
            return losses, _NOTHING  # the plain configuration: no other metric
        self.update_scaler()  # here, not after the iteration: a CUDA graph replays it
        extras: dict[str, Any] = {}
        if grad_norm is not None:
            extras["grad_norm"] = grad_norm
        if self._scaling:
            extras["amp_skipped_steps"] = self._skipped
        return losses, extras

    def _accumulate(self, batches: list[Any]) -> dict[str, torch.Tensor]:
        """Steps 2 and 3 of :meth:`forward_backward_step` for each of several micro-batches, the
        loss divided by their number so that the summed gradients average them; the gradients
        of all but the last stay local. Returns the losses averaged over the micro-batches."""
        k = len(batches)
        total: dict[str, torch.Tensor] = {}
        for micro_step, batch in enumerate(batches):
            with self.no_gradient_sync(skip=micro_step < k - 1):
                loss, logged = self.compute_losses(batch)
                self.backward(loss / k)
            total = {n: total[n] + v for n, v in logged.items()} if micro_step else logged
        return {name: value / k for name, value in total.items()}

    @property
    def step_skipped(self) -> bool:
        """Whether the float16 GradScaler skipped the last optimizer step (inf/NaN gradients).

        With fused optimizers the flag lives on the device: reading it is a CPU-GPU sync.
        """
        return bool(self._skipped)

    @contextlib.contextmanager
    def _watch_skipped_steps(self) -> Iterator[None]:
        if not self._scaling:
            yield
            return
        # Removed when training ends, so the optimizer never keeps the trainer alive.
        handle = self.optimizer.register_step_post_hook(self._on_optimizer_step)
        try:
            yield
        finally:
            handle.remove()

    def _on_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # GradScaler calls optimizer.step() only for finite gradients, except with optimizers
        # that skip on the device (fused ones), which it hands the inf flag as `found_inf`.
        found_inf = getattr(optimizer, "found_inf", None)
        self._skipped = False if found_inf is None else found_inf


def total_loss(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to back-propagate, and the detached values to log (``total_loss`` among them),
    from what a model returned: a scalar loss tensor or a dict of them. In a dict, the values
    that require no gradient while others do are metrics (an accuracy, say): logged under their
    names, not added to ``total_loss``."""
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
