"""The [`Trainer`][]: the loop, the step's public building blocks, and the hooks around them.
What it holds (progress, metrics, checkpoints, hooks) lives in the modules beside it."""

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader

from . import arguments as args
from .checkpoint import Checkpointer
from .cuda_graph import GraphedStep, check_graphable
from .data import data_stream
from .distributed import CpuGroup, get_rank, get_world_size, is_main_process, raise_on_every_rank
from .evaluation import evaluate, rank_0_buffers
from .hooks import (
    CheckpointHook,
    DistributedHook,
    HookBase,
    LoggerHook,
    LRUpdateHook,
    ProgressBarHook,
    TimerHook,
)
from .hooks.registry import HookRegistry
from .logger import ensure_console_logging, log_to_file, rank_log_file
from .lr_scheduler import LRWarmupScheduler, check_steps, describe_steps
from .metric_storage import TRAINER_METRICS, MetricStorage
from .misc import WorkDirLock, collect_env, unwrapped
from .preemption import WRITE_FAILED, Interrupt, Preemption
from .progress import Progress
from .step import StepTools
from .writers import trainer_writes

logger = logging.getLogger(__name__)

# The default hooks' classes of which a trainer has one at most: a second would do its work twice
_ONE_OF_EACH = (DistributedHook, TimerHook, LRUpdateHook, CheckpointHook, LoggerHook)


