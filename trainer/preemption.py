"""Signals while training. Preemption: SIGTERM or SIGUSR1 means "finish this iteration, save,
exit", and under torchrun every rank must agree on the iteration (the save is a collective).
Ctrl-C (SIGINT) means "stop now": the checkpoint write in flight lands, nothing more is saved.
A signal that comes again while the trainer acts on the first is counted and ignored: launchers
(torchrun, srun) pass on a signal that reaches their workers too, so one Ctrl-C or ``scancel``
often arrives twice within milliseconds, and the copy must not cut the save short. A third
Ctrl-C exits at once: a user's way out of a run that hangs."""

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, Callable, NoReturn, Optional

import numpy as np
import torch
import torch.distributed as dist

from .distributed import CpuGroup, get_world_size
from .logger import in_notebook
from .progress import Progress

logger = logging.getLogger(__name__)

# SIGUSR1 is what SLURM sends ahead of preemption (with --signal=USR1@<seconds>).
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# agreed_signal's answer when a checkpoint write failed: above any signal, it wins the maximum.
WRITE_FAILED = 1000
INTERRUPTED = 128 + signal.SIGINT  # the exit status of a Ctrl-C, as a shell reports it
_JOIN = threading.Thread.join.__code__  # where the main thread waits for a thread to end


class Preemption:
    """Catches the preemption signals while training and tells when every rank stops for one:
    in one process, after the iteration the signal arrived in; under torchrun, at one iteration,
    at most ``2 * check_period`` iterations after the signal (an asynchronous all-reduce of a
    CPU flag over gloo, started at one check and read at the next: it never waits on the device
    nor stalls the loop).

    Args:
        check_period: Iterations between the checks under torchrun.
        cpu: The trainer's gloo group, open while it trains.
    """

    def __init__(self, check_period: int = 10, cpu: Optional[CpuGroup] = None) -> None:
        self.check_period = check_period
        self.caught: Optional[int] = None  # the signal this process caught
        self.ignored = 0  # the signals that came after it
        self._cpu = cpu or CpuGroup()
        self._agreement: Optional[_Agreement] = None  # under torchrun, while catching

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        """Catch the signals for the block (in the main thread only). A signal it did not act on
        (in the last iteration, or after it) still exits the process if the block ends normally."""
        self.caught = None
        self.ignored = 0
        self._agreement = None
        if get_world_size() > 1:
            self._agreement = _Agreement(self.check_period, self._cpu)
        if threading.current_thread() is not threading.main_thread():
            yield  # Python lets only the main thread handle signals
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in PREEMPT_SIGNALS}
        try:
            yield
        finally:
            # Restored so that no handler keeps the trainer alive after train().
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._agreement is not None:
                self._agreement.finish()
        if self.caught is not None:
            status = 128 + self.caught
            logger.warning(
                f"{signal.Signals(self.caught).name} arrived after the last iteration"
                f"{_ignored(self.ignored)}: training is complete; exiting with status "
                f"{status}, as the signal asks."
            )
            raise SystemExit(status)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.caught is not None:  # a copy: the save the first asked for goes on
            self.ignored += 1
            return
        self.caught = signum

    @property
    def pending(self) -> bool:
        """Whether [`agreed_signal`][] is due after this iteration: this process caught a signal,
        or under torchrun, where the ranks check every ``check_period`` iterations."""
        return self.caught is not None or self._agreement is not None

    def agreed_signal(self, iteration: int, write_failed: bool = False) -> int:
        """The signal that every rank stops for after ``iteration``, 0 to go on, or
        [`WRITE_FAILED`][] when a rank's checkpoint write failed (learnt like a signal)."""
        local = WRITE_FAILED if write_failed else (self.caught or 0)
        return local if self._agreement is None else self._agreement.check(iteration, local)

    def exit(self, signum: int, path: Optional[str], iters_done: int) -> None:
        """Exit after the checkpoint at ``path`` (None on ranks that do not write) was saved,
        with the status a shell reports for death by ``signum`` (128 + its number)."""
        status = 128 + signum
        logger.warning(
            f"Preempted by {signal.Signals(signum).name} after iteration {iters_done}"
            f"{_ignored(self.ignored)}: saved {path or 'a checkpoint (rank 0 writes)'}; "
            f"exiting with status {status}. Rerun the same command to resume."
        )
        raise SystemExit(status)


class _Agreement:
    """The ranks' checks: [`check`][] starts one and returns the previous one's result."""

    def __init__(self, check_period: int, cpu: CpuGroup) -> None:
        self._check_period = check_period
        self._cpu = cpu  # open while training: its group is read at each check
        self._pending: Optional[tuple[Any, np.ndarray]] = None  # the check in flight

    def check(self, iteration: int, local: int) -> int:
        """After ``iteration``: the ranks' maximum of ``local`` at the previous check, if this
        is a check, else 0."""
        if (iteration + 1) % self._check_period:
            return 0
        agreed = self.finish()
        flag = np.array([local], dtype=np.int32)  # numpy-backed: reading it needs no device sync
        work = dist.all_reduce(
            torch.from_numpy(flag), op=dist.ReduceOp.MAX, group=self._cpu.group, async_op=True
        )
        self._pending = (work, flag)
        return agreed

    def finish(self) -> int:
        """Wait for the check in flight; its result, or 0 when there is none."""
        if self._pending is None:
            return 0
        (work, flag), self._pending = self._pending, None
        work.wait()
        return int(flag[0])


