"""The Trainer's arguments: their checks (each error names the argument, what was expected,
what was received and how to fix it), the warnings about what a run will not do, and the run's
settings they make."""

import inspect
import logging
import os
import tempfile
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from .data import loader_length
from .distributed import get_world_size, is_sharded
from .lr_scheduler import LRWarmupScheduler
from .misc import NUMBER, check_int, check_type, unwrapped, wrappers

logger = logging.getLogger(__name__)

_AMP_DTYPES = (torch.float16, torch.bfloat16)
# The LRWarmupScheduler's settings that a Trainer passes on, with their defaults (its own).
_WARMUP = ("by_epoch", "warmup_t", "warmup_by_epoch", "warmup_mode", "warmup_init_lr")
WARMUP_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(LRWarmupScheduler).parameters.items()
    if name in (*_WARMUP, "warmup_factor")
}
# The Trainer's parameters that run_config describes rather than copies.
_DESCRIBED = ("model", "optimizer", "lr_scheduler", "data_loader", "work_dir", "enable_amp")
_FLAG = ((bool,), "True or False")
_NUMBER = (NUMBER, "a number")


def check_arguments(settings: dict[str, Any], built_in_step: bool) -> Optional[int]:
    """Check the Trainer's arguments (``settings``: its parameters by name, as given, and
    ``built_in_step``: whether it runs its own ``train_one_iter``); returns the iterations per
    epoch (None for a stream)."""
    model = settings["model"]
    optimizer = settings["optimizer"]
    lr_scheduler = settings["lr_scheduler"]
    _check_types(model, optimizer, lr_scheduler, settings["data_loader"])
    _check_work_dir(settings["work_dir"])
    for name, (types, what) in (
        ("unpack_batch_dict", _FLAG),
        ("clip_grad_norm", _NUMBER),
        ("enable_amp", ((bool, torch.dtype), "True, False or a torch dtype")),
        ("cuda_graph", _FLAG),
    ):
        check_type(name, settings[name], types, what)
    # the warmup's settings: the LRWarmupScheduler that the Trainer builds checks them
    _check_wiring(model, optimizer, lr_scheduler)
    _check_epochs_or_iters(settings["max_epochs"], settings["max_iters"])
    for name in ("log_period", "accumulation_steps", "preempt_check_period"):
        check_int(name, settings[name], minimum=1)
    _check_checkpoints(settings["checkpoint_period"], settings["max_num_checkpoints"])
    _check_step(model, settings["clip_grad_norm"], settings["enable_amp"], settings["cuda_graph"])
    warmup = {name: settings[name] for name in WARMUP_DEFAULTS}
    if isinstance(lr_scheduler, LRWarmupScheduler) and warmup != WARMUP_DEFAULTS:
        ignored = ", ".join(f"{k}={v!r}" for k, v in warmup.items() if v != WARMUP_DEFAULTS[k])
        raise ValueError(f"lr_scheduler is an LRWarmupScheduler: pass {ignored} to it instead.")
    epoch_len = _check_epoch_len(
        settings["data_loader"], settings["accumulation_steps"], settings["max_epochs"]
    )
    if built_in_step:
        _check_closure_free(optimizer)
    return epoch_len


def run_config(
    trainer: Any, settings: dict[str, Any], amp_dtype: Optional[torch.dtype]
) -> dict[str, Any]:
    """The run's settings as JSON-ready data: the Trainer's ``settings`` that are plain data,
    the warmup's, what the trainer's objects are, and the batch size, world size, AMP dtype,
    seed and torch version."""
    optimizer = trainer.optimizer
    loader = trainer.data_loader
    scheduler = trainer.lr_scheduler
    given = {k: v for k, v in settings.items() if k not in (*_DESCRIBED, *WARMUP_DEFAULTS)}
    return {
        **given,
        **{name: getattr(scheduler, name) for name in WARMUP_DEFAULTS},
        "work_dir": trainer.work_dir,
        "model": type(unwrapped(trainer.model)).__name__,
        "compiled": _compiled(trainer.model),
        "optimizer": type(optimizer).__name__,
        # the LRs given: a torch scheduler's initial_lr, else the warmup's base_lrs
        "base_lrs": [
            float(group.get("initial_lr", base))
            for group, base in zip(optimizer.param_groups, scheduler.base_lrs)
        ],
        "lr_scheduler": type(settings["lr_scheduler"]).__name__,
        "data_loader": type(loader).__name__,
        "batch_size": getattr(loader, "batch_size", None),
        "iters_per_epoch": trainer.epoch_len,
        "world_size": get_world_size(),
        "amp_dtype": str(amp_dtype).replace("torch.", "") if amp_dtype else None,
        "seed": torch.initial_seed(),  # set_random_seed's or torch.manual_seed's, to repeat the run
        "torch": torch.__version__,
    }


def _compiled(model: nn.Module) -> bool:
    return any(type(m).__name__ == "OptimizedModule" for m in wrappers(model))


def _check_types(model: Any, optimizer: Any, lr_scheduler: Any, data_loader: Any) -> None:
    check_type("model", model, nn.Module, "a torch.nn.Module")
    check_type("optimizer", optimizer, Optimizer, "a torch.optim.Optimizer")
    schedulers = (LRScheduler, ReduceLROnPlateau, LRWarmupScheduler, type(None))
    check_type("lr_scheduler", lr_scheduler, schedulers, "a torch scheduler or None")
    if not hasattr(data_loader, "__iter__"):
        raise TypeError(f"data_loader must be iterable, got {type(data_loader).__name__}.")


