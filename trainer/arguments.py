"""The Trainer's arguments: their checks (each error names the argument, what was expected,
what was received and how to fix it), and the run's settings they make."""

import inspect
import logging
import os
import sys
import tempfile
from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from .distributed import get_world_size, is_main_process, is_sharded
from .hooks import HookBase
from .logger import is_terminal
from .lr_scheduler import LRWarmupScheduler
from .misc import NUMBER, check_int, check_type, unwrapped, wrappers
from .progress import loader_length

logger = logging.getLogger(__name__)

_AMP_DTYPES = (torch.float16, torch.bfloat16)
# The LRWarmupScheduler's settings that a Trainer passes on, with their defaults (its own).
WARMUP_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(LRWarmupScheduler).parameters.items()
    if name in ("by_epoch", "warmup_t", "warmup_by_epoch", "warmup_mode", "warmup_init_lr",
                "warmup_factor")
}  # fmt: skip
_FLAG = ((bool,), "True or False")
_NUMBER = (NUMBER, "a number")


def check_arguments(  # each is checked here, so Any
    model: Any, optimizer: Any, lr_scheduler: Any, data_loader: Any, max_epochs: Any,
    max_iters: Any, *, work_dir: Any, unpack_batch_dict: Any, max_num_checkpoints: Any,
    checkpoint_period: Any, log_period: Any, clip_grad_norm: Any, enable_amp: Any,
    accumulation_steps: Any, by_epoch: Any, warmup_t: Any, warmup_by_epoch: Any,
    warmup_mode: Any, warmup_init_lr: Any, warmup_factor: Any, cuda_graph: Any,
    preempt_check_period: Any,
) -> Optional[int]:  # fmt: skip
    """Check the Trainer's arguments; returns iterations per epoch (None for a stream)."""
    _check_types(model, optimizer, lr_scheduler, data_loader)
    check_type("work_dir", work_dir, (str, os.PathLike), "a str or os.PathLike path")
    for name, value, (types, what) in (
        ("unpack_batch_dict", unpack_batch_dict, _FLAG),
        ("clip_grad_norm", clip_grad_norm, _NUMBER),
        ("enable_amp", enable_amp, ((bool, torch.dtype), "True, False or a torch dtype")),
        ("by_epoch", by_epoch, _FLAG),
        ("warmup_by_epoch", warmup_by_epoch, _FLAG),
        ("warmup_mode", warmup_mode, ((str,), "a str")),
        ("warmup_init_lr", warmup_init_lr, _NUMBER),
        ("warmup_factor", warmup_factor, _NUMBER),
        ("cuda_graph", cuda_graph, _FLAG),
    ):
        check_type(name, value, types, what)
    check_int("warmup_t", warmup_t, minimum=0, note="0 disables warmup")
    _check_wiring(model, optimizer, lr_scheduler)
    _check_epochs_or_iters(max_epochs, max_iters)
    check_int("log_period", log_period, minimum=1)
    check_int("accumulation_steps", accumulation_steps, minimum=1)
    check_int("preempt_check_period", preempt_check_period, minimum=1)
    check_int("checkpoint_period", checkpoint_period, minimum=0, note="0 disables")
    if max_num_checkpoints is not None:
        check_int("max_num_checkpoints", max_num_checkpoints, minimum=1)
    if checkpoint_period == 0 and max_num_checkpoints != 3:
        from .setup_errors import max_num_checkpoints_ignored

        raise max_num_checkpoints_ignored()
    if not clip_grad_norm >= 0:
        raise ValueError(f"clip_grad_norm must be >= 0 (0 disables), got {clip_grad_norm!r}.")
    if isinstance(enable_amp, torch.dtype) and enable_amp not in _AMP_DTYPES:
        raise ValueError(
            f"enable_amp must be True, False, torch.float16 or torch.bfloat16, got {enable_amp!r}."
        )
    if cuda_graph and (_compiled(model) or is_sharded(model)):
        from .setup_errors import cuda_graph_refused

        raise cuda_graph_refused(compiled=_compiled(model))
    warmup = {
        "by_epoch": by_epoch, "warmup_t": warmup_t, "warmup_by_epoch": warmup_by_epoch,
        "warmup_mode": warmup_mode, "warmup_init_lr": warmup_init_lr,
        "warmup_factor": warmup_factor,
    }  # fmt: skip
    if isinstance(lr_scheduler, LRWarmupScheduler) and warmup != WARMUP_DEFAULTS:
        from .setup_errors import warmup_settings_ignored

        raise warmup_settings_ignored(warmup, WARMUP_DEFAULTS)
    epoch_len = _check_epoch_len(data_loader, accumulation_steps)
    if epoch_len is None and max_epochs:
        from .setup_errors import stream_without_epochs

        raise stream_without_epochs(max_epochs, data_loader)
    return epoch_len


