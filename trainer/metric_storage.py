"""Smoothed metric buffers: :class:`HistoryBuffer` and :class:`MetricStorage`."""

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, Optional


class HistoryBuffer:
    """Tracks a series of numbers: the latest one, a window mean and global statistics.

    Args:
        window_size: How many recent values :attr:`avg` averages over.

    Example::

        >>> buf = HistoryBuffer(window_size=2)
        >>> for v in (1.0, 2.0, 4.0):
        ...     buf.update(v)
        >>> buf.latest, buf.avg, buf.global_avg, buf.global_sum
        (4.0, 3.0, 2.3333333333333335, 7.0)
    """

    def __init__(self, window_size: int = 20) -> None:
        if not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be a positive int, got {window_size!r}.")
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
        for value in values:  # one by one, so the sum does not depend on how values are batched
            self._sum += value

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
        """Restore what :meth:`state_dict` returned."""
        self._window = deque(state["window"], maxlen=state["window_size"])
        self._count = state["count"]
        self._sum = state["sum"]


class MetricStorage(Mapping):
    """A mapping from metric name to :class:`HistoryBuffer`, with each metric's latest iteration.

    Args:
        window_size: The window of each buffer, i.e. how many values a smoothed metric averages.

    Example::

        >>> storage = MetricStorage()
        >>> storage.update(iter=0, loss=0.2)
        >>> storage.update(iter=1, loss=0.1, lr=0.01, smooth=True)
        >>> storage.update(iter=1, acc=0.9, smooth=False)
        >>> "loss" in storage, round(storage["loss"].avg, 3)
        (True, 0.15)
        >>> storage.values_maybe_smooth["acc"]
        (1, 0.9)
    """

    def __init__(self, window_size: int = 20) -> None:
        self._window_size = window_size
        self._buffers: dict[str, HistoryBuffer] = {}
        self._latest_iter: dict[str, int] = {}
        self._smooth: dict[str, bool] = {}

    def __getitem__(self, name: str) -> HistoryBuffer:
        return self._buffers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    def update(self, iter: Optional[int] = None, smooth: bool = True, **values: float) -> None:
        """Add one value per metric, produced at iteration ``iter``.

        Args:
            iter: The iteration the values belong to. None counts updates of each metric.
            smooth: Whether :attr:`values_maybe_smooth` reports the window mean (True) or the
                latest value (False). A metric keeps the choice of its first update.
            values: Metric names and numbers.
        """
        for name, value in values.items():
            buffer = self._buffer(name, smooth)
            self._latest_iter[name] = buffer.count if iter is None else iter
            buffer.update(value)

    def extend(self, name: str, iters: list[int], values: list[float], smooth: bool = True) -> None:
        """Add a series of values of one metric, oldest first, produced at iterations ``iters``."""
        if values:
            self._buffer(name, smooth).extend([float(v) for v in values])
            self._latest_iter[name] = iters[-1]

    def _buffer(self, name: str, smooth: bool) -> HistoryBuffer:
        if name not in self._buffers:
            self._buffers[name] = HistoryBuffer(self._window_size)
            self._smooth[name] = smooth
        elif self._smooth[name] != smooth:
            raise ValueError(
                f"Metric {name!r} was first logged with smooth={self._smooth[name]} and now "
                f"with smooth={smooth}; log each metric with one smooth setting."
            )
        return self._buffers[name]

    def latest_iter(self, name: str) -> int:
        """The iteration of the latest value of ``name``."""
        return self._latest_iter[name]

    @property
    def values_maybe_smooth(self) -> dict[str, tuple[int, float]]:
        """``{name: (latest_iter, window mean if smoothed else latest value)}``."""
        return {
            name: (self._latest_iter[name], buf.avg if self._smooth[name] else buf.latest)
            for name, buf in self._buffers.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """The storage as plain data, loadable with ``torch.load(weights_only=True)``."""
        return {
            "window_size": self._window_size,
            "metrics": {
                name: {
                    "buffer": buf.state_dict(),
                    "iter": self._latest_iter[name],
                    "smooth": self._smooth[name],
                }
                for name, buf in self._buffers.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the content with what :meth:`state_dict` returned."""
        self._window_size = state["window_size"]
        self._buffers.clear()
        self._latest_iter.clear()
        self._smooth.clear()
        for name, entry in state["metrics"].items():
            buf = HistoryBuffer(entry["buffer"]["window_size"])
            buf.load_state_dict(entry["buffer"])
            self._buffers[name] = buf
            self._latest_iter[name] = entry["iter"]
            self._smooth[name] = entry["smooth"]