class Trainer:
    """Trains a model that returns its loss; hooks do everything around the loop.

    Each iteration fetches ``accumulation_steps`` batches, runs ``model(batch)`` (or
    ``model(**batch)``), which returns a scalar loss, a dict of them or an output with a ``loss``
    (a Hugging Face ``ModelOutput``), back-propagates the total (see [`compute_losses`][]) and
    steps the optimizer. The default hooks update the LR, save checkpoints under
    ``work_dir/checkpoints`` and log to the console, ``log.txt``, TensorBoard and
    ``metrics.jsonl``. Override [`train_one_iter`][] for anything fancier: the public methods
    it uses keep every feature. SIGTERM or SIGUSR1 saves after the current iteration and exits
    with status 128 + the signal number.

    Args:
        model: Returns a scalar loss tensor, a dict of them or an output with a ``loss``; it
            moves the batch to its device.
        optimizer: The optimizer of ``model``'s parameters.
        lr_scheduler: A ``torch.optim.lr_scheduler`` scheduler, an [`LRWarmupScheduler`][],
            or None for a constant LR.
        data_loader: Any iterable of batches; one without a length needs ``max_iters``.
        max_epochs: Train this many epochs (pass exactly one of ``max_epochs``, ``max_iters``).
        max_iters: Train this many iterations, crossing data-loader passes as needed.
        work_dir: Where checkpoints and logs go (``~`` is the home folder, as in a shell).
        unpack_batch_dict: Call ``model(**batch)`` instead of ``model(batch)``.
        max_num_checkpoints: Keep the newest N periodic checkpoints; None keeps all.
        checkpoint_period: Save every N epochs and at the end; 0: no ``CheckpointHook``.
        log_period: Turn device metrics into numbers and log them every N iterations.
        clip_grad_norm: Clip the gradient norm to this value; 0 disables clipping.
        enable_amp: Mixed precision: True picks float16 (with a GradScaler) on CUDA and bfloat16
            on CPU; ``torch.float16`` or ``torch.bfloat16`` picks that dtype.
        accumulation_steps: Micro-batches whose gradients are summed per optimizer step.
        by_epoch: Step ``lr_scheduler`` once per epoch (True) or once per iteration; one whose
            horizon (``T_max``, ``total_steps``, ...) counts the other unit is refused.
        warmup_t: The warmup's length in iterations (epochs with ``warmup_by_epoch``); 0: none.
        warmup_by_epoch: Count ``warmup_t`` in epochs.
        warmup_mode: ``"fix"``, ``"factor"`` or ``"auto"`` (see [`LRWarmupScheduler`][]).
        warmup_init_lr: The first LR of ``"fix"`` warmup, >= 0.
        warmup_factor: The starting factor of ``"factor"`` and ``"auto"`` warmup, in [0, 1].
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
        self.model = model
        self.optimizer = optimizer
        self.data_loader = data_loader
        # absolute now: a chdir before train() must not split the outputs across two folders;
        # "~" is the home folder, as in a shell (not a folder named "~" in the current one)
        self.work_dir = os.path.abspath(os.path.expanduser(work_dir))
        self.accumulation_steps = accumulation_steps
        self.log_period = log_period
        self.train_by_epoch = max_epochs > 0
        # None: a data loader without a length has passes of unknown length
        self.max_epochs = max_epochs or (self.epoch_len and math.ceil(max_iters / self.epoch_len))
        self.max_iters = max_iters or max_epochs * self.epoch_len
        if not isinstance(lr_scheduler, LRWarmupScheduler):
            lr_scheduler = LRWarmupScheduler(
                lr_scheduler,
                by_epoch,
                self.epoch_len,
                warmup_t,
                warmup_by_epoch,
                warmup_mode,
                warmup_init_lr,
                warmup_factor,
                optimizer=optimizer,
            )
        # before it steps in a unit its horizon contradicts
        check_steps(lr_scheduler, self.max_epochs, self.max_iters, self.epoch_len)
        self.lr_scheduler = lr_scheduler
        self._unpack_batch_dict = unpack_batch_dict
        self._output_names: frozenset[str] = frozenset()  # what compute_losses checked last

        # What the step's building blocks share: autocast, the GradScaler, clipping, DDP/FSDP2
        device = args.model_device(model)
        self._step = StepTools(model, device, optimizer, enable_amp, clip_grad_norm, cuda_graph)
        self.grad_scaler = self._step.grad_scaler

        # Where training is, the data passes, the hooks, the metrics, the signals, the checkpoints
        self.progress = Progress(self.epoch_len, self.max_iters)
        self._cpu = CpuGroup()  # under torchrun, a gloo group of the trainer's while it trains
        self._lock = WorkDirLock(self.work_dir)  # rank 0's, while it trains
        self._data = data_stream(data_loader, self._cpu, sized=self.epoch_len is not None)
        self._hooks = HookRegistry(self, _ONE_OF_EACH)
        self._storage = MetricStorage(epoch_len=self.epoch_len, cpu=self._cpu)
        self._preemption = Preemption(preempt_check_period, self._cpu)
        self._checkpointer = Checkpointer(
            self.ckpt_dir,
            model,
            optimizer,
            self.progress,
            self._data,
            self._cpu,
            config={"amp": self._step.amp_name, "accumulation_steps": accumulation_steps},
            by_epoch=self.train_by_epoch,
            lr_scheduler=self.lr_scheduler,
            grad_scaler=self.grad_scaler,
            metric_storage=self._storage,
            hooks=self._hooks,
        )
        self._interrupt = Interrupt(self.progress, self._checkpointer.newest_on_disk)  # Ctrl-C
        if cuda_graph:  # the loop's train_one_iter replays a CUDA graph of the built-in one
            check_graphable(model, optimizer, device, self._step.scaling, built_in_step)
            self.train_one_iter = GraphedStep(  # type: ignore[method-assign]
                self.train_one_iter,
                self._step.update_scaler,
                self._data,
                self._storage,
                self.progress,
                optimizer,
                device,
                accumulation_steps,
            )
        #: The run's settings as plain data (``work_dir/run.json``, TensorBoard).
        self.run_config = args.run_config(self, settings, self._step.amp_dtype)
        args.make_writable_dir(self.ckpt_dir)
        # the default hooks; replace one to configure it (see docs/arguments.md)
        self.register_hooks(
            [
                DistributedHook(),
                TimerHook(),
                LRUpdateHook(),
                CheckpointHook(checkpoint_period, max_num_checkpoints)
                if checkpoint_period
                else None,
                LoggerHook(log_period),
                ProgressBarHook() if ProgressBarHook.wanted() else None,
            ]
        )

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
        """The iterations done when this [`train`][] started (or resumed)."""
        return self.progress.start_iter

    @property
    def lr(self) -> float:
        """The LR of the optimizer's first parameter group."""
        return self.optimizer.param_groups[0]["lr"]

    @property
    def data_seconds(self) -> float:
        """The seconds spent waiting for batches since the trainer was built."""
        return self._data.data_time

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
        """Under torchrun while [`train`][] runs, the trainer's gloo group, for hooks' small
        CPU collectives; None otherwise."""
        return self._cpu.group

    # Hooks

    def register_hook(self, hook: HookBase) -> None:
        """Add a hook; hooks run by ascending ``priority``, ties in registration order. A second
        ``DistributedHook``, ``TimerHook``, ``LRUpdateHook``, ``CheckpointHook`` or ``LoggerHook``
        is refused: replace the default one instead."""
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
        """What checkpoints hold: ``checkpointer.register(name, obj)`` adds anything with
        ``state_dict()`` and ``load_state_dict()`` (an extra optimizer, scheduler or module,
        state carried across iterations); ``name()``, ``last_path`` and ``wait()`` tell about
        the files."""
        return self._checkpointer

    def save_checkpoint(
        self, file_name: str, *, then: Optional[Callable[[], None]] = None
    ) -> Optional[str]:
        """Save the whole state as ``ckpt_dir/file_name``; see [`Checkpointer.save`][]."""
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
        ``auto_resume`` from the newest checkpoint that loads; see [`Checkpointer.load`][]."""
        return self._checkpointer.load(path, auto_resume, resume, strict, revise_keys)

    # The loop

    def train(
        self,
        resume_from_checkpoint: Optional[str] = None,
        auto_resume: bool = True,
        continue_after_stop: bool = False,
    ) -> None:
        """Train, first resuming from ``resume_from_checkpoint`` or (``auto_resume``) from
        ``work_dir``'s latest checkpoint. ``auto_resume=False`` starts afresh and moves the
        checkpoints there into ``checkpoints/previous/<date_time>/``. A run that [`stop`][]
        ended stays stopped unless ``continue_after_stop``."""
        progress = self.progress
        with self._session():
            self._start(resume_from_checkpoint, auto_resume, continue_after_stop)
            try:
                self._hooks.call("before_train")
                while not progress.finished:
                    progress.begin_epoch()
                    self._hooks.call("before_epoch")
                    for _ in self._iterations():  # the epoch's (a resumed one's: what is left)
                        self._hooks.call("before_iter")
                        self.train_one_iter()
                        self._step.update_scaler()  # float16: once every optimizer stepped
                        # a checkpoint taken from here on resumes after this iteration
                        progress.position = (progress.epoch, progress.inner_iter + 1)
                        self._hooks.call("after_iter")
                        self._act_on_signals()  # preempted: save and exit
                        if progress.stopped:
                            break
                    if self._end_epoch():  # False after a stop in mid-epoch
                        self._hooks.call("after_epoch")
                self._end_training()
            except BaseException as e:
                self._after_failure(e)
                raise
            finally:  # the last checkpoint is on disk when after_train runs and train() ends
                with self._checkpointer.on_disk():
                    self._hooks.call("after_train", every_handler=True)

    def _iterations(self) -> Iterator[int]:
        """The current epoch's iterations, from where it stands; each sets ``cur_iter``. A
        stream's epoch ends with its pass."""
        progress = self.progress
        if not self.model.training:  # an evaluation left it in eval mode (train() walks modules)
            self.model.train()
        for inner_iter in range(progress.position[1], progress.epoch_iters):
            if not self._data.has_next(self.accumulation_steps):
                return
            progress.inner_iter = inner_iter
            progress.iter = progress.epoch_start + inner_iter
            yield progress.iter

    def _end_epoch(self) -> bool:
        """End the epoch's pass over the data, unless a stop came before its end: whether it
        ended."""
        progress = self.progress
        if progress.position[1] < progress.epoch_iters and not self._data.pass_ended:
            return False  # stop() in mid-epoch: the next train() goes on from here
        # A pass that max_iters did not cut ends as a for loop's: to its end, where a sampler
        # with a generator of its own draws once more, which the next pass's order depends on
        left_over = None
        if progress.epoch_iters == self.epoch_len:
            left_over = len(self.data_loader) - self.epoch_len * self.accumulation_steps
        self._data.end_pass(left_over)
        progress.end_epoch()
        self._storage.flush(every_rank=True)  # for the epoch's hooks (no sync if just logged)
        return True

    def _end_training(self) -> None:
        """Take in what was logged since the last log point; a stop is saved so that a rerun
        stays stopped."""
        self._storage.flush(every_rank=True)
        if self.progress.stopped and not self.progress.is_saved:
            self.save_checkpoint(self._checkpointer.name())

    def _act_on_signals(self) -> None:
        """Act on what came during the iteration, once every rank knows of it: a preemption signal
        saves and exits, a failed checkpoint write raises, a Ctrl-C put off stops. Under torchrun
        the ranks agree every ``preempt_check_period`` iterations (see [`Preemption`][])."""
        failed = self._checkpointer.writer.failed
        if not (self._preemption.pending or self._interrupt.put_off or failed):
            return
        if self._interrupt.put_off:  # it came while a thread was joined, or again (Interrupt)
            raise KeyboardInterrupt
        it = self.progress.iter
        signum = self._preemption.agreed_signal(it, failed)
        if signum == WRITE_FAILED:  # surfaced now, not at the next save
            self._checkpointer.raise_write_error()
        if signum and it < self.max_iters - 1:
            path = self.save_checkpoint(self._checkpointer.name())
            self._checkpointer.wait()
            self._preemption.exit(signum, path, it + 1)

    def _after_failure(self, error: BaseException) -> None:
        """Note an exception for the hooks' ``after_train`` (``progress.outcome``, the failure
        line), shut the loader's workers down, and put this rank's values logged since the last
        log point in the storage (no collective). Nothing here may need an import: a failure may
        leave no file descriptor to import with."""
        if isinstance(error, Exception):  # not Ctrl-C, nor a preemption's exit
            self.progress.error = error
        self._data.release()
        try:
            self._storage.flush()
        except FloatingPointError:  # a NaN loss among them is kept up to it
            pass

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        """What [`train`][] holds: rank 0's lock on ``work_dir``, this rank's log file, Ctrl-C
        (its line goes there), the gloo group, the checkpoint writes, the preemption signals
        (caught from the start) and the GradScaler's skipped steps."""
        ensure_console_logging("trainer", get_rank())
        with contextlib.ExitStack() as stack:
            if is_main_process():
                stack.enter_context(self._lock.held())
            stack.enter_context(log_to_file("trainer", self.log_file))
            stack.enter_context(self._interrupt.catching())
            stack.enter_context(self._cpu.open())
            stack.enter_context(self._checkpointer.writing())
            stack.enter_context(self._preemption.catching())
            stack.enter_context(self._step.counting_skips())
            yield

    def _start(self, path: Optional[str], auto_resume: bool, continue_after_stop: bool) -> None:
        """Agree across ranks that training can start, say what runs, and resume."""
        self._agree_at_start()
        self._hooks.start()  # this run's hook times, and which events each hook handles
        self.progress.error = None
        logger.info(f"Environment:\n{collect_env()}")
        logger.info(f"Hooks: {self._hooks.info()}")
        logger.info(
            f"LR schedule: {describe_steps(self.lr_scheduler, self.max_epochs, self.max_iters)}"
        )
        args.warn_unoptimized(self.model_or_module, self._checkpointer.optimizers)
        if self.epoch_len is None:  # a stream: say what counts in epochs, which end with it
            args.warn_stream_epochs(self.lr_scheduler, self.hooks)
        else:  # the batches that accumulation leaves over at each epoch's end
            args.warn_left_over(len(self.data_loader), self.accumulation_steps)
        self._checkpointer.remove_temp_files()
        # Trained by an earlier train() since built or resumed, or to the end: the model and
        # optimizer hold that state, which only a checkpoint can replace.
        trained = self.start_iter < self.cur_iter + 1 or self.cur_iter + 1 >= self.max_iters
        if (path is not None or auto_resume) and self.load_checkpoint(path, auto_resume):
            trained = False
        if trained:
            done = f"iteration {self.cur_iter + 1} of {self.max_iters}"
            fix = "build a new model, optimizer and Trainer to train from scratch"
            if not auto_resume and self.cur_iter + 1 < self.max_iters:
                fix = f"call train() to go on from the last checkpoint, or {fix}"
            raise RuntimeError(f"This Trainer trained up to {done} already: to train on, {fix}.")
        if path is None and not auto_resume and self.start_iter == 0:
            # afresh: no fallback to a checkpoint that does not load may reach the earlier run
            self._checkpointer.set_aside()
        if self.progress.stay_stopped(continue_after_stop):
            logger.info(
                f"The run was ended by stop() after iteration {self.start_iter}: not training on. "
                "Pass train(continue_after_stop=True) to go on."
            )

    def _agree_at_start(self) -> None:
        """Refuse, on every rank at once, to train where another run holds ``work_dir`` or the
        ranks' data loaders differ in length (they would hang in mismatched collectives)."""
        problem = self._lock.problem if is_main_process() else None
        lengths = raise_on_every_rank(
            problem and RuntimeError(problem), self.epoch_len, self._cpu.group
        )
        if len(set(lengths)) > 1:
            raise RuntimeError(
                f"Ranks' data_loaders differ in length ({lengths}): use a DistributedSampler."
            )

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
        ddp = self._step.ddp
        model = self.model_or_module if ddp is not None else self.model
        with contextlib.ExitStack() as stack:
            if self._cpu.group is None:  # outside train(): a group for this evaluation
                stack.enter_context(self._cpu.open())
            if ddp is not None and get_world_size() > 1:  # what DDP's forward would use
                stack.enter_context(rank_0_buffers(model, ddp.process_group))
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
        """Fetch, forward, backward and step once; subclass and override it for anything
        fancier, with the same building blocks: [`next_batch`][], [`compute_losses`][] (or
        [`autocast`][]), [`no_gradient_sync`][], [`backward`][], [`clip_and_step`][]
        and [`log_losses`][]."""
        self.optimizer.zero_grad()
        k = self.accumulation_steps
        summed: dict[str, torch.Tensor] = {}
        for micro_step in range(k):
            batch = self.next_batch()  # 1. fetch
            # the gradients of all micro-batches but the last stay local (DDP, FSDP2)
            with self.no_gradient_sync(skip=micro_step < k - 1):
                loss, losses = self.compute_losses(batch)  # 2. forward, under autocast
                self.backward(loss / k if k > 1 else loss)  # 3. backward, scaled with float16
            if not summed:
                summed = losses
            elif summed.keys() == losses.keys():
                summed = {n: summed[n] + v for n, v in losses.items()}
            else:
                odd = ", ".join(map(repr, sorted(summed.keys() ^ losses.keys())))
                raise ValueError(
                    f"The model returned {odd} for some micro-batches of an iteration only: with "
                    "accumulation_steps > 1 each micro-batch must return the same entries (a 0 "
                    "tensor, torch.zeros(()), where one has none), or pass accumulation_steps=1."
                )
        # 4. log the mean over micro-batches, on the device until the next log point: no sync;
        # the loss NaN-checked, the model's other values as metrics (an empty mask's NaN)
        mean = {n: v / k for n, v in summed.items()} if k > 1 else summed
        self.log_losses(total_loss=mean.pop("total_loss"))
        if mean:
            self.log(self.cur_iter, reduce=True, **mean)
        self.clip_and_step()  # 5. unscale, clip, step (a float16 overflow skips it); logs the norm
        # then the loop adjusts the float16 loss scale, once every optimizer stepped

    def next_batch(self) -> Any:
        """The next batch of the current epoch's pass over the data loader."""
        return self._data.next_batch()

    def autocast(self) -> contextlib.AbstractContextManager:
        """A context for the forward pass: mixed precision with AMP on, else a no-op."""
        return self._step.autocast()

    def no_gradient_sync(self, skip: bool = True) -> contextlib.AbstractContextManager:
        """A context for a micro-batch whose gradients stay local: DDP's ``no_sync``, FSDP2's
        ``set_requires_gradient_sync(False)``; a no-op when not ``skip`` or in one process."""
        return self._step.no_sync(skip)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled by the GradScaler with float16 AMP."""
        self.grad_scaler.scale(loss).backward()  # scale(): the loss as it is when off

    def clip_and_step(
        self, optimizer: Optional[Optimizer] = None, *, name: Optional[str] = None
    ) -> Optional[torch.Tensor]:
        """Unscale, clip (``clip_grad_norm``) and step through the GradScaler ``optimizer``: the
        trainer's, or one registered with ``checkpointer.register`` (else a ValueError). Returns
        the norm before clipping (a device tensor), or None without clipping, and logs it (no
        sync) as ``name``: ``grad_norm``, or ``grad_norm/<registered name>`` for another. With
        float16 the trainer's optimizer's skipped steps are logged as ``amp_skipped_steps``."""
        metrics: dict[str, Any] = {}
        optimizer = optimizer or self.optimizer
        default = "grad_norm"
        if optimizer is not self.optimizer:  # in the checkpoints, so that it resumes exactly
            default = f"grad_norm/{self._checkpointer.name_of(optimizer)}"
        norm = self._step.clip_and_step(optimizer)
        if norm is not None:
            metrics[name or default] = norm
        if self._step.scaling and optimizer is self.optimizer:
            metrics["amp_skipped_steps"] = self._step.skipped
        if metrics:  # on the device until the next log point: no sync; a NaN norm fails like a
            # NaN loss, unless float16's GradScaler skipped that step
            self.log(self.cur_iter, reduce=True, check_finite=not self._step.scaling, **metrics)
        return norm

    def update_scaler(self) -> None:
        """Adjust the float16 loss scale now, for an optimizer that steps twice in an iteration
        (GradScaler asks for it between the two); the trainer does it after each
        [`train_one_iter`][]."""
        self._step.update_scaler()

    def compute_losses(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the model on ``batch`` under [`autocast`][]; returns the loss to back-propagate
        and the detached values to log, ``total_loss`` (what is back-propagated) among them.

        The model returns a scalar loss, or an output with a ``loss`` (a mapping such as a
        Hugging Face ``ModelOutput``, or an object with a ``loss`` attribute), or a dict of
        losses. An output's ``loss`` is the total, back-propagated alone and logged as
        ``total_loss``; the mapping's other floating-point 0-d tensors are logged as metrics,
        never added to it (a plain dict's with a gradient is warned of, once), and the rest
        (logits, hidden states, caches, None, bools) is left alone. A dict without ``loss`` is
        losses, each logged, whose sum is back-propagated; its values without a gradient beside
        ones with are metrics, not losses. A value named like a metric the trainer logs itself
        (``iter``, ``lr``, ``grad_norm``, ...) raises ValueError."""
        with self.autocast():
            out = self.model(**batch) if self._unpack_batch_dict else self.model(batch)
        if isinstance(out, torch.Tensor):  # the loss
            return out, {"total_loss": out.detach()}
        loss, logged = _total_loss(out)
        if logged.keys() != self._output_names:  # a model's names rarely change: checked once
            self._output_names = _check_names(out, logged)
        logged["total_loss"] = loss.detach()
        return loss, logged


