"""The :class:`Trainer`: the loop, the step's public building blocks, and the hooks around them.
What it holds (progress, metrics, checkpoints, hooks) lives in the modules beside it."""

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader

from . import arguments as args
from . import logger as trainer_logging
from .checkpoint import Checkpointer
from .cuda_graph import GraphedStep, check_graphable
from .data import data_stream
from .distributed import (
    CpuGroup,
    get_rank,
    get_world_size,
    is_main_process,
    is_sharded,
    raise_on_every_rank,
)
from .evaluation import evaluate, rank_0_buffers
from .fsdp import local_value, no_gradient_sync
from .hooks import (
    CheckpointHook,
    DistributedHook,
    HookBase,
    LoggerHook,
    LRUpdateHook,
    ProgressBarHook,
)
from .hooks.registry import HookRegistry
from .logger import TRACEBACK_FOLLOWS, ensure_console_logging, log_to_file, rank_log_file
from .lr_scheduler import LRWarmupScheduler, param_group_lrs
from .metric_storage import MetricStorage
from .misc import WorkDirLock, collect_env, unwrapped, wrappers
from .preemption import WRITE_FAILED, Interrupt, Preemption
from .progress import Progress

logger = logging.getLogger(__name__)

# The default hooks' classes, of which a trainer has one at most, and what a second one would do.
_ONE_OF_EACH = {
    DistributedHook: "set the samplers' epoch twice",
    LRUpdateHook: "step the LR schedule twice",
    CheckpointHook: "save on its own schedule, each hook pruning only its own files",
    LoggerHook: "write every row twice",
}
_NO_OP = contextlib.nullcontext()  # reusable: entering it does nothing
_NO_METRICS: dict[str, Any] = {}  # no extra metrics (never modified)


