"""An exponential moving average of the model's weights."""

import contextlib
from typing import Any, Iterator, Optional

import torch

from ..misc import NUMBER, check_int, check_type, plain_names
from .hookbase import HookBase, Priority


class EMAHook(HookBase):
    """Keeps ``ema = decay * ema + (1 - decay) * weights`` after every ``period``-th step (and
    the last step of training), on the weights' device with foreach ops (no host-device sync).
    Floating-point buffers (BatchNorm's running statistics) are averaged too; other buffers are
    copied.

    The average is saved in checkpoints and resumed exactly. Inside ``with ema.swapped():``
    the model holds the average, and on leaving it (an error included) its own weights again:
    evaluate there, or call [`evaluate`][]. Export it with [`ema_state_dict`][]. Under
    torchrun every rank holds the same weights, and so the same average; models sharded with
    ``fully_shard`` are not supported.

    Args:
        decay: The weight of the old average, in [0, 1).
        period: Iterations between updates (the last iteration of training updates too).

    Example (``accuracy``, a ``metric_fn`` as on the evaluation page, and ``val_loader``
    yours)::

        def accuracy_ema(model, batch):  # a name of its own for the average's accuracy
            return {"acc_ema": accuracy(model, batch)["acc"]}

        ema = EMAHook(decay=0.999)
        trainer.register_hook(ema)
        trainer.register_hook(EvalHook(1, data_loader=val_loader, metric_fn=accuracy))
        trainer.register_hook(
            EvalHook(1, lambda: ema.evaluate(trainer.evaluate, val_loader, accuracy_ema))
        )
    """

    # after the user's hooks, before evaluation and the checkpoint
    priority = Priority.NORMAL + 5

    def __init__(self, decay: float = 0.999, period: int = 1) -> None:
        check_type("decay", decay, NUMBER, "a number in [0, 1)")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}.")
        check_int("period", period, minimum=1)
        self.decay = decay
        self._period = period
        self._ema: Optional[dict[str, torch.Tensor]] = None
        # The model, held from train() on: the average is exported and evaluated once the
        # Trainer, which hooks hold through a weak proxy only, may be gone.
        self._model: Optional[torch.nn.Module] = None
        # (averages, weights, copies, sources): the foreach operands, built once per train()
        self._operands: Optional[tuple[list, list, list, list]] = None

    def _module(self) -> torch.nn.Module:
        return self._model if self._model is not None else self.trainer.model_or_module

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        """The model's parameters and buffers by their names in the uncompiled model (a
        checkpoint's average fits the model compiled another way)."""
        module = self._module()
        tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        names = plain_names(module, tensors)
        return {names[name]: tensor for name, tensor in tensors.items()}

    def before_train(self) -> None:
        """Start the average at the current weights, unless a checkpoint restored it."""
        self._model = self.trainer.model_or_module
        if self._ema is None:
            self._ema = {k: t.detach().clone() for k, t in self._model_tensors().items()}
        averaged = []
        weights = []
        copied = []
        sources = []
        for name, tensor in self._model_tensors().items():
            if tensor.is_floating_point():
                averaged.append(self._ema[name])
                weights.append(tensor.detach())
            else:
                copied.append(self._ema[name])
                sources.append(tensor)
        self._operands = (averaged, weights, copied, sources)

    def after_iter_period(self) -> int:
        """Every ``period``-th iteration, and the last."""
        return self._period

    def after_iter(self) -> None:
        """Update the average."""
        if self._operands is None:  # before_train did not run
            raise RuntimeError("EMAHook was registered during train(): register it before.")
        averaged, weights, copied, sources = self._operands
        if averaged:
            torch._foreach_lerp_(averaged, weights, 1.0 - self.decay)
        if copied:
            torch._foreach_copy_(copied, sources)

    def ema_state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights under the uncompiled model's ``state_dict`` names (a copy), to
        save or to load into a model: ``model.load_state_dict(ema.ema_state_dict())``."""
        if self._ema is None:
            raise RuntimeError("EMAHook has no average before train() starts.")
        # By identity: a tied weight has one name in the average and several in state_dict()
        key_of = {id(tensor): key for key, tensor in self._model_tensors().items()}
        module = self._module()
        state = module.state_dict(keep_vars=True)
        names = plain_names(module, state)  # a compiled submodule's "_orig_mod." dropped
        return {
            names[name]: self._ema[key_of[id(tensor)]].detach().clone()
            for name, tensor in state.items()
            if id(tensor) in key_of
        }

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Put the averaged weights into the model for the duration of the context."""
        tensors = self._model_tensors()
        saved = {k: t.detach().clone() for k, t in tensors.items()}
        try:
            with torch.no_grad():
                for name, tensor in tensors.items():
                    tensor.copy_(self._ema[name])
            yield
        finally:
            with torch.no_grad():
                for name, tensor in tensors.items():
                    tensor.copy_(saved[name])

    def evaluate(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """``func(*args, **kwargs)`` with the averaged weights in the model."""
        with self.swapped():
            return func(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The average (saved in checkpoints)."""
        return {"ema": self._ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the average, on the model's devices."""
        if state["ema"] is None:
            return
        if self._ema is not None:  # in place, where the foreach operands point
            for name, value in state["ema"].items():
                self._ema[name].copy_(value)
            return
        tensors = self._model_tensors()
        self._ema = {k: v.to(tensors[k].device) for k, v in state["ema"].items()}
