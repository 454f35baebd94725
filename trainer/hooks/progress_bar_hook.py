"""A live progress bar, tqdm's: on a terminal a line per epoch, in a Jupyter notebook one display
for the run."""

import os
import sys
import time
import warnings
from typing import Any, Optional, TextIO

from tqdm.auto import tqdm

from .. import logger as trainer_logging
from ..distributed import is_main_process
from ..logger import draws_safely_on, in_notebook, is_terminal
from ..misc import NUMBER, check_type
from ..writers import time_left
from .hookbase import HookBase, Priority

# what the bar shows: with an epoch's length known, and in a stream, whose passes have none
_FORMAT = "{desc} |{bar}| {n_fmt}/{total_fmt} [{rate_fmt}{postfix}]"
_STREAM_FORMAT = "{desc} {n_fmt}it [{rate_fmt}{postfix}]"


class _Bar(tqdm):
    """tqdm's bar (on a terminal, or a notebook's), whose redraw releases tqdm's lock even when
    the draw raises: tqdm's own ``refresh()`` has no try/finally, so a Ctrl-C landing in the draw
    kept the lock, and the next log record from another thread (the checkpoint writer's "Saved")
    waited for it forever, and ``train()`` for that write. Every redraw goes through here (the
    bar's start, ``reset``, ``set_postfix_str``, ``update``)."""

    def refresh(self, nolock: bool = False, lock_args: Any = None) -> Any:
        if nolock:  # the caller holds the lock (tqdm.external_write_mode)
            return super().refresh(nolock=True)
        with self.get_lock():
            return super().refresh(nolock=True)


