"""A live progress bar on a terminal: a line per epoch, redrawn a few times a second."""

import shutil
import sys
import time
from typing import Optional, TextIO

from .. import logger as trainer_logging
from ..distributed import is_main_process
from ..logger import LiveLine, draws_safely_on, is_terminal
from ..misc import NUMBER, check_type
from ..writers import time_left
from .hookbase import HookBase, Priority


class ProgressBarHook(HookBase):
    """Draws the epoch's progress on the console when it is a terminal, on rank 0: iterations
    done of the epoch's, iterations per second, the ETA of the run and the smoothed loss as of
    the last log point (so it reads nothing from the device). It redraws at most every
    ``interval`` seconds, and each epoch's line stays when the epoch ends. Log lines print above
    it; ``log.txt`` is the same as without it. On files, CI logs, notebooks that are not
    terminals, and other ranks, it draws nothing: the log lines are what they get.

    Args:
        interval: Seconds between redraws.
        stream: Where to draw (``sys.stderr``, where the log lines go, by default).

    Example::

        >>> hook = ProgressBarHook()  # the Trainer registers one on a terminal
    """

    priority = Priority.LOGGER + 1  # after LoggerHook: the log point's loss is fresh

    def __init__(self, interval: float = 0.2, stream: Optional[TextIO] = None) -> None:
        check_type("interval", interval, NUMBER, "a number of seconds > 0")
        if not interval > 0:
            raise ValueError(f"interval must be a number of seconds > 0, got {interval!r}.")
        self._interval = interval
        self._stream = stream
        self._line: Optional[LiveLine] = None  # while drawing
        self._next_draw = 0.0
        self._loss = ""
        self._train_start = 0.0
        self._epoch_start = (0.0, 0)  # (time, iterations done) when the epoch (or run) began

    @staticmethod
    def wanted(stream: Optional[TextIO] = None) -> bool:
        """Whether a bar would show: on rank 0, on a terminal."""
        return is_main_process() and is_terminal(stream or sys.stderr)

    def before_train(self) -> None:
        """Start drawing, if the console is a terminal that only this package's console handler
        prints on (a handler of your own there would print over the bar)."""
        stream = self._stream or sys.stderr
        if self.wanted(stream) and draws_safely_on(stream):
            self._train_start = time.perf_counter()
            self._line = trainer_logging.live_line = LiveLine(stream)

    def before_epoch(self) -> None:
        """A new line for the epoch, drawn at its first iteration's end."""
        if self._line is not None:
            self._epoch_start = (time.perf_counter(), self._done_in_epoch())
            self._next_draw = 0.0

    def after_iter(self) -> None:
        """Take the loss at log points; redraw when ``interval`` has passed."""
        if self._line is None:
            return
        trainer = self.trainer
        done = trainer.cur_iter + 1
        if done % trainer.log_period == 0 or done == trainer.max_iters:
            storage = trainer.metric_storage  # flushed at this log point already: no sync
            if "total_loss" in storage:
                self._loss = f"  loss {storage.value_maybe_smooth('total_loss'):.4g}"
        now = time.perf_counter()
        if now >= self._next_draw:
            self._draw(self._line, now)

    def after_epoch(self) -> None:
        """Leave the epoch's final line on the screen."""
        if self._line is not None:
            self._draw(self._line, time.perf_counter())
            self._line.finish()

    def after_train(self) -> None:
        """Stop drawing: the last line stays, unless training did not finish (a traceback or
        the Ctrl-C line comes next)."""
        if self._line is None:
            return
        if self.trainer.progress.outcome == "finished":
            self._line.finish()
        else:
            self._line.erase()
        self._line = None
        trainer_logging.live_line = None

    def _draw(self, line: LiveLine, now: float) -> None:
        self._next_draw = now + self._interval
        line.show(self._text(now))

    def _done_in_epoch(self) -> int:
        epoch, done = self.trainer.progress.position
        return done if epoch == self.trainer.cur_epoch else self.trainer.inner_iter + 1

    def _text(self, now: float) -> str:
        trainer = self.trainer
        done_in_epoch = self._done_in_epoch()
        started, done_before = self._epoch_start
        rate = (done_in_epoch - done_before) / max(now - started, 1e-9)
        done = trainer.cur_iter + 1
        eta = time_left(
            now - self._train_start, done - trainer.start_iter, trainer.max_iters - done
        )
        tail = f"  {rate:.3g} it/s  ETA {eta}{self._loss}"
        if trainer.max_epochs is None:  # a stream: its passes have no known length
            return f"epoch {trainer.cur_epoch + 1} [{done_in_epoch}]{tail}"
        total = trainer.progress.epoch_iters
        head = f"epoch {trainer.cur_epoch + 1}/{trainer.max_epochs} "
        tail = f" {done_in_epoch}/{total}{tail}"
        width = shutil.get_terminal_size((100, 20)).columns - 1
        bar_width = width - len(head) - len(tail) - 2
        if bar_width >= 10:
            filled = bar_width * min(done_in_epoch, total) // total
            head += "[" + "#" * filled + "-" * (bar_width - filled) + "]"
        return (head + tail)[:width]