def _total_loss(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss to back-propagate from a model's output other than a tensor, and the detached
    values to log besides it, as [`Trainer.compute_losses`][] says."""
    mapping = isinstance(out, Mapping)
    if mapping and "loss" in out and out["loss"] is None:
        raise TypeError(
            "The model's 'loss' is None: return the loss (a Hugging Face model computes it only "
            "when the batch has labels)."
        )
    loss = out.get("loss") if mapping else getattr(out, "loss", None)
    if loss is None and not (mapping and out):
        raise TypeError(
            "model must return a loss, a dict of losses or an output with a 'loss', "
            f"got {type(out).__name__}."
        )
    if loss is not None:
        # Hugging Face's and Lightning's convention: `loss` is the total (an MoE model's
        # aux_loss is in it already), so nothing is added to it
        _check_scalar(
            "The model's 'loss'", loss, "return the tensor, not .item()", "reduce it (e.g. .mean())"
        )
        logged = {  # a bool would be summed with bool + over micro-batches
            name: value.detach()
            for name, value in (out.items() if mapping else ())
            if isinstance(value, torch.Tensor)
            and value.dim() == 0
            and value.is_floating_point()
            and name != "loss"
        }
        return loss, logged
    # a dict of losses: what is not a loss (logits, say) goes beside a `loss`, the total
    beside = (
        "return it beside the total loss in a 'loss' entry, back-propagated alone "
        "(a Hugging Face model has one when the batch has labels)"
    )
    # a plain dict's entry may be a loss left unreduced; a ModelOutput's is an output (logits)
    unreduced = "a loss: reduce it in the model (e.g. .mean()); another output (logits): "
    shape_fix = (unreduced if type(out) is dict else "") + beside
    for name, value in out.items():
        _check_scalar(
            f"Loss {name!r}",
            value,
            "return it as a tensor (not .item()): one of 0-d without a gradient is a metric",
            shape_fix,
        )
    logged = {name: value.detach() for name, value in out.items() if value.is_floating_point()}
    losses = dict(out)
    if any(value.requires_grad for value in losses.values()):
        losses = {name: value for name, value in losses.items() if value.requires_grad}
    first, *rest = losses.values()
    total = sum(rest, first)  # not sum(values): 0 + loss would add a kernel to every step
    return total, logged


def _check_scalar(what: str, value: Any, fix_type: str, fix_shape: str) -> None:
    """Refuse a ``value`` to back-propagate that is not a scalar tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} must be a scalar tensor, got {type(value).__name__}: {fix_type}.")
    if value.numel() != 1:
        raise ValueError(
            f"{what} must be a scalar tensor, got shape {tuple(value.shape)}: {fix_shape}."
        )


def _check_names(out: Any, logged: dict[str, torch.Tensor]) -> frozenset[str]:
    """Refuse the names of the values to log that the trainer logs itself; warn of the
    entries of a plain dict with a gradient beside its ``loss``, which are not trained.
    Returns the names checked."""
    for name in logged:  # mixed with the trainer's own, they would log neither
        if trainer_writes(name) or name in TRAINER_METRICS:
            raise ValueError(
                f"The model returned {name!r}, a name the trainer logs itself (iter, epoch, "
                f"total_loss, lr, grad_norm, ...): rename it, e.g. 'model_{name}'."
            )
    # metadata only, no sync; a ModelOutput's aux_loss is in its loss already
    if type(out) is dict and "loss" in out:
        untrained = [name for name in logged if out[name].requires_grad]
        if untrained:
            logger.warning(
                f"The model's dict has {', '.join(map(repr, untrained))} with a gradient beside "
                "'loss': 'loss' is the total, back-propagated alone. To train their sum, add "
                "them into 'loss', or drop the 'loss' key to have every entry summed."
            )
    return frozenset(logged)
