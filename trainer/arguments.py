"""The Trainer's arguments: their checks, in one place (each error names the argument, what was
expected, what was received and how to fix it), and the default hooks and LR warmup wrapper
they configure."""

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

from .checks import NUMBER, check_int, check_type
from .distributed import get_world_size, is_main_process
from .fsdp import is_sharded
from .hooks import CheckpointHook, DistributedHook, HookBase, LoggerHook, LRUpdateHook
from .logger import is_terminal
from .lr_scheduler import LRWarmupScheduler
from .progress import loader_length
from .step import unwrapped
from .writers import check_writers

logger = logging.getLogger(__name__)

_AMP_DTYPES = (torch.float16, torch.bfloat16)
# Trainer arguments that configure the warmup wrapper it builds, with their defaults.
WARMUP_ARGUMENTS = {
    "by_epoch": True,
    "warmup_t": 0,
    "warmup_by_epoch": False,
    "warmup_mode": "fix",
    "warmup_init_lr": 0.0,
    "warmup_factor": 0.0,
}


# The expected type of every plain constructor argument, and how to say it.
_NUMBER = (NUMBER, "a number")
_FLAG = ((bool,), "True or False")
_SIMPLE_TYPES = {
    "work_dir": ((str, os.PathLike), "a str or os.PathLike path"),
    "unpack_batch_dict": _FLAG, "clip_grad_norm": _NUMBER, "enable_amp": _FLAG,
    "by_epoch": _FLAG, "warmup_by_epoch": _FLAG, "warmup_mode": ((str,), "a str"),
    "warmup_init_lr": _NUMBER, "warmup_factor": _NUMBER, "checkpoint_by_epoch": _FLAG,
    "cuda_graph": _FLAG, "tensorboard": _FLAG, "metrics_jsonl": _FLAG, "progress_bar": _FLAG,
    "plateau_metric": ((str, type(None)), "a str or None"),
    "amp_dtype": ((torch.dtype, type(None)), "torch.float16, torch.bfloat16 or None"),
}  # fmt: skip


def check_arguments(args: dict[str, Any]) -> Optional[int]:
    """Check the Trainer's constructor arguments (by name); returns iterations per epoch, None
    for a data loader without a length (a stream)."""
    _check_types(args["model"], args["optimizer"], args["lr_scheduler"], args["data_loader"])
    for name, (types, what) in _SIMPLE_TYPES.items():
        check_type(name, args[name], types, what)
    check_int("warmup_t", args["warmup_t"], minimum=0, note="0 disables warmup")
    check_writers("metric_writers", args["metric_writers"])
    _check_wiring(args["model"], args["optimizer"], args["lr_scheduler"])
    _check_epochs_or_iters(args["max_epochs"], args["max_iters"])
    for name in ("log_period", "accumulation_steps", "preempt_check_period"):
        check_int(name, args[name], minimum=1)
    check_int("checkpoint_period", args["checkpoint_period"], minimum=0, note="0 disables")
    if args["max_num_checkpoints"] is not None:
        check_int("max_num_checkpoints", args["max_num_checkpoints"], minimum=1)
    if not args["clip_grad_norm"] >= 0:
        raise ValueError(
            f"clip_grad_norm must be >= 0 (0 disables), got {args['clip_grad_norm']!r}."
        )
    if args["amp_dtype"] is not None and args["amp_dtype"] not in _AMP_DTYPES:
        raise ValueError(
            f"amp_dtype must be torch.float16, torch.bfloat16 or None, got {args['amp_dtype']!r}."
        )
    _check_compile(args["compile"], args["cuda_graph"])
    if args["cuda_graph"] and is_sharded(args["model"]):
        raise ValueError(
            "cuda_graph=True does not support models sharded with fully_shard (FSDP2): "
            "its collectives cannot be captured here. Pass cuda_graph=False."
        )
    _check_default_hook_options(args)
    epoch_len = _check_epoch_len(args["data_loader"], args["accumulation_steps"])
    if epoch_len is None and args["max_epochs"]:
        loader = args["data_loader"]
        what = type(loader).__name__
        if getattr(loader, "dataset", None) is not None:
            what += f" over {type(loader.dataset).__name__}"
        raise ValueError(
            f"max_epochs={args['max_epochs']} needs a data_loader with a length, and this one "
            f"(a {what}) has none: it is a stream. Pass max_iters=N instead; an epoch is then "
            "one pass until the stream ends."
        )
    return epoch_len


