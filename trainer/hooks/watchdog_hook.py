"""Dumps every thread's Python stack when an iteration hangs."""

import collections
import logging
import statistics
import sys
import threading
import time
import traceback
from typing import Optional

from ..distributed import get_rank
from ..misc import NUMBER, check_int, check_type
from .hookbase import HookBase, Priority

logger = logging.getLogger(__name__)


class WatchdogHook(HookBase):
    """When an iteration has run ``factor`` times longer than the median of the recent ones
    (and at least ``min_seconds``), logs the Python stack of every thread of this process,
    tagged with the rank, to the console and this rank's log file. Under torchrun every rank
    has its own watchdog, so a collective that one rank never joins shows, on every rank,
    where each one waits, long before the process group's timeout ends the job.

    A background thread watches; the training loop only notes when each iteration starts and
    ends. One dump per hanging iteration.

    Args:
        factor: How many times the median iteration time counts as hanging.
        min_seconds: Never report an iteration shorter than this.
        window: How many recent iterations the median is taken over.

    Example::

        >>> hook = WatchdogHook(factor=20, min_seconds=120)
    """

    # last: its after_iter ends the timing after the other hooks' (their hangs count too)
    priority = Priority.LOGGER + 5

    def __init__(self, factor: float = 10.0, min_seconds: float = 60.0, window: int = 50) -> None:
        check_type("factor", factor, NUMBER, "a number > 1")
        check_type("min_seconds", min_seconds, NUMBER, "a number > 0")
        if not factor > 1 or not min_seconds > 0:
            raise ValueError(
                f"factor must be > 1, min_seconds > 0; got factor={factor}, "
                f"min_seconds={min_seconds}."
            )
        check_int("window", window, minimum=1)
        self._factor = factor
        self._min_seconds = min_seconds
        self._recent: collections.deque = collections.deque(maxlen=window)
        self._started: Optional[float] = None  # when the running iteration started
        self._iter = -1
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def before_train(self) -> None:
        """Start the watching thread."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="trainer-watchdog", daemon=True)
        self._thread.start()

    def before_iter(self) -> None:
        """Note the start of an iteration."""
        self._iter = self.trainer.cur_iter
        self._started = time.perf_counter()

    def after_iter(self) -> None:
        """Note its end."""
        if self._started is not None:
            self._recent.append(time.perf_counter() - self._started)
        self._started = None

    def after_train(self) -> None:
        """Stop the watching thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        dumped = -1  # the iteration last reported
        poll = min(1.0, self._min_seconds / 4)
        while not self._stop.wait(poll):
            started = self._started
            iteration = self._iter
            if started is None or iteration == dumped or len(self._recent) < 5:
                continue
            median = statistics.median(self._recent)
            running = time.perf_counter() - started
            if running > max(self._min_seconds, self._factor * median):
                dumped = iteration
                logger.warning(
                    f"Rank {get_rank()}: iteration {iteration + 1} has run for {running:.1f} s, "
                    f"{running / median:.0f}x the recent median of {median:.3g} s. Stacks of "
                    f"every thread:\n{_all_stacks()}"
                )


def _all_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"Thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(parts)
