"""Where training is: [`Progress`][], and where a checkpoint's position goes on when the
number of processes or the batch size changed."""

import dataclasses
import logging
from typing import Any, Optional

from .distributed import get_world_size

logger = logging.getLogger(__name__)

Position = tuple[int, int]  # (epoch, iterations done in it): where training goes on from


@dataclasses.dataclass
class Progress:
    """The counters of a run. ``epoch``, ``inner_iter`` and ``iter`` are the indices (from 0) of
    the iteration running (or the last one), whose number shown is the index + 1; ``position``,
    where a checkpoint taken now resumes, moves when an iteration or an epoch ends.
    ``epoch_len`` is None for a loader without a length (epochs are its passes).
    """

    epoch_len: Optional[int]
    max_iters: int
    epoch: int = 0
    inner_iter: int = 0
    iter: int = -1
    start_iter: int = 0
    resumed_iters: int = 0  # the resumed checkpoint's iterations (start_iter: at most max_iters)
    epoch_start: int = 0  # the iterations done before the current epoch
    position: Position = (0, 0)
    stopped: bool = False  # Trainer.stop was called (or the resumed checkpoint remembers it)
    saved: tuple[Position, bool] = ((-1, -1), False)  # the last checkpoint's position and stop
    error: Optional[BaseException] = None  # the exception that ended this train(), if any

    def begin_epoch(self) -> None:
        """Enter the epoch of [`position`][] (its first iteration, or where it was left)."""
        self.epoch = self.position[0]
        self.epoch_start = self.iter + 1 - self.position[1]

    @property
    def epoch_iters(self) -> int:
        """The iterations of the current epoch: all of its pass, or what is left of
        ``max_iters``; for a stream, an upper bound (its pass may end sooner)."""
        left = self.max_iters - self.epoch_start
        return left if self.epoch_len is None else min(self.epoch_len, left)

    @property
    def finished(self) -> bool:
        """Whether training is over: stopped, or every iteration and its epoch's end done."""
        return self.stopped or (self.iter + 1 >= self.max_iters and self.position[1] == 0)

    @property
    def outcome(self) -> str:
        """How ``train()`` ended, for the hooks' ``after_train``: ``"failed"`` (an exception
        ended it), ``"finished"`` (every iteration done, or [`Trainer.stop`][]), else
        ``"killed"`` (a preemption signal or Ctrl-C ended it early)."""
        if self.error is not None:
            return "failed"
        return "finished" if self.finished else "killed"

    def end_epoch(self) -> None:
        self.position = (self.epoch + 1, 0)

    def mark_saved(self) -> None:
        self.saved = (self.position, self.stopped)

    @property
    def is_saved(self) -> bool:
        """Whether the last checkpoint holds exactly this position and stop."""
        return self.saved == (self.position, self.stopped)

    def stay_stopped(self, continue_after_stop: bool) -> bool:
        """At the start of a run: whether it resumed where [`Trainer.stop`][] ended one and so
        stays stopped (unless ``continue_after_stop``)."""
        self.stopped = self.saved == (self.position, True) and not continue_after_stop
        return self.stopped

    def resume(self, position: Position, stopped: bool, iters_done: int) -> None:
        """Go on from a loaded checkpoint's ``position``, after ``iters_done`` iterations (for a
        stream; with a length they follow from the position)."""
        self.position = position
        self.saved = (position, stopped)
        self.resumed_iters = iters_done  # as the checkpoint counts them (its world size's)
        if self.epoch_len is not None:
            iters_done = position[0] * self.epoch_len + position[1]
        self.start_iter = min(self.max_iters, iters_done)
        self.iter = self.start_iter - 1

    def state_dict(self, batch_size: Optional[int]) -> dict[str, Any]:
        """The position as plain data, with what mapping it to another world size needs."""
        epoch, inner = self.position
        return {
            "epoch": epoch,
            "inner_iter": inner,
            "epoch_len": self.epoch_len,
            "iters_done": self.iter + 1,
            "world_size": get_world_size(),
            "batch_size": batch_size,
            "stopped": self.stopped,
        }


def map_position(
    saved: dict[str, Any],
    path: str,
    epoch_len: Optional[int],
    batch_size: Optional[int],
    accumulation: int,
) -> Position:
    """Where to go on from a checkpoint's ``progress``: (epoch, iterations done in it). When the
    number of processes or the batch size changed, the iterations done are mapped by the samples
    they consumed (a stream's position is not mapped: its iterations are counted as they were)."""
    epoch = saved["epoch"]
    inner = saved["inner_iter"]
    saved_len = saved["epoch_len"]
    before = (saved["world_size"], saved["batch_size"])
    now = (get_world_size(), batch_size)
    # None: a loader without a length; with the same processes and batches, the same length
    if (saved_len is None) != (epoch_len is None) or (before == now and saved_len != epoch_len):
        raise ValueError(
            f"Checkpoint {path!r} was saved with {saved_len} iterations per epoch, now {epoch_len}."
        )
    if epoch_len is None or before == now:
        return epoch, inner
    how = f"{before[0]} processes x batches of {before[1]} to {now[0]} x {now[1]}"
    if inner in (0, saved_len):  # between epochs: nothing to map
        where = "start" if inner == 0 else "end"
        logger.warning(f"Resuming {path} with {how}, at the {where} of epoch {epoch + 1}.")
        return epoch, 0 if inner == 0 else epoch_len
    samples = [w * b * accumulation if b else None for w, b in (before, now)]
    consumed = inner * samples[0] if samples[0] else None
    if consumed is None or samples[1] is None or consumed % samples[1]:
        raise RuntimeError(
            f"Checkpoint {path!r} stopped in epoch {epoch + 1} ({inner} of {saved_len} iterations, "
            f"{consumed} samples), where {how} cannot continue: resume from an epoch's end."
        )
    new_inner = min(consumed // samples[1], epoch_len)
    logger.warning(
        f"Resuming {path} with {how}: epoch {epoch + 1} stopped after {inner} iterations = "
        f"{consumed} samples, so this run goes on with iteration {new_inner + 1} of "
        f"{epoch_len} of that epoch."
    )
    return epoch, new_inner
