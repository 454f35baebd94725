"""The :class:`Trainer`: the training loop; everything else is a hook."""

import contextlib
import functools
import logging
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader

from .checkpoint import (
    BackgroundWriter,
    atomic_save,
    copy_to_cpu,
    list_checkpoints,
    load_checkpoint_file,
    remove_temp_files,
    update_latest_pointer,
)
from .cuda_graph import GraphedStep, check_graphable
from .distributed import all_gather_tensor, gather, get_rank, get_world_size, is_main_process
from .env import collect_env
from .fsdp import (
    full_state_dicts,
    is_sharded,
    keyed_by_name,
    load_full_model_state,
    load_full_optimizer_state,
    local_value,
    no_gradient_sync,
)
from .hooks import CheckpointHook, DistributedHook, HookBase, LoggerHook, LRUpdateHook
from .logger import ensure_console_logging, log_file_path, log_to_file
from .lr_scheduler import LRWarmupScheduler
from .metric_storage import MetricStorage
from .seed import get_rng_state, set_rng_state
from .writers import MetricWriter

logger = logging.getLogger(__name__)

_AMP_DTYPES = (torch.float16, torch.bfloat16)


class _Series(NamedTuple):
    """One metric's values waiting for the next flush. ``reduced``: the trainer's own metrics,
    averaged (or maxed) over ranks under torchrun; ``check_finite``: losses."""

    smooth: bool
    check_finite: bool
    reduced: bool
    iters: list[int]
    values: list[Any]


# Reduced across ranks by max (the slowest rank sets the pace); the trainer's other metrics by mean.
_MAX_REDUCED = frozenset({"data_time", "iter_time", "amp_skipped_steps"})
_EVENTS = (
    "before_train",
    "after_train",
    "before_epoch",
    "after_epoch",
    "before_iter",
    "after_iter",
    "after_eval",
)
# SIGUSR1 is what SLURM sends ahead of preemption (with --signal=USR1@<seconds>).
_PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# What a checkpoint needs to resume a run (a weights-only load needs "model" alone).
_RESUME_KEYS = ("progress", "config", "model", "optimizer", "lr_scheduler", "grad_scaler",
                "metric_storage", "hooks", "rng")  # fmt: skip