class Interrupt:
    """Ctrl-C (SIGINT) while training, caught in the main thread. The first one stops training at
    once, as Python's own handler does (a ``KeyboardInterrupt``), yet the checkpoint write in
    flight finishes, since it holds finished iterations, and ``train()`` ends in order; then
    [`catching`][] logs one line naming the newest checkpoint on disk and exits with status
    130 (in a notebook, raises ``KeyboardInterrupt``: the kernel shows its usual interrupt). A
    second Ctrl-C meanwhile is ignored, as Lightning does: a launcher passes on the terminal's
    Ctrl-C, which reaches its workers too, and the copy must not abandon the write.
    If the first did not stop training (code that caught its ``KeyboardInterrupt``), the second
    stops it at the end of the iteration. A third exits at once with status 130, for a user
    whose run hangs after the first (an evaluation in ``after_train``, a tracker stalled on the
    network, a write waiting on dead ranks): the write in flight is abandoned, yet writes are
    atomic, so the last checkpoint on disk stays as it was.

    Args:
        progress: Where training is, for the line.
        checkpoints: ``Checkpointer.newest_on_disk``: the newest checkpoint on disk and the
            iterations it holds.
    """

    def __init__(
        self, progress: Progress, checkpoints: Callable[[], tuple[Optional[str], int]]
    ) -> None:
        self._progress = progress
        self._checkpoints = checkpoints
        self.count = 0  # the Ctrl-Cs caught since catching began
        self.put_off = False  # one to act on at the end of the iteration (read every iteration)

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        """Catch Ctrl-C for the block, which ends an interrupted run with one line and
        ``SystemExit(130)`` (in a Jupyter notebook, a ``KeyboardInterrupt``); a
        ``KeyboardInterrupt`` raised otherwise ends the same way. A
        handler of the user's, or SIGINT ignored (a background job), stays as it is."""
        self.count = 0
        self.put_off = False
        previous = signal.getsignal(signal.SIGINT)
        main = threading.current_thread() is threading.main_thread()  # where handlers run
        ours = main and previous is signal.default_int_handler
        if ours:
            signal.signal(signal.SIGINT, self._on_ctrl_c)
        try:
            interrupted = False
            try:
                yield
            except KeyboardInterrupt:
                interrupted = True
            if interrupted or self.put_off:  # train() waited for the write in flight
                logger.warning(self._line(*self._checkpoints()))
                if in_notebook():  # the kernel's usual interrupt, not "To exit: use 'exit'"
                    raise KeyboardInterrupt from None
                raise SystemExit(INTERRUPTED) from None
        finally:
            if ours:  # restored so that no handler keeps the trainer alive after train()
                signal.signal(signal.SIGINT, previous)

    def _on_ctrl_c(self, signum: int, frame: Optional[FrameType]) -> None:
        self.count += 1
        if self.count > 2:  # (a launcher's copy makes two) a user pressing again: exit now
            self._exit_now()
        joining = frame is not None and _JOIN in (
            frame.f_code,
            frame.f_back and frame.f_back.f_code,
        )
        if self.count > 1 or joining:
            # A second Ctrl-C: ignored (see the class), but stops training if the first did not.
            # One in Thread.join: raised there, it marks the thread finished while it runs
            # (CPython gh-90882, before 3.13), and the checkpoint write would be cut off at exit,
            # unseen. Both are put off to the end of the iteration, or of train().
            self.put_off = True
            return
        raise KeyboardInterrupt

    def _exit_now(self) -> NoReturn:
        """Say so on stderr and exit with status 130, leaving the rest undone. Not logged: the
        handler runs in the main thread between two of its bytecodes, perhaps while it or the
        writing thread holds a logging handler's lock (a deadlock) or is inside the log file's
        buffered write; ``os.write`` to fd 2 takes no lock. ``os._exit`` flushes nothing, and
        log.txt keeps the lines before it (each is flushed as it is logged)."""
        line = (
            f"Interrupted (Ctrl-C {self.count} times): exiting now, abandoning the checkpoint "
            "write in flight, if any; the last checkpoint on disk is kept. Rerun to resume.\n"
        )
        try:
            os.write(2, line.encode())
        finally:  # exit even where stderr is closed
            os._exit(INTERRUPTED)

    def _line(self, last: Optional[str], done: int) -> str:
        """The line: where training was, whether the checkpoint ``last`` on disk (after ``done``
        iterations) holds it, and where a rerun resumes."""
        progress = self._progress
        it = f"iteration {progress.iter + 1} of {progress.max_iters}"
        if progress.finished:
            where = f"as training ended, after {it}."
        elif last is not None and done == progress.iter + 1:  # (a save in its hooks)
            where = f"after {it}: saved."
        else:
            where = f"in {it}: not saved."
        more = f", {self.count - 1} more ignored" if self.count > 1 else ""
        return (
            f"Interrupted (Ctrl-C{more}) {where} Rerun to resume from the last checkpoint "
            f"({last or 'none yet: from the start'})."
        )


def _ignored(count: int) -> str:
    """`` (2 more signals ignored)``, or "" when none came."""
    return f" ({count} more signal{'s' if count > 1 else ''} ignored)" if count else ""