def run_config(args: dict[str, Any], trainer: Any) -> dict[str, Any]:
    """The run's settings as JSON-ready data: the Trainer's plain arguments, then what its
    objects are (model, optimizer and its base LRs, scheduler, data), the batch size, world
    size, AMP dtype, torch's seed and torch version."""
    optimizer, loader = args["optimizer"], args["data_loader"]
    plain = {
        name: value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
        for name, value in args.items()
        if name in _SIMPLE_TYPES or isinstance(value, (int, float))
    }
    return {
        **plain,
        "work_dir": os.path.abspath(trainer.work_dir),
        "compile": args["compile"] if isinstance(args["compile"], bool) else str(args["compile"]),
        "model": type(unwrapped(args["model"])).__name__,
        "optimizer": type(optimizer).__name__,
        # The LRs the optimizer was given: a torch scheduler keeps them as initial_lr, the
        # warmup (which has set its first LRs already) as its base_lrs; float(): may be tensors
        "base_lrs": [
            float(group.get("initial_lr", base))
            for group, base in zip(optimizer.param_groups, trainer.lr_scheduler.base_lrs)
        ],
        "lr_scheduler": type(args["lr_scheduler"]).__name__,
        "data_loader": type(loader).__name__,
        "batch_size": getattr(loader, "batch_size", None),
        "iters_per_epoch": trainer.epoch_len,
        "world_size": get_world_size(),
        "amp_dtype": str(trainer.amp_dtype).replace("torch.", "") if args["enable_amp"] else None,
        "seed": torch.initial_seed(),  # set_random_seed's or torch.manual_seed's, to repeat the run
        "torch": torch.__version__,
    }


def default_hooks(args: dict[str, Any]) -> list[HookBase]:
    """The hooks every trainer has unless told otherwise, configured by its arguments."""
    return [
        DistributedHook(),
        LRUpdateHook(plateau_metric=args["plateau_metric"]),
        *(
            [
                CheckpointHook(
                    args["checkpoint_period"],
                    args["max_num_checkpoints"],
                    args["checkpoint_by_epoch"],
                )
            ]
            if args["checkpoint_period"]
            else []
        ),  # fmt: skip
        LoggerHook(
            args["log_period"],
            list(args["metric_writers"]),
            args["tensorboard"],
            args["metrics_jsonl"],
        ),  # fmt: skip
        *(_progress_bar() if args["progress_bar"] else []),
    ]


def _progress_bar() -> list[HookBase]:
    """A progress bar where it would draw (rank 0, on a terminal); elsewhere it would cost a call
    per iteration for nothing, and its module is not even imported."""
    if not (is_main_process() and is_terminal(sys.stderr)):
        return []
    from .hooks.progress_bar_hook import ProgressBarHook

    return [ProgressBarHook()]


def warmup_scheduler(args: dict[str, Any], epoch_len: int) -> LRWarmupScheduler:
    """``lr_scheduler`` wrapped with the warmup arguments (unless it is an LRWarmupScheduler)."""
    if isinstance(args["lr_scheduler"], LRWarmupScheduler):
        return args["lr_scheduler"]
    warmup = {name: args[name] for name in WARMUP_ARGUMENTS}
    return LRWarmupScheduler(
        args["lr_scheduler"], epoch_len=epoch_len, optimizer=args["optimizer"], **warmup
    )


def _check_default_hook_options(args: dict[str, Any]) -> None:
    """Options of a default hook act, or are refused: none is silently ignored."""
    scheduler = args["lr_scheduler"]
    if isinstance(scheduler, LRWarmupScheduler):
        ignored = [f"{k}={args[k]!r}" for k, v in WARMUP_ARGUMENTS.items() if args[k] != v]
        if ignored:
            raise ValueError(
                f"lr_scheduler is an LRWarmupScheduler, which already holds its warmup and "
                f"by_epoch settings, so {', '.join(ignored)} would be ignored. Pass them to "
                "the LRWarmupScheduler, or pass the torch scheduler it wraps instead."
            )
    is_plateau = isinstance(scheduler, ReduceLROnPlateau) or (
        isinstance(scheduler, LRWarmupScheduler) and scheduler.is_plateau
    )
    if args["plateau_metric"] is not None and not is_plateau:
        raise ValueError(
            f"plateau_metric={args['plateau_metric']!r} is only used with ReduceLROnPlateau, "
            f"and lr_scheduler is {type(scheduler).__name__}; remove plateau_metric."
        )
    if args["checkpoint_period"] == 0:
        given = [
            name
            for name, value, default in (
                ("max_num_checkpoints", args["max_num_checkpoints"], 3),
                ("checkpoint_by_epoch", args["checkpoint_by_epoch"], True),
            )
            if value != default
        ]
        if given:
            raise ValueError(
                f"checkpoint_period=0 turns periodic checkpoints off, so {', '.join(given)} "
                "would be ignored; remove it, or pass a checkpoint_period >= 1."
            )


def _check_types(model: Any, optimizer: Any, lr_scheduler: Any, data_loader: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}."
        )
    if lr_scheduler is not None and not isinstance(
        lr_scheduler, (LRScheduler, ReduceLROnPlateau, LRWarmupScheduler)
    ):
        raise TypeError(
            "lr_scheduler must be a torch.optim.lr_scheduler scheduler, an LRWarmupScheduler or "
            f"None, got {type(lr_scheduler).__name__}."
        )
    if not hasattr(data_loader, "__iter__"):
        raise TypeError(f"data_loader must be iterable, got {type(data_loader).__name__}.")


