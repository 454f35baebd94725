"""One metric's series: [`HistoryBuffer`][] (core-pytorch-utils' ``cpu.history_buffer``)."""

import functools
import operator
from collections import deque
from typing import Any

from .misc import check_int

__all__ = ["HistoryBuffer"]


class HistoryBuffer:
    """Tracks a series of numbers: the latest one, a window mean and global statistics.

    Args:
        window_size: How many recent values [`avg`][] averages over.
    """

    def __init__(self, window_size: int = 20) -> None:
        check_int("window_size", window_size, minimum=1)
        self._window: deque = deque(maxlen=window_size)
        self._count = 0
        self._sum = 0.0

    def update(self, value: float) -> None:
        """Append a value; the oldest one leaves the window once it is full."""
        value = float(value)
        self._window.append(value)
        self._count += 1
        self._sum += value

    def extend(self, values: list[float]) -> None:
        """Append several values, oldest first (the same result as updating one by one)."""
        self._window.extend(values)
        self._count += len(values)
        # added one by one, in order, so the sum does not depend on how values are batched
        self._sum = functools.reduce(operator.add, values, self._sum)

    @property
    def latest(self) -> float:
        """The most recent value."""
        return self._window[-1]

    @property
    def avg(self) -> float:
        """The mean of the values in the window."""
        return sum(self._window) / len(self._window)

    @property
    def global_avg(self) -> float:
        """The mean of every value ever added."""
        return self._sum / self._count

    @property
    def global_sum(self) -> float:
        """The sum of every value ever added."""
        return self._sum

    @property
    def count(self) -> int:
        """How many values were ever added."""
        return self._count

    def state_dict(self) -> dict[str, Any]:
        """The buffer as plain data."""
        return {
            "window_size": self._window.maxlen,
            "window": list(self._window),
            "count": self._count,
            "sum": self._sum,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned."""
        check_int("window_size", state["window_size"], minimum=1)
        self._window = deque(state["window"], maxlen=state["window_size"])
        self._count = state["count"]
        self._sum = state["sum"]