def run_config(trainer: Any, given_scheduler: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """The run's settings as JSON-ready data: ``settings``, the warmup's, what the trainer's
    objects are, and the batch size, world size, AMP dtype, seed and torch version."""
    optimizer, loader, scheduler = trainer.optimizer, trainer.data_loader, trainer.lr_scheduler
    warmup = {name: getattr(scheduler, name) for name in WARMUP_DEFAULTS}
    return {
        **settings,
        **warmup,
        "work_dir": trainer.work_dir,
        "model": type(unwrapped(trainer.model)).__name__,
        "compiled": _compiled(trainer.model),
        "optimizer": type(optimizer).__name__,
        # the LRs given: a torch scheduler's initial_lr, else the warmup's base_lrs
        "base_lrs": [
            float(group.get("initial_lr", base))
            for group, base in zip(optimizer.param_groups, scheduler.base_lrs)
        ],
        "lr_scheduler": type(given_scheduler).__name__,
        "data_loader": type(loader).__name__,
        "batch_size": getattr(loader, "batch_size", None),
        "iters_per_epoch": trainer.epoch_len,
        "world_size": get_world_size(),
        "amp_dtype": str(trainer._amp_dtype).replace("torch.", "") if trainer._amp_dtype else None,
        "seed": torch.initial_seed(),  # set_random_seed's or torch.manual_seed's, to repeat the run
        "torch": torch.__version__,
    }


def _compiled(model: nn.Module) -> bool:
    return any(type(m).__name__ == "OptimizedModule" for m in wrappers(model))


def progress_bar() -> list[HookBase]:
    """A progress bar where it would draw (rank 0, on a terminal); elsewhere not imported."""
    if not (is_main_process() and is_terminal(sys.stderr)):
        return []
    from .hooks.progress_bar_hook import ProgressBarHook

    return [ProgressBarHook()]


def _check_types(model: Any, optimizer: Any, lr_scheduler: Any, data_loader: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}."
        )
    schedulers = (LRScheduler, ReduceLROnPlateau, LRWarmupScheduler)
    if lr_scheduler is not None and not isinstance(lr_scheduler, schedulers):
        raise TypeError(
            "lr_scheduler must be a torch.optim.lr_scheduler scheduler, an LRWarmupScheduler or "
            f"None, got {type(lr_scheduler).__name__}."
        )
    if not hasattr(data_loader, "__iter__"):
        raise TypeError(f"data_loader must be iterable, got {type(data_loader).__name__}.")


def _check_wiring(model: nn.Module, optimizer: Optimizer, lr_scheduler: Any) -> None:
    if not any(group["params"] for group in optimizer.param_groups):
        from .setup_errors import empty_optimizer

        raise empty_optimizer(optimizer)
    own = {id(p) for p in model.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if foreign:
        from .setup_errors import foreign_parameters

        raise foreign_parameters(optimizer, foreign)
    scheduler = lr_scheduler
    if isinstance(scheduler, LRWarmupScheduler):
        scheduler = scheduler.torch_scheduler or scheduler
    scheduled = getattr(scheduler, "optimizer", optimizer)
    if scheduled is not optimizer:
        from .setup_errors import other_optimizer

        raise other_optimizer(lr_scheduler, scheduled, optimizer)


def check_closure_free(optimizer: Optimizer) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (LBFGS) for the built-in step."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        from .setup_errors import closure_needed

        raise closure_needed(optimizer)


def warn_unoptimized(model: nn.Module, optimizers: list[Optimizer]) -> None:
    """Warn about trainable parameters of ``model`` that no optimizer holds."""
    held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if left:
        from .setup_errors import unoptimized_warning

        logger.warning(unoptimized_warning(left))


def _check_epochs_or_iters(max_epochs: Any, max_iters: Any) -> None:
    for name, value in (("max_epochs", max_epochs), ("max_iters", max_iters)):
        check_int(name, value, minimum=0)
    if (max_epochs > 0) == (max_iters > 0):
        raise ValueError(
            "Pass exactly one of max_epochs or max_iters "
            f"(got max_epochs={max_epochs}, max_iters={max_iters})."
        )


def _check_epoch_len(data_loader: Any, accumulation_steps: int) -> Optional[int]:
    num_batches = loader_length(data_loader)
    if num_batches is None:
        return None  # a stream: its epochs end with its passes
    if num_batches == 0:
        raise ValueError(
            "data_loader is empty: it yields no batch. Check the dataset and batch_size."
        )
    if num_batches < accumulation_steps:
        raise ValueError(
            f"data_loader has {num_batches} batches, fewer than accumulation_steps="
            f"{accumulation_steps}; lower accumulation_steps or the batch size."
        )
    return num_batches // accumulation_steps


def model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    raise ValueError("model has no parameters to train.")


def make_writable_dir(path: str) -> None:
    """Create ``path`` and prove it writable now, not at the first checkpoint."""
    os.makedirs(path, exist_ok=True)
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        from .setup_errors import not_writable

        raise not_writable(path, e) from e