class Trainer:
    """Trains a model that returns its loss; hooks do everything around the loop.

    Each iteration fetches ``accumulation_steps`` batches, runs ``model(batch)`` (or
    ``model(**batch)``), which returns a scalar loss or a dict of them, back-propagates their sum
    and steps the optimizer. The default hooks update the LR, save checkpoints under
    ``work_dir/checkpoints`` and log to the console, ``log.txt``, TensorBoard and
    ``metrics.jsonl``. Override :meth:`train_one_iter` for anything fancier: the public methods
    it uses keep every feature. SIGTERM or SIGUSR1 saves after the current iteration and exits
    with status 128 + the signal number.

    Args:
        model: Returns a scalar loss tensor or a dict of them; it moves the batch to its device.
        optimizer: The optimizer of ``model``'s parameters.
        lr_scheduler: A ``torch.optim.lr_scheduler`` scheduler, an :class:`LRWarmupScheduler`,
            or None for a constant LR.
        data_loader: Any iterable of batches; one without a length needs ``max_iters``.
        max_epochs: Train this many epochs (pass exactly one of ``max_epochs``, ``max_iters``).
        max_iters: Train this many iterations, crossing data-loader passes as needed.
        work_dir: Where checkpoints and logs go.
        unpack_batch_dict: Call ``model(**batch)`` instead of ``model(batch)``.
        max_num_checkpoints: Keep the newest N periodic checkpoints; None keeps all.
        checkpoint_period: Save every N epochs and at the end; 0: no ``CheckpointHook``.
        log_period: Turn device metrics into numbers and log them every N iterations.
        clip_grad_norm: Clip the gradient norm to this value; 0 disables clipping.
        enable_amp: Mixed precision: True picks float16 (with a GradScaler) on CUDA and bfloat16
            on CPU; ``torch.float16`` or ``torch.bfloat16`` picks that dtype.
        accumulation_steps: Micro-batches whose gradients are summed per optimizer step.
        by_epoch: Step ``lr_scheduler`` once per epoch (True) or once per iteration.
        warmup_t: The warmup's length in iterations (epochs with ``warmup_by_epoch``); 0: none.
        warmup_by_epoch: Count ``warmup_t`` in epochs.
        warmup_mode: ``"fix"``, ``"factor"`` or ``"auto"`` (see :class:`LRWarmupScheduler`).
        warmup_init_lr: The first LR of ``"fix"`` warmup.
        warmup_factor: The starting factor of ``"factor"`` and ``"auto"`` warmup.
        cuda_graph: Capture the whole step in a CUDA graph after 3 eager iterations.
        preempt_check_period: Under torchrun, the ranks share caught preemption signals every N
            iterations.

    Example::

        >>> import tempfile, torch
        >>> class Regressor(torch.nn.Linear):  # returns its loss
        ...     def forward(self, batch):
        ...         return torch.nn.functional.mse_loss(super().forward(batch[0]), batch[1])
        >>> data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        >>> model = Regressor(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> loader = torch.utils.data.DataLoader(data, batch_size=8)
        >>> trainer = Trainer(model, optimizer, None, loader, max_epochs=2,
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
        work_dir: Union[str, os.PathLike] = "work_dir",
        unpack_batch_dict: bool = False,
        max_num_checkpoints: Optional[int] = 3,
        checkpoint_period: int = 1,
        log_period: int = 50,
        clip_grad_norm: float = 0.0,
        enable_amp: Union[bool, torch.dtype] = False,
        accumulation_steps: int = 1,
        by_epoch: bool = True,
        warmup_t: int = 0,
        warmup_by_epoch: bool = False,
        warmup_mode: str = "fix",
        warmup_init_lr: float = 0.0,
        warmup_factor: float = 0.0,
        cuda_graph: bool = False,
        preempt_check_period: int = 10,
    ) -> None:
        settings = {name: value for name, value in locals().items() if name != "self"}  # as given
        built_in_step = type(self).train_one_iter is Trainer.train_one_iter
        self.epoch_len = args.check_arguments(settings, built_in_step)
        self.model, self.optimizer, self.data_loader = model, optimizer, data_loader
        # absolute now: a chdir before train() must not split the outputs across two folders
        self.work_dir = os.path.abspath(work_dir)
        self.accumulation_steps, self.log_period = accumulation_steps, log_period
        self.train_by_epoch = max_epochs > 0
        # None: a data loader without a length has passes of unknown length
        self.max_epochs = max_epochs or (self.epoch_len and math.ceil(max_iters / self.epoch_len))
        self.max_iters = max_iters or max_epochs * self.epoch_len
        self.lr_scheduler = lr_scheduler if isinstance(lr_scheduler, LRWarmupScheduler) else (
            LRWarmupScheduler(lr_scheduler, by_epoch, self.epoch_len, warmup_t, warmup_by_epoch,
                              warmup_mode, warmup_init_lr, warmup_factor, optimizer=optimizer)
        )  # fmt: skip
        self._unpack_batch_dict, self._clip_grad_norm = unpack_batch_dict, clip_grad_norm
        amp_dtype = self._set_up_step(enable_amp, cuda_graph)
        self._set_up_parts(preempt_check_period, amp_dtype)
        #: The run's settings as plain data (``work_dir/run.json``, TensorBoard).
        self.run_config = args.run_config(self, settings, amp_dtype)
        args.make_writable_dir(self.ckpt_dir)
        # the default hooks; replace one to configure it (see docs/arguments.md)
        self.register_hooks([
            DistributedHook(),
            LRUpdateHook(),
            CheckpointHook(checkpoint_period, max_num_checkpoints) if checkpoint_period else None,
            LoggerHook(log_period),
            ProgressBarHook() if ProgressBarHook.wanted() else None,
        ])  # fmt: skip

    def _set_up_parts(self, preempt_check_period: int, amp_dtype: Optional[torch.dtype]) -> None:
        """Build what the trainer holds: where training is, the data passes, the hooks, the
        metrics, the preemption signals, the checkpoints, Ctrl-C and rank 0's lock on
        ``work_dir``."""
        self.progress = Progress(self.epoch_len, self.max_iters)
        self._cpu = CpuGroup()  # under torchrun, a gloo group of the trainer's while it trains
        self._lock = WorkDirLock(self.work_dir)  # rank 0's, while it trains
        self._data = data_stream(self.data_loader, self._cpu, sized=self.epoch_len is not None)
        self._hooks = HookRegistry(self, _ONE_OF_EACH)
        self._storage = MetricStorage(epoch_len=self.epoch_len, cpu=self._cpu)
        self._preemption = Preemption(preempt_check_period, self._cpu)
        amp = str(amp_dtype).replace("torch.", "") if amp_dtype else "off"
        self._checkpointer = Checkpointer(
            self.ckpt_dir,
            self.model,
            self.optimizer,
            self.progress,
            self._data,
            self._cpu,
            config={"amp": amp, "accumulation_steps": self.accumulation_steps},
            by_epoch=self.train_by_epoch,
            lr_scheduler=self.lr_scheduler,
            grad_scaler=self.grad_scaler,
            metric_storage=self._storage,
            hooks=self._hooks,
        )
        self._interrupt = Interrupt(self.progress, self._checkpointer.held)  # Ctrl-C
        self._period_start = (0.0, -1)  # (time, iteration before it) of the log period running

    def _set_up_step(
        self, enable_amp: Union[bool, torch.dtype], cuda_graph: bool
    ) -> Optional[torch.dtype]:
        """Set up what the step's building blocks use: autocast and the GradScaler (returns the
        AMP dtype, None without AMP), the DDP or FSDP2 wrapper, and a CUDA graph."""
        device = args.model_device(self.model)
        amp_dtype = enable_amp if isinstance(enable_amp, torch.dtype) else None
        if enable_amp is True:  # float16 needs a GradScaler, and is the fast one on GPUs
            amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        self._autocast = None
        if amp_dtype is not None:
            self._autocast = functools.partial(
                torch.autocast, device.type, amp_dtype, cache_enabled=not cuda_graph
            )
        # bfloat16 has float32's range: only float16 needs loss scaling
        self.grad_scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
        self._scaling = self.grad_scaler.is_enabled()
        # Whether the GradScaler skipped the last step: a device tensor with fused optimizers
        self._skipped: Union[bool, torch.Tensor] = False
        self._update_due = False  # the scaler stepped an optimizer since its last update
        # DDP (also under torch.compile) skips its gradient all-reduce with no_sync()
        self._ddp = next(
            (m for m in wrappers(self.model) if isinstance(m, DistributedDataParallel)), None
        )
        self._sharded_model = self.model if is_sharded(self.model) else None  # FSDP2's
        self._graphed_step: Optional[Callable[[list[Any]], Any]] = None
        if cuda_graph:
            check_graphable(self.model, self.optimizer, device, self._scaling)
            self._graphed_step = GraphedStep(self._forward_backward_step, self.optimizer, device)
        return amp_dtype

    # Where training is

    @property
    def cur_epoch(self) -> int:
        """The current (or last) epoch's index, from 0: the number shown is ``cur_epoch + 1``."""
        return self.progress.epoch

    @property
    def inner_iter(self) -> int:
        """The index of the current (or last finished) iteration within the epoch, from 0."""
        return self.progress.inner_iter

    @property
    def cur_iter(self) -> int:
        """The current (or last) iteration's index from 0 (-1 before any), shown as index + 1."""
        return self.progress.iter

    @property
    def start_iter(self) -> int:
        """The iterations done when this :meth:`train` started (or resumed)."""
        return self.progress.start_iter

    @property
    def lr(self) -> float:
        """The LR of the optimizer's first parameter group."""
        return self.optimizer.param_groups[0]["lr"]

    @property
    def model_or_module(self) -> nn.Module:
        """The model without its torch.compile and DDP / DataParallel wrappers."""
        return unwrapped(self.model)

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
        return rank_log_file(os.path.join(self.work_dir, "log.txt"), get_rank())

    @property
    def cpu_group(self) -> Any:
        """Under torchrun while :meth:`train` runs, the trainer's gloo group, for hooks' small
        CPU collectives; None otherwise."""
        return self._cpu.group

    # Hooks

    def register_hook(self, hook: HookBase) -> None:
        """Add a hook; hooks run by ascending ``priority``, ties in registration order. A second
        hook of a default hook's class is refused: replace the default one instead."""
        self._hooks.register(hook)

    def register_hooks(self, hooks: Sequence[Optional[HookBase]]) -> None:
        """Add several hooks; None entries are skipped."""
        for hook in hooks:
            if hook is not None:
                self.register_hook(hook)

    def unregister_hook(self, hook: Union[HookBase, type]) -> list[HookBase]:
        """Remove ``hook``, or every hook of that class; returns what was removed."""
        return self._hooks.unregister(hook)

    @property
    def hooks(self) -> HookRegistry:
        """The registered hooks in the order they run; ``hooks.call("after_eval", results)``
        fires an event, ``hooks.info()`` and ``hooks.seconds_by_class()`` describe them."""
        return self._hooks

    # Checkpoints

    @property
    def checkpointer(self) -> Checkpointer:
        """What checkpoints hold: ``checkpointer.register(name, obj)`` adds an extra optimizer,
        scheduler or module; ``name()``, ``last_path`` and ``wait()`` tell about the files."""
        return self._checkpointer

    def save_checkpoint(
        self, file_name: str, *, then: Optional[Callable[[], None]] = None
    ) -> Optional[str]:
        """Save the whole state as ``ckpt_dir/file_name``; see :meth:`Checkpointer.save`."""
        self._storage.flush(every_rank=True)  # so a non-finite loss raises before it is saved
        self._hooks.call("before_save_checkpoint")  # the logs it covers reach the disk first
        return self._checkpointer.save(file_name, then)

    def load_checkpoint(
        self,
        path: Optional[str] = None,
        auto_resume: bool = False,
        *,
        resume: bool = True,
        strict: bool = True,
        revise_keys: Optional[Sequence[tuple[str, str]]] = None,
    ) -> bool:
        """Load the whole state (``resume``) or the weights alone from ``path``, or with
        ``auto_resume`` from the newest checkpoint that loads; see :meth:`Checkpointer.load`."""
        return self._checkpointer.load(path, auto_resume, resume, strict, revise_keys)

    # The loop

    def train(
        self,
        resume_from_checkpoint: Optional[str] = None,
        auto_resume: bool = True,
        continue_after_stop: bool = False,
    ) -> None:
        """Train, first resuming from ``resume_from_checkpoint`` or (``auto_resume``) from
        ``work_dir``'s latest checkpoint. A run that :meth:`stop` ended stays stopped unless
        ``continue_after_stop``."""
        ensure_console_logging("trainer", get_rank())
        with self._session():
            self._agree_at_start()
            self._start(resume_from_checkpoint, auto_resume, continue_after_stop)
            try:
                self._hooks.call("before_train")
                self._period_start = (time.perf_counter(), self.cur_iter)
                with self._watch_skipped_steps():
                    while not self.progress.finished and self._train_epoch():
                        pass
                self._storage.flush(every_rank=True)  # what was logged after the last log point
                if self.progress.stopped and not self.progress.is_saved:
                    self.save_checkpoint(self._checkpointer.name())  # a rerun stays stopped
            except KeyboardInterrupt:  # the session logs one line and exits with status 130
                self._after_failure()
                raise
            except Exception as e:
                self.progress.failed = True  # progress.outcome, for the hooks' after_train
                self._after_failure()
                # the traceback in this rank's log file; on the console Python prints it, once
                where = "as it started"
                if self.cur_iter >= self.start_iter:
                    where = f"in iteration {self.cur_iter + 1} of {self.max_iters}"
                with self._checkpointer.held() as (last, writing):  # rank 0 writes: it knows
                    if is_main_process():
                        being = f", {writing} being written" if writing else ""
                        where += f" (last checkpoint on disk: {last or 'none'}{being})"
                    failed = f"Training failed {where}: {type(e).__name__}: {e}"
                    logger.exception(failed, extra={TRACEBACK_FOLLOWS: True})
                raise
            finally:  # the last checkpoint is on disk when after_train runs and train() ends
                with self._checkpointer.on_disk():
                    self._hooks.call("after_train", every_handler=True)

    def _after_failure(self) -> None:
        """Erase the progress bar's line, release the loader's workers, and put this rank's
        values logged since the last log point in the storage (no collective). A failure may
        leave no file descriptor to import with: nothing here needs an import to succeed."""
        if trainer_logging.live_line is not None:  # a progress bar is drawing
            trainer_logging.live_line.erase()
        self._data.release()
        # A NaN loss among them is kept up to it: the error in flight says the rest.
        try:
            self._storage.flush()
        except FloatingPointError:
            pass

    def _train_epoch(self) -> bool:
        """Run (the rest of) the position's epoch; whether training goes on."""
        progress, data, hooks = self.progress, self._data, self._hooks
        preemption, writer, interrupt = self._preemption, self._checkpointer.writer, self._interrupt
        start = progress.begin_epoch(progress.position[0])
        self._hooks.call("before_epoch")
        if not self.model.training:  # an evaluation left it in eval mode (train() walks modules)
            self.model.train()
        for inner_iter in range(start, progress.epoch_iters):
            if not data.sized and not data.has_next(self.accumulation_steps):
                break
            it = progress.epoch_start + inner_iter
            progress.inner_iter, progress.iter = inner_iter, it
            if hooks.any_before_iter:  # most runs have none: not even a call
                hooks.call("before_iter")
            self.train_one_iter()
            progress.position = (progress.epoch, inner_iter + 1)  # a checkpoint goes on here
            if self._update_due:  # an override stepped the GradScaler: update it once
                self.update_scaler()
            if (it + 1) % self.log_period == 0 or it == self.max_iters - 1:
                self._log_point(it)
            if it >= hooks.after_iter_due:  # periodic hooks wait for their iteration
                hooks.call_after_iter(it, self.max_iters)
            if progress.stopped:
                break
            # flags in one process; under torchrun the ranks' periodic agreement
            if preemption.caught or writer.failed or preemption.distributed or interrupt.put_off:
                self._stop_if_agreed()
        if progress.position[1] < progress.epoch_iters and not data.pass_ended:
            return False  # stop() in mid-epoch
        data.end_pass()
        progress.end_epoch()
        self._storage.flush(every_rank=True)  # for the epoch's hooks (no sync if just logged)
        self._hooks.call("after_epoch")
        return not progress.stopped

    def _stop_if_agreed(self) -> None:
        """Save and exit for a preemption signal, or raise a failed checkpoint write, once every
        rank knows of it (see :class:`Preemption`); stop for a Ctrl-C put off."""
        if self._interrupt.put_off:  # it came while a thread was joined (see Interrupt)
            raise KeyboardInterrupt
        it = self.progress.iter
        signum = self._preemption.agreed_signal(it, self._checkpointer.writer.failed)
        if signum == WRITE_FAILED:  # surfaced now, not at the next save
            self._checkpointer.raise_write_error()
        if signum and it < self.max_iters - 1:
            path = self.save_checkpoint(self._checkpointer.name())
            self._checkpointer.wait()
            self._preemption.exit(signum, path, it + 1)

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        """What :meth:`train` holds: rank 0's lock on ``work_dir``, this rank's log file, Ctrl-C
        (its line goes there), the gloo group, and the preemption signals (caught from the
        start)."""
        with contextlib.ExitStack() as stack:
            if is_main_process():
                stack.enter_context(self._lock.held())
            stack.enter_context(log_to_file("trainer", self.log_file))
            stack.enter_context(self._interrupt.catching())
            stack.enter_context(self._cpu.open())
            stack.enter_context(self._checkpointer.writing())
            stack.enter_context(self._preemption.catching())
            yield

    def _agree_at_start(self) -> None:
        """Refuse, on every rank at once, to train where another run holds ``work_dir`` or the
        ranks' data loaders differ in length (they would hang in mismatched collectives)."""
        problem = self._lock.problem if is_main_process() else None
        lengths = raise_on_every_rank(
            problem and RuntimeError(problem), self.epoch_len, self._cpu.group
        )
        if len(set(lengths)) > 1:
            each = ", ".join(
                f"rank {rank} {'a stream' if n is None else f'{n} iterations'}"
                for rank, n in enumerate(lengths)
            )
            raise RuntimeError(
                f"The ranks' data loaders differ in length per epoch ({each}), so the ranks would "
                "disagree on when epochs and training end. Give every rank as many batches: a "
                "DistributedSampler does (drop_last=True on the loader, or an equal split)."
            )

    def _start(self, path: Optional[str], auto_resume: bool, continue_after_stop: bool) -> None:
        self._hooks.start()  # this run's hook times, and which events each hook handles
        self.progress.data_seconds, self.progress.failed = 0.0, False  # this train()'s
        logger.info(f"Environment:\n{collect_env()}")
        logger.info(f"Hooks: {self._hooks.info()}")
        args.warn_unoptimized(self.model_or_module, self._checkpointer.optimizers)
        if self.epoch_len is None:  # a stream: say what counts in epochs, which end with it
            args.warn_stream_epochs(self.lr_scheduler, self.hooks)
        self._checkpointer.remove_temp_files()
        # Trained by an earlier train() since built or resumed, or to the end: the model and
        # optimizer hold that state, which only a checkpoint can replace.
        trained = self.start_iter < self.cur_iter + 1 or self.cur_iter + 1 >= self.max_iters
        if (path is not None or auto_resume) and self.load_checkpoint(path, auto_resume):
            trained = False
        if trained:
            done = f"iteration {self.cur_iter + 1} of {self.max_iters}"
            why = "so train(auto_resume=False) cannot start afresh"
            if auto_resume:
                why = f"and {self.ckpt_dir} holds no checkpoint to resume from"
            if self.cur_iter + 1 >= self.max_iters:
                raise RuntimeError(
                    f"This Trainer has trained to the end already ({done}): its model and "
                    f"optimizer hold that state, {why}, and there is nothing left to train. To "
                    "train again from scratch, build a new model, optimizer and Trainer; to train "
                    "longer, build the Trainer with a larger max_epochs or max_iters."
                )
            go_on = "" if auto_resume else "To go on from the last checkpoint, call train(). "
            raise RuntimeError(
                f"This Trainer has trained up to {done} in an earlier train(): its model and "
                f"optimizer hold that state, {why}. {go_on}To train again from scratch, build a "
                "new model, optimizer and Trainer."
            )
        if self.progress.stay_stopped(continue_after_stop):  # (LoggerHook tells other starts)
            ended = f"The run was ended by stop() after iteration {self.start_iter}"
            logger.info(f"{ended}: not training on. Pass train(continue_after_stop=True) to go on.")

    def _log_point(self, it: int) -> None:
        """Every ``log_period`` iterations and at the last: the period's times per iteration,
        the LR, and the flush."""
        start, before = self._period_start
        now, n = time.perf_counter(), it - before
        times = {"data_time": self._data.data_time / n, "iter_time": (now - start) / n}
        self.progress.data_seconds += self._data.data_time
        self._data.data_time, self._period_start = 0.0, (now, it)
        # the period's own means, not smoothed: a logged time says what this period took
        self._storage.add(it, times, smooth=False, reduce=True)
        # each group's LR this iteration used (LRUpdateHook changes it after the iteration)
        self._storage.add(it, param_group_lrs(self.optimizer), smooth=False)
        self._storage.flush(every_rank=True)
        self.progress.last_log_iter = it  # what hooks ask: is this iteration a log point

    def stop(self) -> None:
        """End training after this iteration (or epoch): the remaining hooks run, then
        ``after_train``, and a checkpoint remembers the stop. Under torchrun, call it on every
        rank at the same iteration."""
        if not self.progress.stopped:
            logger.info(f"Stopping after iteration {self.cur_iter + 1}, as stop() asked.")
        self.progress.stopped = True

    def evaluate(
        self, data_loader: Any, metric_fn: Callable[[nn.Module, Any], dict[str, torch.Tensor]]
    ) -> dict[str, float]:
        """The mean of ``metric_fn(model, batch)``'s per-sample values (``{name: tensor of
        shape [batch]}``) over every sample of ``data_loader``, each counted once, in eval mode
        without autograd. Under torchrun every rank gets the numbers one process would;
        docs/evaluation.md has an example.
        """
        model = self.model_or_module if self._ddp is not None else self.model
        with contextlib.ExitStack() as stack:
            if self._cpu.group is None:  # outside train(): a group for this evaluation
                stack.enter_context(self._cpu.open())
            if self._ddp is not None and get_world_size() > 1:  # what DDP's forward would use
                stack.enter_context(rank_0_buffers(model, self._ddp.process_group))
            return evaluate(model, data_loader, metric_fn, self._cpu.group)

    # Metrics

    @property
    def metric_storage(self) -> MetricStorage:
        """The metrics as of the last log point (or epoch end, or save), reduced over ranks
        under torchrun; reading it costs nothing."""
        return self._storage

    def log(
        self,
        iter: int,
        smooth: bool = True,
        *,
        reduce: bool = False,
        check_finite: bool = False,
        **metrics: Union[float, torch.Tensor],
    ) -> None:
        """Record ``metrics`` (numbers or one-element tensors) of iteration ``iter``, shown as
        their window mean (``smooth``) or latest value. Tensors, and what is ``reduce``-d
        (averaged over ranks) or ``check_finite`` (a NaN raises), wait on their device for the
        next log point; a rank's own numbers go in at once."""
        self._storage.add(iter, metrics, smooth, check_finite, reduce)

    def log_losses(self, **losses: torch.Tensor) -> None:
        """Record losses of the current iteration as the built-in step does: NaN-checked at the
        next log point and averaged over ranks."""
        self._storage.add(self.progress.iter, losses, check_finite=True, reduce=True)

    # The step, and the public building blocks it is made of

    def train_one_iter(self) -> None:
        """Fetch, forward, backward and step once; override it for anything fancier, with
        :meth:`next_batch`, :meth:`compute_losses`, :meth:`backward`, :meth:`clip_and_step` and
        :meth:`log_losses`."""
        # 1. fetch one batch per micro-step (a loop, not a comprehension: one call fewer)
        batches = [self.next_batch()]
        while len(batches) < self.accumulation_steps:
            batches.append(self.next_batch())
        # 2.-4. forward, backward, clip and step: one CUDA graph replay with cuda_graph=True
        losses, extras = (self._graphed_step or self._forward_backward_step)(batches)
        # 5. log, on the device until the next log point; a NaN gradient norm fails like a NaN
        # loss, unless float16's GradScaler skipped that step
        self.log_losses(**losses)
        if extras:
            self.log(self.cur_iter, reduce=True, check_finite=not self._scaling, **extras)

    def next_batch(self) -> Any:
        """The next batch of the current epoch's pass over the data loader."""
        return self._data.next_batch()

    def autocast(self) -> contextlib.AbstractContextManager:
        """A context for the forward pass: mixed precision with AMP on, else a no-op."""
        return _NO_OP if self._autocast is None else self._autocast()

    def no_gradient_sync(self, skip: bool = True) -> contextlib.AbstractContextManager:
        """A context for a micro-batch whose gradients stay local: DDP's ``no_sync``, FSDP2's
        ``set_requires_gradient_sync(False)``; a no-op when not ``skip`` or in one process."""
        if skip and self._ddp is not None:
            return self._ddp.no_sync()
        if skip and self._sharded_model is not None:
            return no_gradient_sync(self._sharded_model)
        return _NO_OP

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled by the GradScaler with float16 AMP."""
        (self.grad_scaler.scale(loss) if self._scaling else loss).backward()

    def clip_and_step(
        self, optimizer: Optional[Optimizer] = None, *, name: Optional[str] = None
    ) -> Optional[torch.Tensor]:
        """Unscale, clip (``clip_grad_norm``) and step through the GradScaler ``optimizer``: the
        trainer's, or one registered with ``checkpointer.register`` (else a ValueError). Returns
        the norm before clipping (a device tensor), or None without clipping, and logs it (no
        sync) as ``name``: ``grad_norm``, or ``grad_norm/<registered name>`` for another."""
        optimizer = self.optimizer if optimizer is None else optimizer
        default = "grad_norm"
        if optimizer is not self.optimizer:  # in the checkpoints, so that it resumes exactly
            default = f"grad_norm/{self._checkpointer.name_of(optimizer)}"
        norm = self._clip_and_step(optimizer)
        if norm is not None:  # on the device until the next log point: no sync
            metric = {name or default: norm}
            self.log(self.cur_iter, reduce=True, check_finite=not self._scaling, **metric)
        return norm

    def _clip_and_step(self, optimizer: Optimizer) -> Optional[torch.Tensor]:
        # (the built-in step logs the norm it returns: a CUDA graph replays what is in here)
        norm = None
        if self._clip_grad_norm > 0:
            self.grad_scaler.unscale_(optimizer)  # first, so the threshold means what it says
            params = [p for group in optimizer.param_groups for p in group["params"]]
            norm = nn.utils.clip_grad_norm_(params, self._clip_grad_norm).detach()
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
        """Adjust the float16 loss scale once per iteration, after every optimizer stepped (and
        between two steps of one optimizer); the trainer does it after ``train_one_iter`` if the
        iteration did not."""
        if self._update_due:
            self.grad_scaler.update()
            self._update_due = False

    def compute_losses(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the model on ``batch`` under :meth:`autocast`; returns the loss to back-propagate
        and the detached losses to log, ``total_loss`` among them."""
        model, unpack = self.model, self._unpack_batch_dict
        if self._autocast is None:  # no AMP: not even a null context, this runs every step
            out = model(**batch) if unpack else model(batch)
        else:
            with self._autocast():
                out = model(**batch) if unpack else model(batch)
        if isinstance(out, torch.Tensor) and out.dim() == 0:  # the common case, kept short
            return out, {"total_loss": out.detach()}
        return _total_loss(out)  # a dict of losses (or an error)

    def _forward_backward_step(
        self, batches: list[Any], set_to_none: bool = True
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The built-in step on ``batches`` (one per micro-step): forward, backward, clip and
        step; returns the losses and the other metrics as device tensors."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if len(batches) == 1:
            loss, losses = self.compute_losses(batches[0])  # 2. forward under autocast
            self.backward(loss)  # 3. backward
        else:
            losses = self._accumulate(batches)  # 2. and 3. per micro-batch
        # 4. clip and step; float16 steps with inf or NaN gradients are skipped
        grad_norm = self._clip_and_step(self.optimizer)
        if not self._scaling and grad_norm is None:
            return losses, _NO_METRICS  # the plain configuration: no other metric
        self.update_scaler()  # here, not after the iteration: a CUDA graph replays it
        extras: dict[str, Any] = {}
        if grad_norm is not None:
            extras["grad_norm"] = grad_norm
        if self._scaling:
            extras["amp_skipped_steps"] = self._skipped
        return losses, extras

    def _accumulate(self, batches: list[Any]) -> dict[str, torch.Tensor]:
        """Forward and backward each micro-batch, the loss divided by their number; the
        gradients of all but the last stay local. Returns the mean losses."""
        k = len(batches)
        total: dict[str, torch.Tensor] = {}
        for micro_step, batch in enumerate(batches):
            with self.no_gradient_sync(skip=micro_step < k - 1):
                loss, logged = self.compute_losses(batch)
                self.backward(loss / k)
            total = {n: total[n] + v for n, v in logged.items()} if micro_step else logged
        return {name: value / k for name, value in total.items()}

    @contextlib.contextmanager
    def _watch_skipped_steps(self) -> Iterator[None]:
        if not self._scaling:
            yield
            return
        # removed when training ends, so the optimizer never keeps the trainer alive
        handle = self.optimizer.register_step_post_hook(self._on_optimizer_step)
        try:
            yield
        finally:
            handle.remove()

    def _on_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        # GradScaler calls step() only for finite gradients, except with fused optimizers, which
        # it hands the inf flag as `found_inf`
        found_inf = getattr(optimizer, "found_inf", None)
        self._skipped = False if found_inf is None else found_inf


def _total_loss(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