def _check_work_dir(work_dir: Any) -> None:
    check_type("work_dir", work_dir, (str, os.PathLike), "a str or os.PathLike path")
    if not os.fspath(work_dir).strip():  # "": the current directory, "  ": a folder of blanks
        raise ValueError(f"work_dir is blank ({work_dir!r}): pass a folder name, or '.'.")


def _check_wiring(model: nn.Module, optimizer: Optimizer, lr_scheduler: Any) -> None:
    own = {id(p) for p in model.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if foreign:
        # built before the model was moved or wrapped, say: the model would never change
        raise ValueError(
            f"optimizer holds {len(foreign)} parameters not the model's: build it after model.to()."
        )
    scheduler = lr_scheduler
    if isinstance(scheduler, LRWarmupScheduler):
        scheduler = scheduler.torch_scheduler or scheduler
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("lr_scheduler schedules another optimizer: build it on the trainer's.")


def _check_closure_free(optimizer: Optimizer) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (LBFGS) for the built-in step."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        name = type(optimizer).__name__
        raise TypeError(f"optimizer {name} needs a closure in step(): see docs/loop.md.")


def _check_epochs_or_iters(max_epochs: Any, max_iters: Any) -> None:
    for name, value in (("max_epochs", max_epochs), ("max_iters", max_iters)):
        check_int(name, value, minimum=0)
    if (max_epochs > 0) == (max_iters > 0):
        raise ValueError(
            f"Pass one of max_epochs, max_iters; got max_epochs={max_epochs}, "
            f"max_iters={max_iters}."
        )


def _check_checkpoints(checkpoint_period: Any, max_num_checkpoints: Any) -> None:
    check_int("checkpoint_period", checkpoint_period, minimum=0, note="0 disables")
    if max_num_checkpoints is not None:
        check_int("max_num_checkpoints", max_num_checkpoints, minimum=1)
    if checkpoint_period == 0 and max_num_checkpoints != 3:
        raise ValueError("checkpoint_period=0 saves no checkpoints: remove max_num_checkpoints.")


def _check_step(model: nn.Module, clip_grad_norm: Any, enable_amp: Any, cuda_graph: bool) -> None:
    if not clip_grad_norm >= 0:
        raise ValueError(f"clip_grad_norm must be >= 0 (0 disables), got {clip_grad_norm!r}.")
    if isinstance(enable_amp, torch.dtype) and enable_amp not in _AMP_DTYPES:
        raise ValueError(
            f"enable_amp must be True, False, torch.float16 or torch.bfloat16; got {enable_amp}."
        )
    if cuda_graph and _compiled(model):
        raise ValueError('cuda_graph=True with a compiled model: compile(mode="reduce-overhead").')
    if cuda_graph and is_sharded(model):  # its collectives cannot be captured
        raise ValueError(
            "cuda_graph=True does not support models sharded with fully_shard: pass "
            "cuda_graph=False."
        )


def _check_epoch_len(data_loader: Any, accumulation_steps: int, max_epochs: int) -> Optional[int]:
    num_batches = loader_length(data_loader)
    if num_batches is None and max_epochs:
        raise ValueError("max_epochs needs a data_loader with a length: pass max_iters.")
    if num_batches is None:
        return None  # a stream: its epochs end with its passes
    if num_batches == 0:
        raise ValueError("data_loader is empty: it yields no batch.")
    if num_batches < accumulation_steps:
        raise ValueError(
            f"data_loader has {num_batches} batches, fewer than accumulation_steps="
            f"{accumulation_steps}: lower it."
        )
    return num_batches // accumulation_steps


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (one without any has an optimizer of other
    parameters, which check_arguments refused)."""
    return next(model.parameters()).device


def make_writable_dir(path: str) -> None:
    """Create ``path`` and prove it writable now, not at the first checkpoint."""
    os.makedirs(path, exist_ok=True)
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise PermissionError(f"{path} is not writable ({e.strerror or e}).") from e


def warn_unoptimized(model: nn.Module, optimizers: list[Optimizer]) -> None:
    """Warn about trainable parameters of ``model`` that no optimizer holds."""
    held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if left:
        logger.warning(
            f"{len(left)} trainable parameters of the model are in no optimizer and will not "
            f"change: {', '.join(left[:5])}{', ...' if len(left) > 5 else ''} (freeze them "
            "with requires_grad_(False) if that is meant)."
        )


def warn_left_over(num_batches: int, accumulation_steps: int) -> None:
    """Say that the last ``num_batches % accumulation_steps`` batches of each epoch are drawn
    and dropped, if there are any."""
    left = num_batches % accumulation_steps
    if left:
        last = (
            "the last batch of each epoch is" if left == 1 else f"the last {left} of each epoch are"
        )
        logger.warning(
            f"{num_batches} batches per epoch, accumulation_steps={accumulation_steps}: {last} "
            "left over and dropped (drawn, not trained on). To train on every batch, make "
            f"len(data_loader) a multiple of {accumulation_steps} (batch size, dataset size, "
            "drop_last)."
        )


def warn_stream_epochs(scheduler: LRWarmupScheduler, hooks: Iterable[Any]) -> None:
    """For a data loader without a length: say what counts in epochs, which end only with its
    passes."""
    by_epoch = []
    if scheduler.by_epoch and scheduler.torch_scheduler is not None:
        by_epoch.append("by_epoch=True steps lr_scheduler")
    if any(getattr(hook, "saves_by_epoch", False) for hook in hooks):  # a CheckpointHook's
        by_epoch.append("the CheckpointHook saves checkpoints")
    if by_epoch:
        logger.warning(
            f"data_loader has no length, so {' and '.join(by_epoch)} only when its stream ends "
            "and at the end of training (docs/arguments.md, 'Streaming datasets')."
        )