class Trainer:
    """Trains a model that returns its loss; hooks do everything around the loop.

    Each iteration fetches ``accumulation_steps`` batches, runs ``model(batch)`` (or
    ``model(**batch)``), which returns a scalar loss or a dict of scalar losses, back-propagates
    their sum and steps the optimizer. The default hooks update the LR, save checkpoints under
    ``work_dir/checkpoints`` and log to the console, ``work_dir/log.txt`` and TensorBoard. For
    anything fancier, subclass and override :meth:`train_one_iter`.

    Args:
        model: Returns a scalar loss tensor or a dict of them. Moving the batch to the model's
            device is the model's job.
        optimizer: The optimizer of ``model``'s parameters.
        lr_scheduler: A ``torch.optim.lr_scheduler`` scheduler (ReduceLROnPlateau included), an
            :class:`LRWarmupScheduler`, or None for a constant LR.
        data_loader: A data loader, or any iterable with a length that yields batches (a list of
            batches already on the GPU, say).
        max_epochs: Train this many epochs (pass exactly one of ``max_epochs``, ``max_iters``).
        max_iters: Train this many iterations, crossing data-loader passes as needed.
        work_dir: Where checkpoints, ``log.txt`` and TensorBoard files go.
        unpack_batch_dict: Call ``model(**batch)`` instead of ``model(batch)``.
        max_num_checkpoints: Keep only the newest N periodic checkpoints; None keeps all.
        checkpoint_period: Save every N epochs (or iterations: see ``checkpoint_by_epoch``).
        log_period: Turn device metrics into numbers and log them every N iterations.
        clip_grad_norm: Clip the gradient norm to this value; 0 disables clipping.
        enable_amp: Mixed precision through ``torch.autocast``.
        amp_dtype: ``torch.float16`` (with a GradScaler) or ``torch.bfloat16``; None picks
            float16 on CUDA and bfloat16 on CPU.
        accumulation_steps: Micro-batches whose gradients are summed per optimizer step.
        by_epoch: Whether ``lr_scheduler`` steps once per epoch (True) or per iteration.
        warmup_t: Warmup length in iterations (or epochs with ``warmup_by_epoch``); 0 disables.
        warmup_by_epoch: Count ``warmup_t`` in epochs.
        warmup_mode: ``"fix"``, ``"factor"`` or ``"auto"``; see :class:`LRWarmupScheduler`.
        warmup_init_lr: The first LR of ``"fix"`` warmup.
        warmup_factor: The starting factor of ``"factor"`` and ``"auto"`` warmup.
        plateau_metric: With ReduceLROnPlateau, the metric it judges (e.g. one your
            :class:`~trainer.hooks.EvalHook` returns); it steps after each new value.
        checkpoint_by_epoch: Count ``checkpoint_period`` in epochs (passes over the data, also in
            iteration-based training) or, with False, in iterations (mid-epoch checkpoints).
        cuda_graph: Capture the whole step (forward, backward, clipping, optimizer step) in a CUDA
            graph after 3 eager iterations and replay it. Needs a static-shape model on CUDA
            without host syncs, and an optimizer that can be captured: ``capturable=True`` for
            Adam/AdamW and the like (plus ``fused=True`` with float16 AMP), ``fused=True`` for
            SGD. Batches are copied into static device buffers; iterations whose batches have
            another shape run eagerly.
        metric_writers: More places for the metrics of each log point (rank 0 only), besides
            the console, TensorBoard and ``work_dir/metrics.jsonl``: see
            :class:`~trainer.writers.MetricWriter`.

    Example::

        >>> import torch, tempfile
        >>> from torch import nn
        >>> class Regressor(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = nn.Linear(4, 1)
        ...     def forward(self, batch):
        ...         x, y = batch
        ...         return nn.functional.mse_loss(self.net(x), y)
        >>> data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        >>> loader = torch.utils.data.DataLoader(data, batch_size=8)
        >>> model = Regressor()
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        >>> trainer = Trainer(model, optimizer, scheduler, loader, max_epochs=2,
        ...                   work_dir=tempfile.mkdtemp(), log_period=2)
        >>> trainer.train()
        >>> trainer.cur_iter, trainer.metric_storage["total_loss"].count
        (7, 8)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        lr_scheduler: Union[LRScheduler, ReduceLROnPlateau, LRWarmupScheduler, None],
        data_loader: DataLoader,
        max_epochs: int = 0,
        max_iters: int = 0,
        *,
        work_dir: str = "work_dir",
        unpack_batch_dict: bool = False,
        max_num_checkpoints: Optional[int] = None,
        checkpoint_period: int = 1,
        log_period: int = 50,
        clip_grad_norm: float = 0.0,
        enable_amp: bool = False,
        amp_dtype: Optional[torch.dtype] = None,
        accumulation_steps: int = 1,
        by_epoch: bool = True,
        warmup_t: int = 0,
        warmup_by_epoch: bool = False,
        warmup_mode: str = "fix",
        warmup_init_lr: float = 0.0,
        warmup_factor: float = 0.0,
        plateau_metric: Optional[str] = None,
        checkpoint_by_epoch: bool = True,
        cuda_graph: bool = False,
        metric_writers: Sequence[MetricWriter] = (),
        compile: Union[bool, dict[str, Any]] = False,
    ) -> None:
        _check_types(model, optimizer, lr_scheduler, data_loader)
        _check_epochs_or_iters(max_epochs, max_iters)
        for name, value in [
            ("checkpoint_period", checkpoint_period),
            ("log_period", log_period),
            ("accumulation_steps", accumulation_steps),
        ]:
            _check_positive_int(name, value)
        if max_num_checkpoints is not None:
            _check_positive_int("max_num_checkpoints", max_num_checkpoints)
        if not clip_grad_norm >= 0:
            raise ValueError(f"clip_grad_norm must be >= 0 (0 disables), got {clip_grad_norm!r}.")
        if amp_dtype is not None and amp_dtype not in _AMP_DTYPES:
            raise ValueError(
                f"amp_dtype must be torch.float16, torch.bfloat16 or None, got {amp_dtype!r}."
            )

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
        self.model = model
        # DDP (also under torch.compile) skips its gradient all-reduce with no_sync()
        self._ddp = next(
            (m for m in _wrappers(model) if isinstance(m, DistributedDataParallel)), None
        )
        if compile:
            self.model = torch.compile(model, **(compile if isinstance(compile, dict) else {}))
        self.optimizer = optimizer
        self.data_loader = data_loader
        self.work_dir = work_dir
        self.unpack_batch_dict = unpack_batch_dict
        self.clip_grad_norm = clip_grad_norm
        self.accumulation_steps = accumulation_steps
        self.log_period = log_period

        self.epoch_len = _check_epoch_len(data_loader, accumulation_steps)
        self._batch_size = getattr(data_loader, "batch_size", None)  # per process
        self.epoch_based = max_epochs > 0
        self.max_epochs = max_epochs if self.epoch_based else math.ceil(max_iters / self.epoch_len)
        self.max_iters = max_epochs * self.epoch_len if self.epoch_based else max_iters

        if isinstance(lr_scheduler, LRWarmupScheduler):
            self.lr_scheduler = lr_scheduler
        else:
            self.lr_scheduler = LRWarmupScheduler(
                lr_scheduler, by_epoch, self.epoch_len, warmup_t, warmup_by_epoch, warmup_mode,
                warmup_init_lr, warmup_factor, optimizer=optimizer,
            )  # fmt: skip
        if self.lr_scheduler.is_plateau and plateau_metric is None:
            raise ValueError(
                "ReduceLROnPlateau needs a metric: pass plateau_metric='<name>', a metric that "
                "your EvalHook's eval_func returns (e.g. plateau_metric='val_loss')."
            )

        self.device = _model_device(model)
        self.enable_amp = enable_amp
        self.amp_dtype = amp_dtype or (
            torch.float16 if self.device.type == "cuda" else torch.bfloat16
        )
        # One code path: with AMP off, autocast becomes a null context and the scaler a no-op.
        # (A CUDA graph replays the weight casts too: autocast's cache of them must stay off.)
        self._autocast = (
            functools.partial(
                torch.autocast, self.device.type, self.amp_dtype, cache_enabled=not cuda_graph
            )
            if enable_amp
            else _no_op
        )
        # bfloat16 has float32's range, so only float16 needs loss scaling.
        self._scaler = torch.amp.GradScaler(
            self.device.type, enabled=enable_amp and self.amp_dtype == torch.float16
        )
        self._sharded = is_sharded(model)  # by FSDP2's fully_shard
        self._graphed_step: Optional[GraphedStep] = None
        if cuda_graph and self._sharded:
            raise ValueError(
                "cuda_graph=True does not support models sharded with fully_shard (FSDP2): "
                "its collectives cannot be captured here. Pass cuda_graph=False."
            )
        if cuda_graph:
            check_graphable(model, optimizer, self.device, self._scaler.is_enabled())
            self._graphed_step = GraphedStep(self._step, optimizer, self.device)
        # Whether the GradScaler skipped the last step: a bool, or a device tensor with fused
        # optimizers, which skip on the device.
        self._skipped: Union[bool, torch.Tensor] = False

        # Progress. cur_iter is the current (or last finished) iteration, counted from 0.
        self.cur_epoch = 0
        self.inner_iter = 0
        self.cur_iter = -1
        self.start_iter = 0
        self.start_epoch = 0
        self._position = (0, 0)  # (epoch, iterations done in it): where training goes on from

        self._storage = MetricStorage()
        self._pending: dict[str, _Series] = {}  # what the next flush turns into numbers
        self._data_iter: Optional[Any] = None
        self._epoch_rng: Optional[dict[str, Any]] = None
        self._batches_to_skip = 0
        self._data_time = 0.0
        self._iter_start = 0.0
        self._hooks: list[HookBase] = []
        self._event_handlers: dict[str, list[Any]] = {event: [] for event in _EVENTS}
        self._preempt_signal: Optional[int] = None  # caught by this process
        self._agreed_signal = 0  # under torchrun: caught by any rank, as of the last log point
        self._stop_requested = False
        # (position, stopped) of the last checkpoint saved or loaded
        self._saved = ((-1, -1), False)
        self._writer = BackgroundWriter()

        _make_writable_dir(self.ckpt_dir)
        self.register_hooks(
            [
                DistributedHook(),
                LRUpdateHook(plateau_metric=plateau_metric),
                CheckpointHook(checkpoint_period, max_num_checkpoints, checkpoint_by_epoch),
                LoggerHook(log_period, list(metric_writers)),
            ]
        )

    # ----------------------------------------------------------------------------------------
    # Properties

    @property
    def lr(self) -> float:
        """The LR of the optimizer's first parameter group."""
        return self.optimizer.param_groups[0]["lr"]

    @property
    def epoch_iters(self) -> int:
        """Iterations in the current epoch (the last one may be shorter in iteration mode)."""
        return min(self.epoch_len, self.max_iters - self.cur_epoch * self.epoch_len)

    @property
    def model_or_module(self) -> nn.Module:
        """The model without its torch.compile and DistributedDataParallel / DataParallel
        wrappers: the module whose weights checkpoints hold."""
        *_, module = _wrappers(self.model)
        return module

    @property
    def ckpt_dir(self) -> str:
        """``work_dir/checkpoints``."""
        return os.path.join(self.work_dir, "checkpoints")

    @property
    def tb_log_dir(self) -> str:
        """``work_dir/tb_logs``."""
        return os.path.join(self.work_dir, "tb_logs")

    @property
    def log_file(self) -> str:
        """This rank's text log: ``work_dir/log.txt`` (``log_rank{N}.txt`` on other ranks)."""
        return log_file_path(self.work_dir, get_rank())

    @property
    def metric_storage(self) -> MetricStorage:
        """The smoothed metrics, up to date.

        Reading it turns the pending on-device values into numbers: a CPU-GPU sync point, so hooks
        read it on log iterations only.
        """
        self._flush_metrics()
        return self._storage

    @property
    def step_skipped(self) -> bool:
        """Whether the float16 GradScaler skipped the last optimizer step (inf/NaN gradients).

        With fused optimizers the flag lives on the device: reading it is a CPU-GPU sync.
        """
        return bool(self._skipped)

    @property
    def hook_info(self) -> list[str]:
        """The registered hooks in the order they run, with their priorities."""
        return [f"{type(h).__name__} (priority {h.priority})" for h in self._hooks]

    # ----------------------------------------------------------------------------------------
    # Hooks

    def register_hook(self, hook: HookBase) -> None:
        """Add a hook; hooks run by ascending ``priority``, ties in registration order."""
        if not isinstance(hook, HookBase):
            raise TypeError(f"hook must be a HookBase instance, got {type(hook).__name__}.")
        # A proxy, not a reference: the trainer owns its hooks, and a cycle would keep both alive.
        hook.trainer = weakref.proxy(self)
        position = sum(1 for h in self._hooks if h.priority <= hook.priority)
        self._hooks.insert(position, hook)
        # Per event, only the hooks that override it: the loop skips HookBase's no-ops.
        self._event_handlers = {
            event: [
                (i, getattr(h, event)) for i, h in enumerate(self._hooks) if _overrides(h, event)
            ]
            for event in _EVENTS
        }
        self._hook_seconds = [0.0] * len(self._hooks)

    def register_hooks(self, hooks: list[Optional[HookBase]]) -> None:
        """Add several hooks; None entries are skipped."""
        for hook in hooks:
            if hook is not None:
                self.register_hook(hook)

    def _call_hooks(self, event: str, *args: Any) -> None:
        seconds = self._hook_seconds
        for i, handler in self._event_handlers[event]:
            start = time.perf_counter()
            handler(*args)
            seconds[i] += time.perf_counter() - start

    @property
    def hook_seconds(self) -> dict[str, float]:
        """Seconds spent in each hook since :meth:`train` started, by class name (a hook's
        ``after_eval`` time also counts in the ``EvalHook`` that calls it)."""
        totals: dict[str, float] = {}
        for hook, seconds in zip(self._hooks, self._hook_seconds):
            name = type(hook).__name__
            totals[name] = totals.get(name, 0.0) + seconds
        return totals

    # ----------------------------------------------------------------------------------------
    # The loop

    def train(
        self,
        resume_from_checkpoint: Optional[str] = None,
        auto_resume: bool = True,
        continue_after_stop: bool = False,
    ) -> None:
        """Train, first resuming from ``resume_from_checkpoint`` or the latest checkpoint.

        SIGTERM or SIGUSR1 (preemption) makes it finish the current iteration, save a checkpoint
        and exit with status 128 + the signal number; a second signal exits at once.

        Args:
            resume_from_checkpoint: A checkpoint to resume from; it must exist.
            auto_resume: Without ``resume_from_checkpoint``, resume from ``work_dir``'s latest
                checkpoint when there is one.
            continue_after_stop: Train on from a checkpoint that :meth:`stop` ended; by default
                such a run stays stopped.
        """
        ensure_console_logging("trainer", get_rank())
        self._hook_seconds = [0.0] * len(self._hooks)
        # Signals are caught from the start: one during start-up exits after the first iteration.
        with log_to_file("trainer", self.log_file), self._catch_preemption():
            logger.info(f"Environment:\n{collect_env()}")
            logger.info(f"Hooks: {self.hook_info}")
            if is_main_process():
                for stray in remove_temp_files(self.ckpt_dir):
                    logger.info(f"Removed {stray}, left by an interrupted checkpoint write.")
            if resume_from_checkpoint is not None:
                self.load_checkpoint(resume_from_checkpoint)
            elif auto_resume:
                self.load_checkpoint(auto_resume=True)
            self.start_epoch, start_inner = self._position
            # a checkpoint that stop() ended, where training goes on from: stay stopped
            resumed_stopped = self._saved == (self._position, True)
            self._stop_requested = resumed_stopped and not continue_after_stop
            if self._stop_requested:
                logger.info(
                    f"The run was ended by stop() at iteration {self.start_iter}: not training "
                    "on. Pass train(continue_after_stop=True) to go on."
                )
            logger.info(f"Start training from iteration {self.start_iter} of {self.max_iters}.")
            self._call_hooks("before_train")
            try:
                with self._watch_skipped_steps():
                    end_epoch = self.start_epoch if self._stop_requested else self.max_epochs
                    for self.cur_epoch in range(self.start_epoch, end_epoch):
                        self._call_hooks("before_epoch")
                        self.model.train()
                        for self.inner_iter in range(start_inner, self.epoch_iters):
                            self.cur_iter = self.cur_epoch * self.epoch_len + self.inner_iter
                            self._iter_start = time.perf_counter()
                            self._call_hooks("before_iter")
                            self.train_one_iter()
                            self._end_iter()
                            self._call_hooks("after_iter")
                            if self._stop_requested:
                                break
                            if self._stop_signal() and self.cur_iter < self.max_iters - 1:
                                self._exit_preempted()
                        if self._position[1] < self.epoch_iters:  # stop() in mid-epoch
                            break
                        start_inner = 0
                        self._data_iter = None
                        self._position = (self.cur_epoch + 1, 0)
                        self._call_hooks("after_epoch")
                        if self._stop_requested:
                            break
                if self._stop_requested and self._saved != (self._position, True):
                    # so that a rerun resumes here and stays stopped
                    self.save_checkpoint(self._stop_checkpoint_name())
            except Exception:
                # in this rank's log file too, tagged with the iteration
                logger.exception(f"Training failed in iteration {self.cur_iter}:")
                raise
            finally:
                try:
                    self._call_hooks("after_train")
                finally:
                    self.wait_for_checkpoint()  # the last checkpoint is on disk when train() ends

    def stop(self) -> None:
        """End training after the current iteration, or after this epoch when called at its end.

        The remaining hooks of the iteration (or epoch) run, then ``after_train``; the state is
        saved in a checkpoint that remembers the stop, so rerunning the script does not train
        on unless ``train(continue_after_stop=True)``. Under torchrun, call it on every rank at
        the same iteration, as hooks acting on evaluation results (the same on every rank) do.
        """
        if not self._stop_requested:
            logger.info(f"Stopping after iteration {self.cur_iter + 1}, as stop() asked.")
        self._stop_requested = True

    def _stop_checkpoint_name(self) -> str:
        epoch, inner = self._position
        if self.epoch_based and inner == 0:
            return f"epoch_{epoch}.pth"
        return f"iter_{self.cur_iter + 1}.pth"  # as preemption and CheckpointHook name them

    @contextlib.contextmanager
    def _watch_skipped_steps(self) -> Iterator[None]:
        if not self._scaler.is_enabled():
            yield
            return
        # Removed when train() ends, so the optimizer never keeps the trainer alive.
        handle = self.optimizer.register_step_post_hook(self._on_optimizer_step)
        try:
            yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def _catch_preemption(self) -> Iterator[None]:
        """Turn SIGTERM / SIGUSR1 into "finish this iteration, save, exit" while training."""
        if threading.current_thread() is not threading.main_thread():
            yield  # Python lets only the main thread handle signals
            return
        self._preempt_signal, self._agreed_signal = None, 0
        previous = {sig: signal.signal(sig, self._on_preempt_signal) for sig in _PREEMPT_SIGNALS}
        try:
            yield
        finally:
            # Restored so that no handler keeps the trainer alive after train().
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_preempt_signal(self, signum: int, frame: Any) -> None:
        if self._preempt_signal is not None:
            # A second signal: exit at once, the way the default handler does.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self._preempt_signal = signum

    def _stop_signal(self) -> int:
        # Under torchrun every rank must stop at the same iteration (the save is a collective):
        # they learn of each other's signals at log points, with the metrics.
        if get_world_size() > 1:
            return self._agreed_signal
        return self._preempt_signal or 0

    def _exit_preempted(self) -> None:
        signum = self._stop_signal()
        name = signal.Signals(signum).name
        path = self.save_checkpoint(f"iter_{self.cur_iter + 1}.pth")
        self.wait_for_checkpoint()
        status = 128 + signum  # what a shell reports for death by this signal
        logger.warning(
            f"Preempted by {name} after iteration {self.cur_iter + 1}: saved "
            f"{path or 'a checkpoint (rank 0 writes)'}; exiting with status {status}. Rerun the "
            "same command to resume."
        )
        raise SystemExit(status)

    def train_one_iter(self) -> None:
        """Fetch, forward, backward and step once: subclass and override this for anything fancier.

        An override fetches data with :meth:`next_batch`, records its numbers with :meth:`log`
        (tensors stay on the device until the next log point) and steps ``self.optimizer``.
        """
        batches = [self.next_batch() for _ in range(self.accumulation_steps)]
        losses, extras = (self._graphed_step or self._step)(batches)
        # they stay on the device until the next log point
        self._log_pending(self.cur_iter, losses, check_finite=True, reduced=True)
        self._log_pending(self.cur_iter, extras, reduced=True)

    def _step(self, batches: list[Any], set_to_none: bool = True) -> tuple[dict, dict]:
        """Forward, backward and step on ``batches`` (one per micro-step); returns the losses and
        other metrics as device tensors. ``cuda_graph=True`` captures this whole method."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        k = len(batches)
        losses: dict[str, torch.Tensor] = {}
        for micro_step, batch in enumerate(batches):
            # 1. forward under autocast (a no-op when AMP is off)
            with self._no_grad_sync(micro_step < k - 1):
                with self._autocast():
                    out = self.model(**batch) if self.unpack_batch_dict else self.model(batch)
                loss, logged = _total_loss(out)
                # 2. backward; the scaler multiplies the loss only with float16 AMP
                self._scaler.scale(loss / k if k > 1 else loss).backward()
            losses = {n: losses[n] + v for n, v in logged.items()} if losses else logged
        if k > 1:
            losses = {name: value / k for name, value in losses.items()}

        # 3. clip gradients, unscaled first so the threshold means what it says
        extras: dict[str, Any] = {}
        if self.clip_grad_norm > 0:
            self._scaler.unscale_(self.optimizer)
            grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
            grad_norm = grad_norm.detach()
            # FSDP2: a replicated DTensor
            extras["grad_norm"] = local_value(grad_norm) if self._sharded else grad_norm

        # 4. step; with float16 the scaler skips the step when gradients hold inf or NaN
        self._skipped = self._scaler.is_enabled()  # until _on_optimizer_step says otherwise
        self._scaler.step(self.optimizer)
        self._scaler.update()
        if self._scaler.is_enabled():
            extras["amp_skipped_steps"] = self._skipped
        return losses, extras

    def _on_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # GradScaler calls optimizer.step() only for finite gradients, except with optimizers
        # that skip on the device (fused ones), which it hands the inf flag as `found_inf`.
        found_inf = getattr(optimizer, "found_inf", None)
        self._skipped = False if found_inf is None else found_inf

    def next_batch(self) -> Any:
        """The next batch of the current epoch's pass over the data loader."""
        start = time.perf_counter()
        if self._data_iter is None:
            self._data_iter = self._start_data_pass()
        try:
            batch = next(self._data_iter)
        except StopIteration:
            raise RuntimeError(
                f"data_loader ended after fewer batches than its len() of {len(self.data_loader)}; "
                "make __len__ of the dataset or sampler match what it yields."
            ) from None
        self._data_time += time.perf_counter() - start
        return batch

    def _start_data_pass(self) -> Any:
        generators = self._data_generators()
        if self._batches_to_skip:
            # Resuming mid-epoch: replay the shuffle (and worker seeds) of the interrupted pass
            # from the RNG state it started with, skip what was consumed, then go back to the RNG
            # state of the checkpoint. Skipped batches are loaded but never reach the model.
            now = get_rng_state(generators)
            set_rng_state(self._epoch_rng, generators)
            data_iter = iter(self.data_loader)
            for _ in range(self._batches_to_skip):
                next(data_iter)
            set_rng_state(now, generators)
            self._batches_to_skip = 0
            return data_iter
        self._epoch_rng = get_rng_state(generators)
        return iter(self.data_loader)

    def _data_generators(self) -> tuple[torch.Generator, ...]:
        found: list[torch.Generator] = []
        for owner in (self.data_loader, getattr(self.data_loader, "sampler", None)):
            g = getattr(owner, "generator", None)
            if isinstance(g, torch.Generator) and all(g is not f for f in found):
                found.append(g)
        return tuple(found)

    def _no_grad_sync(self, skip: bool) -> contextlib.AbstractContextManager:
        # DDP all-reduces (FSDP2 reduce-scatters) gradients in backward; accumulate locally until
        # the last micro-batch.
        if skip and self._ddp is not None:
            return self._ddp.no_sync()
        if skip and self._sharded:
            return no_gradient_sync(self.model)
        return _NO_OP

    def _end_iter(self) -> None:
        self._position = (self.cur_epoch, self.inner_iter + 1)
        iter_time = time.perf_counter() - self._iter_start
        times = {"data_time": self._data_time, "iter_time": iter_time}
        self._log_pending(self.cur_iter, times, reduced=True)
        self._data_time = 0.0
        if (self.cur_iter + 1) % self.log_period == 0 or self.cur_iter == self.max_iters - 1:
            # The LR this iteration used (LRUpdateHook changes it after the iteration); only the
            # latest value is ever shown, so it is recorded at log points alone.
            self._log_pending(self.cur_iter, {"lr": self.lr}, smooth=False)
            self._flush_metrics(every_rank=True)

    # ----------------------------------------------------------------------------------------
    # Metrics

    def log(self, iter: int, smooth: bool = True, **metrics: Union[float, torch.Tensor]) -> None:
        """Record metrics of iteration ``iter`` in :attr:`metric_storage`.

        Scalar tensors stay on their device until the next log point, so logging a loss every
        iteration costs no sync. Under torchrun the values are this rank's own (the trainer's
        own metrics, unlike these, are reduced across ranks).

        Args:
            iter: The iteration the values belong to.
            smooth: Whether the logger shows the window mean (True) or the latest value.
            metrics: Names and numbers or scalar tensors.
        """
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(
                        f"Metric {name!r} must be a number or a one-element tensor, got a tensor "
                        f"of shape {tuple(value.shape)}; reduce it first (e.g. .mean())."
                    )
                metrics[name] = value.detach().reshape(())
        self._log_pending(iter, metrics, smooth)

    def _log_pending(
        self,
        iter: int,
        metrics: dict[str, Any],
        smooth: bool = True,
        check_finite: bool = False,
        reduced: bool = False,
    ) -> None:
        # Called every iteration, so kept lean: values are numbers or detached scalar tensors.
        for name, value in metrics.items():
            series = self._pending.get(name)
            if series is None:
                series = self._pending[name] = _Series(smooth, check_finite, reduced, [], [])
            series.iters.append(iter)
            series.values.append(value)

    def _flush_metrics(self, every_rank: bool = False) -> None:
        """Move pending metrics into the storage; raise on a non-finite loss.

        Under torchrun, the trainer's own metrics wait for a point that every rank reaches
        (``every_rank``: a log iteration or a save), where one collective reduces them: losses
        and the gradient norm are averaged, times and skipped steps maxed. A non-finite loss on
        any rank then makes every rank raise at the same iteration.
        """
        distributed = get_world_size() > 1
        names = [
            n for n, s in self._pending.items() if every_rank or not (distributed and s.reduced)
        ]
        if not names:
            return
        pending = {name: self._pending.pop(name) for name in names}
        numbers = self._numbers(pending, distributed)
        first_bad = math.inf  # the first iteration with a non-finite loss
        for name, series in pending.items():
            if series.check_finite and not all(map(math.isfinite, numbers[name])):
                bad = min(it for it, v in zip(series.iters, numbers[name]) if not math.isfinite(v))
                first_bad = min(first_bad, bad)
        at_first_bad = {}
        for name, series in pending.items():
            iters, values = series.iters, numbers[name]
            keep = [i for i, it in enumerate(iters) if it < first_bad]  # all, when none is bad
            kept_iters, kept_values = [iters[i] for i in keep], [values[i] for i in keep]
            self._storage.extend(name, kept_iters, kept_values, series.smooth)
            if first_bad in iters:
                at_first_bad[name] = values[iters.index(first_bad)]
        if at_first_bad:
            raise FloatingPointError(
                f"Loss became NaN or infinite at iteration {first_bad} (epoch "
                f"{first_bad // self.epoch_len}): {at_first_bad}. Lower the LR, enable "
                "clip_grad_norm, or check the data of that iteration."
            )

    def _numbers(self, pending: dict[str, _Series], distributed: bool) -> dict[str, list[float]]:
        """The pending values as numbers: this rank's in one transfer, reduced ones over ranks."""
        reduced = sorted(n for n, s in pending.items() if distributed and s.reduced)  # same order
        local = [n for n in pending if n not in reduced]
        # note: the one CPU-GPU sync of a log period
        flat = iter(_to_host([v for n in local for v in pending[n].values]))
        numbers = {n: [next(flat) for _ in pending[n].values] for n in local}
        if reduced:
            # the last element: the preemption signal this rank caught, if any
            caught = torch.tensor([float(self._preempt_signal or 0)], dtype=torch.float64)
            values = [_to_tensor(pending[n].values, self.device) for n in reduced]
            packed = torch.cat([*values, caught.to(self.device)])
            *per_rank, signals = zip(*all_gather_tensor(packed).cpu().tolist())
            self._agreed_signal = int(max(signals))
            columns = iter(per_rank)  # one per value, each holding every rank's
            for n in reduced:
                reduce = max if n in _MAX_REDUCED else statistics.fmean
                numbers[n] = [reduce(next(columns)) for _ in pending[n].values]
        return numbers

    # ----------------------------------------------------------------------------------------
    # Checkpoints

    def save_checkpoint(
        self, file_name: str, *, then: Optional[Callable[[], None]] = None
    ) -> Optional[str]:
        """Save the full training state as ``ckpt_dir/file_name`` and point ``latest.txt`` at it.

        Training waits only while the state is copied (to CPU memory); the file is written in the
        background, atomically, and ``latest.txt`` moves once it is durable. The next save, the
        end of :meth:`train`, a preemption exit and :meth:`wait_for_checkpoint` wait for the
        write and raise its error, if any. Every rank must call this: each checks its losses
        first (so a non-finite loss raises before it can reach a checkpoint) and hands rank 0 its
        RNG state; rank 0 alone writes.

        Args:
            file_name: The checkpoint's file name in ``ckpt_dir``.
            then: Called in the background once the file and ``latest.txt`` are durable (e.g. to
                delete older checkpoints).

        Returns:
            The path being written, or None on other ranks.
        """
        self._flush_metrics(every_rank=True)
        self._saved = (self._position, self._stop_requested)
        # FSDP2: every rank takes part in gathering the full weights, which rank 0 writes.
        weights = full_state_dicts(self.model, self.optimizer) if self._sharded else None
        # Per-rank RNG, so every rank's dropout and data-worker seeds resume exactly.
        inner = self._position[1]
        rng = {"now": get_rng_state(self._data_generators())}
        rng["epoch_start"] = self._epoch_rng if inner > 0 else None
        rng_per_rank = gather(rng)
        if not is_main_process():
            return None
        self._writer.wait()  # one write at a time; raises if the previous one failed
        state = copy_to_cpu(self._state_dict(rng_per_rank, weights is None))
        if weights is not None:  # gathered into fresh CPU tensors already: no second copy
            state["model"], state["optimizer"] = weights
        ckpt_dir = self.ckpt_dir
        path = os.path.join(ckpt_dir, file_name)

        def write() -> None:
            atomic_save(state, path)
            update_latest_pointer(ckpt_dir, file_name)
            logger.info(f"Saved checkpoint {path}")
            if then is not None:
                then()

        self._writer.submit(write)
        return path

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written in the background is on disk.

        Raises:
            OSError: The write failed (the previous checkpoint and ``latest.txt`` are untouched).
        """
        self._writer.wait()

    def _state_dict(self, rng_per_rank: list[dict[str, Any]], with_weights: bool) -> dict[str, Any]:
        epoch, inner = self._position
        state = {
            "progress": {
                "epoch": epoch,
                "inner_iter": inner,
                "epoch_len": self.epoch_len,
                "world_size": get_world_size(),
                "batch_size": self._batch_size,
                "stopped": self._stop_requested,
            },
            "config": self._config(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "grad_scaler": self._scaler.state_dict(),
            "metric_storage": self._storage.state_dict(),
            "hooks": {key: h.state_dict() for key, h in self._checkpointable_hooks().items()},
            "rng": rng_per_rank,
        }
        if with_weights:
            state["model"] = self.model_or_module.state_dict()
            state["optimizer"] = self.optimizer.state_dict()
        return state

    def load_checkpoint(
        self,
        path: Optional[str] = None,
        auto_resume: bool = False,
        *,
        resume: bool = True,
        strict: bool = True,
    ) -> bool:
        """Load a checkpoint: the whole training state, or only the model's weights.

        Args:
            path: A checkpoint file; it must exist and load.
            auto_resume: With no ``path``, use the newest checkpoint in ``ckpt_dir`` that loads,
                ``latest.txt``'s first. One that fails to load is skipped with a warning; if none
                loads, this raises rather than start from scratch.
            resume: Restore everything (optimizer, LR schedule, GradScaler, progress, RNG,
                metrics, hooks) to continue the run exactly. False loads the model's weights only,
                for fine-tuning or evaluation.
            strict: The model's keys and shapes must match the checkpoint's. False loads the
                weights that match and logs what it skipped (fine-tuning a changed head, say).

        Returns:
            Whether a checkpoint was loaded.

        Example::

            trainer.load_checkpoint("pretrained.pth", resume=False, strict=False)
        """
        self.wait_for_checkpoint()  # a write in flight may be the newest checkpoint
        if path is None:
            if not auto_resume:
                raise ValueError("Pass a checkpoint path, or auto_resume=True to use the latest.")
            found = self._load_newest_checkpoint()
            if found is None:
                logger.info(f"No checkpoint in {self.ckpt_dir}: training from scratch.")
                return False
            path, data = found
        else:
            data = load_checkpoint_file(path)
            _check_keys(data, path, _RESUME_KEYS if resume else ("model",))
        self._load_model(data["model"], path, strict)
        if not resume:
            logger.info(f"Loaded model weights from {path}; the training state is not restored.")
            return True
        self._check_config(data["config"], path)
        position = self._resume_position(data["progress"], path)
        self._load_optimizer(data["optimizer"], path)
        self.lr_scheduler.load_state_dict(data["lr_scheduler"])
        self._scaler.load_state_dict(data["grad_scaler"])
        self._storage.load_state_dict(data["metric_storage"])
        self._pending.clear()
        hooks = self._checkpointable_hooks()
        for key, state in data["hooks"].items():
            if key in hooks:
                hooks[key].load_state_dict(state)
            else:
                logger.warning(f"Checkpoint has state for hook {key!r}, which is not registered.")
        rng = _rng_of_this_rank(data["rng"], path)
        set_rng_state(rng["now"], self._data_generators())
        self._epoch_rng = rng["epoch_start"]
        self._position = position
        self._saved = (position, data["progress"].get("stopped", False))
        # A checkpoint from an epoch's last iteration (a preemption there) resumes with the
        # epoch's end: the next pass starts fresh, nothing to skip.
        inner = position[1]
        self._batches_to_skip = inner * self.accumulation_steps if inner < self.epoch_len else 0
        self._data_iter = None
        self.start_iter = min(
            self.max_iters, self._position[0] * self.epoch_len + self._position[1]
        )
        self.cur_iter = self.start_iter - 1
        logger.info(f"Resumed from checkpoint {path} at iteration {self.start_iter}.")
        return True

    def _load_newest_checkpoint(self) -> Optional[tuple[str, dict[str, Any]]]:
        failures = []
        for path in list_checkpoints(self.ckpt_dir):
            try:
                data = load_checkpoint_file(path)
                _check_keys(data, path, _RESUME_KEYS)
            except RuntimeError as e:
                logger.warning(f"Skipping a checkpoint that does not load: {e}")
                failures.append(str(e))
                continue
            if failures:
                logger.warning(f"Resuming from {path}, the newest checkpoint that loads.")
            return path, data
        if failures:
            raise RuntimeError(
                f"None of the {len(failures)} checkpoints in {self.ckpt_dir} loads:\n"
                + "\n".join(failures)
                + "\nMove them out of the folder to start afresh, or pass "
                "resume_from_checkpoint= a good file."
            )
        return None

    def _load_model(self, state: dict[str, Any], path: str, strict: bool) -> None:
        # weights saved from a torch.compile-d model by other means carry its prefix
        state = {k.replace("_orig_mod.", ""): v for k, v in state.items()}
        own = self.model_or_module.state_dict()
        shape = {k: getattr(v, "shape", None) for k, v in own.items()}
        wrong_shape = [
            k for k in own if k in state and getattr(state[k], "shape", None) != shape[k]
        ]
        problems = "".join(
            f"\n  {title}: {', '.join(keys)}"
            for title, keys in [
                ("missing from the checkpoint", [k for k in own if k not in state]),
                ("not in the model", [k for k in state if k not in own]),
                (
                    "shapes differ",
                    [f"{k} {tuple(state[k].shape)} vs {tuple(shape[k])}" for k in wrong_shape],
                ),
            ]
            if keys
        )
        if problems and strict:
            raise RuntimeError(
                f"Checkpoint {path!r} does not match the model:{problems}\nTo load only the "
                "weights that match (fine-tuning), call load_checkpoint(path, resume=False, "
                "strict=False)."
            )
        if problems:
            logger.warning(f"Loading {path} with strict=False skipped:{problems}")
            state = {k: v for k, v in state.items() if k in own and k not in wrong_shape}
        if self._sharded:
            load_full_model_state(self.model, state, strict)
        else:
            self.model_or_module.load_state_dict(state, strict=strict)

    def _load_optimizer(self, state: dict[str, Any], path: str) -> None:
        # Checkpoints of sharded models key the optimizer state by parameter name.
        if keyed_by_name(state):
            load_full_optimizer_state(self.model_or_module, self.optimizer, state)
        elif self._sharded:
            raise RuntimeError(
                f"Checkpoint {path!r} was saved by a model that was not sharded; this one is "
                "(fully_shard), and the optimizer state cannot be mapped. Resume it without "
                "sharding, or load the weights alone: load_checkpoint(path, resume=False)."
            )
        else:
            self.optimizer.load_state_dict(state)

    def _config(self) -> dict[str, Any]:
        amp = str(self.amp_dtype).replace("torch.", "") if self.enable_amp else "off"
        return {"amp": amp, "accumulation_steps": self.accumulation_steps}

    def _check_config(self, saved: dict[str, Any], path: str) -> None:
        now = self._config()
        if saved["accumulation_steps"] != now["accumulation_steps"]:
            raise ValueError(
                f"Checkpoint {path!r} was trained with accumulation_steps="
                f"{saved['accumulation_steps']}, this trainer has {now['accumulation_steps']}; "
                "the data position cannot be mapped. Resume with the same accumulation_steps."
            )
        if saved["amp"] != now["amp"]:
            logger.warning(
                f"Checkpoint {path} was trained with AMP {saved['amp']}, this run uses AMP "
                f"{now['amp']}: training goes on, but not bit for bit as the original run would."
            )

    def _resume_position(self, progress: dict[str, Any], path: str) -> tuple[int, int]:
        """Where to go on from: (epoch, iterations done in it). When the number of processes or
        the batch size changed, the iterations done are mapped by the samples they consumed."""
        epoch, inner, epoch_len = progress["epoch"], progress["inner_iter"], progress["epoch_len"]
        saved = (progress.get("world_size", get_world_size()), progress.get("batch_size"))
        now = (get_world_size(), self._batch_size)
        if saved == now or "world_size" not in progress:  # the latter: an older checkpoint
            if epoch_len != self.epoch_len:
                raise ValueError(
                    f"Checkpoint {path!r} was saved with {epoch_len} iterations per epoch, this "
                    f"trainer has {self.epoch_len}; resume with the same data loader."
                )
            return epoch, inner
        how = f"{saved[0]} processes x batches of {saved[1]} to {now[0]} x {now[1]}"
        if inner in (0, epoch_len):  # between epochs: nothing to map
            new_inner = 0 if inner == 0 else self.epoch_len
            logger.warning(
                f"Resuming {path} with {how}, at the {'start' if inner == 0 else 'end'} of "
                f"epoch {epoch}: the data position needs no mapping."
            )
            return epoch, new_inner
        samples = [w * b * self.accumulation_steps if b else None for w, b in (saved, now)]
        consumed = inner * samples[0] if samples[0] else None
        if consumed is None or samples[1] is None or consumed % samples[1]:
            raise RuntimeError(
                f"Checkpoint {path!r} stopped in the middle of epoch {epoch} ({inner} of "
                f"{epoch_len} iterations, {consumed or 'an unknown number of'} samples), and "
                f"this run changes from {how}: {samples[1] or 'an unknown number of'} samples "
                "per iteration cannot continue at that sample. Resume with the same number of "
                "processes and batch size, pick a batch size whose iterations divide the "
                "samples consumed, or resume from a checkpoint saved at an epoch's end."
            )
        new_inner = min(consumed // samples[1], self.epoch_len)
        logger.warning(
            f"Resuming {path} with {how}: epoch {epoch} stopped after {inner} iterations = "
            f"{consumed} samples, so this run goes on from iteration {new_inner} of "
            f"{self.epoch_len} of that epoch. With a DistributedSampler (its order depends "
            "on seed and epoch only) these are exactly the samples not yet seen; the LR "
            "schedule goes on from its saved step."
        )
        return epoch, new_inner

    def _checkpointable_hooks(self) -> dict[str, HookBase]:
        keys: dict[str, HookBase] = {}
        for h in self._hooks:
            if h.checkpointable:
                name = type(h).__name__
                key, n = name, 1
                while key in keys:
                    key, n = f"{name}_{n}", n + 1
                keys[key] = h
        return keys


# --------------------------------------------------------------------------------------------
# Validation at the boundary


def _check_types(model, optimizer, lr_scheduler, data_loader) -> None:
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


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")


def _check_epochs_or_iters(max_epochs: Any, max_iters: Any) -> None:
    for name, value in (("max_epochs", max_epochs), ("max_iters", max_iters)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}.")
    if (max_epochs > 0) == (max_iters > 0):
        raise ValueError(
            "Pass exactly one of max_epochs or max_iters "
            f"(got max_epochs={max_epochs}, max_iters={max_iters})."
        )


def _wrappers(model: nn.Module) -> Iterator[nn.Module]:
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


def _overrides(hook: HookBase, event: str) -> bool:
    method = getattr(hook, event)
    return getattr(method, "__func__", None) is not getattr(HookBase, event)


def _rng_of_this_rank(per_rank: list[dict[str, Any]], path: str) -> dict[str, Any]:
    rank, world_size = get_rank(), get_world_size()
    if len(per_rank) != world_size:
        logger.warning(
            f"Checkpoint {path} was saved by {len(per_rank)} ranks, resuming with {world_size}: "
            f"rank {rank} takes the RNG state of rank {rank % len(per_rank)}, so the run goes on "
            "but not bit for bit as before."
        )
    return per_rank[rank % len(per_rank)]


def _check_keys(data: dict[str, Any], path: str, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise RuntimeError(
            f"Checkpoint {path!r} lacks {missing}: it was not written by trainer.save_checkpoint. "
            "For weights alone, use load_checkpoint(path, resume=False)."
        )


def _check_epoch_len(data_loader: Any, accumulation_steps: int) -> int:
    try:
        num_batches = len(data_loader)
    except TypeError:
        raise TypeError(
            "data_loader must have a length (a map-style dataset, or an IterableDataset with "
            "__len__), so that epochs and the ETA are defined."
        ) from None
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


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    raise ValueError("model has no parameters to train.")


def _make_writable_dir(path: str) -> None:
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


def _to_host(values: list[Any]) -> list[float]:
    """Numbers and scalar tensors as floats, the tensors copied to the host together."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if tensors:
        device = tensors[0].device
        copied = iter(torch.stack([t.to(device) for t in tensors]).float().cpu().tolist())
    return [next(copied) if isinstance(v, torch.Tensor) else float(v) for v in values]


def _to_tensor(values: list[Any], device: torch.device) -> torch.Tensor:
    """Numbers and scalar tensors as one float64 tensor on ``device``, without a sync."""
    if any(isinstance(v, torch.Tensor) for v in values):
        as_tensors = [v if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for v in values]
        return torch.stack([t.to(device, torch.float64) for t in as_tensors])
    return torch.tensor([float(v) for v in values], dtype=torch.float64).to(device)


def _total_loss(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to back-propagate, and the detached losses to log (``total_loss`` among them)."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:  # the common case, kept short
        return out, {"total_loss": out.detach()}
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
    first, *rest = losses.values()
    total = sum(rest, first)  # not sum(values): 0 + loss would cost an extra op
    logged = {name: value.detach() for name, value in losses.items()}
    logged["total_loss"] = total.detach()
    return total, logged


_NO_OP = contextlib.nullcontext()  # reusable: entering it does nothing


def _no_op() -> contextlib.nullcontext:
    return _NO_OP