class ProgressBarHook(HookBase):
    """Draws the epoch's progress with tqdm on rank 0, on a terminal or in a Jupyter notebook:
    iterations done of the epoch's, iterations per second, the ETA of the run and the smoothed
    loss as of the last log point (so it reads nothing from the device). It redraws at most
    every ``interval`` seconds. On a terminal each epoch's line stays when the epoch ends, and
    log lines print above the bar. In a notebook one display for the run (a widget with
    ipywidgets installed, else a line of text) stands for the log points' lines, which go to
    ``log.txt`` and the other writers only; the other records print. ``log.txt`` is the same
    either way. On files, CI logs and other ranks it draws nothing: the log lines are what they
    get.

    Args:
        interval: Seconds between redraws.
        stream: Where to draw (``sys.stderr``, where the log lines go, by default); a notebook's
            widget shows in the cell's output.

    Example::

        >>> hook = ProgressBarHook()  # the Trainer registers one on a terminal or in a notebook
    """

    priority = Priority.LOGGER + 1  # after LoggerHook: the log point's loss is fresh

    def __init__(self, interval: float = 0.2, stream: Optional[TextIO] = None) -> None:
        check_type("interval", interval, NUMBER, "a number of seconds > 0")
        if not interval > 0:
            raise ValueError(f"interval must be a number of seconds > 0, got {interval!r}.")
        self._interval = interval
        self._stream = stream
        self._drawing = False
        self._bar: Any = None  # a tqdm bar: on a terminal the epoch's, in a notebook the run's
        self._next_draw = 0.0
        self._loss = ""
        self._train_start = 0.0
        self._showwarning: Any = None  # warnings.showwarning before the bar was drawn
        self._pid = 0  # the process that drew the bar (not a forked worker)

    @staticmethod
    def wanted(stream: Optional[TextIO] = None) -> bool:
        """Whether a bar would show: on rank 0, on a terminal or in a Jupyter notebook."""
        return is_main_process() and (is_terminal(stream or sys.stderr) or in_notebook())

    def before_train(self) -> None:
        """Start drawing, if the console is a terminal (or a notebook) that only this package's
        console handler prints on (a handler of your own there would print over the bar)."""
        stream = self._stream or sys.stderr
        self._drawing = self.wanted(stream) and draws_safely_on(stream)
        self._train_start = time.perf_counter()

    def before_epoch(self) -> None:
        """Start the epoch's bar: on a terminal a new line, in a notebook the same display."""
        if not self._drawing:
            return
        trainer = self.trainer
        done = trainer.progress.position[1]  # 0, or where a resumed run goes on in the epoch
        if trainer.max_epochs is None:
            desc, total, bar_format = f"epoch {trainer.cur_epoch + 1}", None, _STREAM_FORMAT
        else:
            desc = f"epoch {trainer.cur_epoch + 1}/{trainer.max_epochs}"
            total, bar_format = trainer.progress.epoch_iters, _FORMAT
        if self._bar is None:
            self._bar = trainer_logging.live_bar = _Bar(
                desc=desc,
                total=total,
                initial=done,
                file=self._stream or sys.stderr,
                bar_format=bar_format,
                dynamic_ncols=True,
            )
            if warnings.showwarning != self._show_warning:  # (restored to ours since)
                self._showwarning, warnings.showwarning = warnings.showwarning, self._show_warning
                self._pid = os.getpid()
        else:  # a notebook's one display, for the run (a resumed epoch was the first)
            self._bar.initial = 0
            self._bar.set_description_str(desc, refresh=False)
            self._bar.reset(total)
        self._next_draw = 0.0

    def after_iter(self) -> None:
        """Take the loss at log points; redraw when ``interval`` has passed."""
        if self._bar is None:
            return
        trainer = self.trainer
        done = trainer.cur_iter + 1
        if done % trainer.log_period == 0 or done == trainer.max_iters:
            storage = trainer.metric_storage  # flushed at this log point already: no sync
            if "total_loss" in storage:
                self._loss = f", loss {storage.value_maybe_smooth('total_loss'):.4g}"
        now = time.perf_counter()
        if now >= self._next_draw:
            self._draw(now)

    def after_epoch(self) -> None:
        """Draw the epoch's final state; on a terminal, leave its line on the screen."""
        if self._bar is None:
            return
        self._draw(time.perf_counter())
        if not in_notebook():
            self._close(leave=True)

    def after_train(self) -> None:
        """Stop drawing: the last line stays, unless training did not finish (a traceback or
        the Ctrl-C line comes next; a notebook's bar turns red where it stopped within an epoch)."""
        if self._bar is None:
            return
        # drawn up to `interval` ago: drawn again at the iterations done in the epoch (all of
        # them if it ended), so that a failure's or Ctrl-C's bar (red in a notebook) is true
        progress = self.trainer.progress
        epoch, done = progress.position
        self._bar.n = done if epoch == progress.epoch else progress.inner_iter + 1
        self._bar.refresh()
        self._close(leave=progress.outcome == "finished")

    def _close(self, leave: bool) -> None:
        self._bar.leave = leave
        self._bar.close()
        self._bar = trainer_logging.live_bar = None
        if warnings.showwarning == self._show_warning:  # (not one set since)
            warnings.showwarning = self._showwarning

    def _show_warning(self, *args: Any, **kwargs: Any) -> None:
        """``warnings.showwarning`` while the bar is drawn: ``warnings`` writes to stderr
        itself, onto the bar's line; here the bar is cleared first and drawn again below, as
        for a log record (tqdm's lock keeps a redraw from another thread out meanwhile)."""
        if os.getpid() != self._pid:  # a forked DataLoader worker: tqdm's lock may be held
            self._showwarning(*args, **kwargs)  # forever there, by a thread of the parent's
            return
        with tqdm.external_write_mode(file=self._stream or sys.stderr):
            self._showwarning(*args, **kwargs)

    def _draw(self, now: float) -> None:
        self._next_draw = now + self._interval
        trainer = self.trainer
        done = trainer.cur_iter + 1
        eta = time_left(
            now - self._train_start, done - trainer.start_iter, trainer.max_iters - done
        )
        self._bar.n = trainer.inner_iter + 1
        self._bar.set_postfix_str(f"ETA {eta}{self._loss}")  # and redraw