def _check_wiring(model: nn.Module, optimizer: Optimizer, lr_scheduler: Any) -> None:
    if not any(group["params"] for group in optimizer.param_groups):
        raise ValueError(
            f"optimizer holds no parameters: {type(optimizer).__name__} would step nothing. "
            f"Build it on the model's parameters: torch.optim.{type(optimizer).__name__}("
            "model.parameters(), ...)."
        )
    own = {id(p) for p in model.parameters()}
    foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
        raise ValueError(
            f"optimizer holds {len(foreign)} parameters that are not the model's (shapes "
            f"{shapes}{', ...' if len(foreign) > 3 else ''}): stepping it would never change "
            "the model. Build it on this model's parameters, e.g. "
            f"torch.optim.{type(optimizer).__name__}(model.parameters(), ...), after moving the "
            "model to its device and wrapping or sharding it."
        )
    scheduler = lr_scheduler
    if isinstance(scheduler, LRWarmupScheduler):
        scheduler = scheduler.torch_scheduler or scheduler
    scheduled = getattr(scheduler, "optimizer", optimizer)
    if scheduled is not optimizer:
        raise ValueError(
            f"lr_scheduler schedules another optimizer ({type(scheduled).__name__} object at "
            f"{id(scheduled):#x}), not the trainer's optimizer ({type(optimizer).__name__} at "
            f"{id(optimizer):#x}), so the trainer's LR would never change. Build it on the "
            f"optimizer you pass: {type(lr_scheduler).__name__}(optimizer, ...)."
        )


def check_closure_free(optimizer: Optimizer) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (LBFGS): the built-in step calls
    ``step()`` once, without one."""
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        name = type(optimizer).__name__
        raise TypeError(
            f"optimizer is a {name}, whose step() needs a closure that re-evaluates the loss, "
            "and the built-in step calls step() once without one. Subclass Trainer and "
            "override train_one_iter:\n"
            "    def train_one_iter(self):\n"
            "        batch = self.next_batch()\n"
            "        def closure():\n"
            "            self.optimizer.zero_grad()\n"
            "            loss, self.losses = self.compute_losses(batch)\n"
            "            self.backward(loss)\n"
            "            return loss\n"
            "        self.optimizer.step(closure)\n"
            "        self.log_losses(**self.losses)"
        )


def warn_unoptimized(model: nn.Module, optimizers: list[Optimizer]) -> None:
    """Warn about trainable parameters of ``model`` that none of ``optimizers`` holds: they
    never change (frozen by omission, which may be meant)."""
    held = {id(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if left:
        logger.warning(
            f"{len(left)} trainable parameters of the model are in no optimizer and will not "
            f"change: {', '.join(left[:5])}{', ...' if len(left) > 5 else ''}. If that is "
            "meant, freeze them with requires_grad_(False); otherwise add them to the optimizer "
            "(or register a second one with register_checkpointable)."
        )


def _check_epochs_or_iters(max_epochs: Any, max_iters: Any) -> None:
    for name, value in (("max_epochs", max_epochs), ("max_iters", max_iters)):
        check_int(name, value, minimum=0)
    if (max_epochs > 0) == (max_iters > 0):
        raise ValueError(
            "Pass exactly one of max_epochs or max_iters "
            f"(got max_epochs={max_epochs}, max_iters={max_iters})."
        )


def _check_compile(compile: Any, cuda_graph: bool) -> None:
    if not isinstance(compile, (bool, dict)):
        raise TypeError(
            f"compile must be a bool or a dict of torch.compile arguments, got "
            f"{type(compile).__name__}."
        )
    if compile and cuda_graph:
        raise ValueError(
            "compile and cuda_graph=True do not combine here; for CUDA graphs under "
            'torch.compile, pass compile={"mode": "reduce-overhead"} instead.'
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


def stream_notice(args: dict[str, Any]) -> Optional[str]:
    """For a data loader without a length (a stream): what its arguments count in epochs, which
    then end only with the stream's passes; None when nothing does."""
    by_epoch, scheduler = [], args["lr_scheduler"]
    if isinstance(scheduler, LRWarmupScheduler):
        stepped_by_epoch = scheduler.by_epoch and scheduler.torch_scheduler is not None
    else:
        stepped_by_epoch = scheduler is not None and args["by_epoch"]
    if stepped_by_epoch:
        by_epoch.append("by_epoch=True steps lr_scheduler")
    if args["checkpoint_period"] and args["checkpoint_by_epoch"]:
        by_epoch.append("checkpoint_by_epoch=True saves checkpoints")
    if not by_epoch:
        return None
    return (
        "data_loader has no length, so an epoch is one pass until its stream ends (never, for "
        f"an endless one), and {' and '.join(by_epoch)} only at such ends and at the end of "
        "training. To count iterations instead, pass by_epoch=False and "
        "checkpoint_by_epoch=False (checkpoint_period then counts iterations)."
    )


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter; a model without any is refused."""
    for tensor in model.parameters():
        return tensor.device
    raise ValueError("model has no parameters to train.")


def make_writable_dir(path: str) -> None:
    """Create ``path`` and prove it writable now, rather than fail at the first checkpoint."""
    os.makedirs(path, exist_ok=True)
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise PermissionError(
            f"{path!r} (the checkpoint folder in work_dir) is not writable ({e.strerror or e}); "
            "pass a writable work_dir."
        ) from e
