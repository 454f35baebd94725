"""Metrics: :class:`HistoryBuffer`, one metric's series, and :class:`MetricStorage`, the
buffers by name with the values still waiting on their device for the next log point."""

import functools
import itertools
import math
import operator
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Optional

import torch

from .checks import check_int
from .distributed import CpuGroup, get_world_size


class HistoryBuffer:
    """Tracks a series of numbers: the latest one, a window mean and global statistics.

    Args:
        window_size: How many recent values :attr:`avg` averages over.
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
        """Restore what :meth:`state_dict` returned."""
        check_int("window_size", state["window_size"], minimum=1)
        self._window = deque(state["window"], maxlen=state["window_size"])
        self._count = state["count"]
        self._sum = state["sum"]


class MetricStorage(Mapping):
    """A mapping from metric name to :class:`HistoryBuffer`, with each metric's latest iteration.
    :meth:`add` keeps scalar tensors on their device until :meth:`flush` copies them in one
    transfer (reduced over ranks if ``reduce``; a non-finite ``check_finite`` value raises
    ``FloatingPointError``).

    Args:
        window_size: The window of each buffer, i.e. how many values a smoothed metric averages.
        epoch_len: Iterations per epoch, to name the epoch of a bad loss (None: only the
            iteration is named).
        cpu: The trainer's gloo group, which reduces values on the CPU while it trains.
    """

    def __init__(
        self,
        window_size: int = 20,
        *,
        epoch_len: Optional[int] = None,
        cpu: Optional[CpuGroup] = None,
    ) -> None:
        check_int("window_size", window_size, minimum=1)  # here, not at the first update
        self._window_size = window_size
        self._buffers: dict[str, HistoryBuffer] = {}
        self._latest_iter: dict[str, int] = {}
        self._smooth: dict[str, bool] = {}
        self._epoch_len = epoch_len
        self._cpu = cpu or CpuGroup()
        self._pending: dict[str, _Series] = {}

    def __getitem__(self, name: str) -> HistoryBuffer:
        return self._buffers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    def update(self, iter: Optional[int] = None, smooth: bool = True, **values: float) -> None:
        """Add one number per metric name, produced at iteration ``iter`` (None: count each
        metric's updates). ``smooth``: whether :attr:`values_maybe_smooth` reports the window mean
        or the latest value; a metric keeps the choice of its first update."""
        for name, value in values.items():
            buffer = self._buffer(name, smooth)
            self._latest_iter[name] = buffer.count if iter is None else iter
            buffer.update(value)

    def extend(self, name: str, iters: list[int], values: list[float], smooth: bool = True) -> None:
        """Add a series of values of one metric, oldest first, produced at iterations ``iters``."""
        if values:
            self._buffer(name, smooth).extend(list(map(float, values)))
            self._latest_iter[name] = iters[-1]

    def _buffer(self, name: str, smooth: bool) -> HistoryBuffer:
        if name not in self._buffers:
            self._buffers[name] = HistoryBuffer(self._window_size)
            self._smooth[name] = smooth
        elif self._smooth[name] != smooth:
            raise ValueError(
                f"Metric {name!r} was first logged with smooth={self._smooth[name]} and now "
                f"with smooth={smooth}; log each metric with one smooth setting. If two sources "
                "log it (training's losses and an evaluation's results, say), give them "
                "different names."
            )
        return self._buffers[name]

    def latest_iter(self, name: str) -> int:
        """The iteration of the latest value of ``name``."""
        return self._latest_iter[name]

    def smoothed(self, name: str) -> bool:
        """Whether ``name`` is logged smoothed (losses, by default) or as its latest value."""
        return self._smooth[name]

    def value_maybe_smooth(self, name: str) -> float:
        """The window mean of ``name`` if it is smoothed, else its latest value."""
        buf = self._buffers[name]
        return buf.avg if self._smooth[name] else buf.latest

    @property
    def values_maybe_smooth(self) -> dict[str, tuple[int, float]]:
        """``{name: (latest_iter, window mean if smoothed else latest value)}``."""
        return {name: (self._latest_iter[name], self.value_maybe_smooth(name)) for name in self}

    def state_dict(self) -> dict[str, Any]:
        """The storage as plain data, loadable with ``torch.load(weights_only=True)``."""
        metrics = {
            name: {"buffer": buf.state_dict(), "iter": self._latest_iter[name],
                   "smooth": self._smooth[name]}
            for name, buf in self._buffers.items()
        }  # fmt: skip
        return {"window_size": self._window_size, "metrics": metrics}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the content with what :meth:`state_dict` returned, and drop what is pending."""
        self._window_size = state["window_size"]
        for table in (self._buffers, self._latest_iter, self._smooth, self._pending):
            table.clear()
        for name, entry in state["metrics"].items():
            # checkpoints from before the trainer's times were each period's means smooth them
            smooth = entry["smooth"] and name not in PERIOD_TIMES
            self._buffer(name, smooth).load_state_dict(entry["buffer"])  # its own window size
            self._latest_iter[name] = entry["iter"]

    def add(
        self,
        iter: int,
        metrics: dict[str, Any],
        smooth: bool = True,
        check_finite: bool = False,
        reduce: bool = False,
    ) -> None:
        """Record values of iteration ``iter``: this rank's own numbers (not ``reduce``-d or
        ``check_finite``) at once, as :meth:`update` does; scalar tensors and the rest at the next
        :meth:`flush` (a one-element tensor is reshaped and detached; one of several raises)."""
        if not (reduce or check_finite):
            now = {
                name: value
                for name, value in metrics.items()
                if not isinstance(value, torch.Tensor) and name not in self._pending
            }
            self.update(iter, smooth, **now)
            metrics = {name: value for name, value in metrics.items() if name not in now}
        # Called every iteration, so kept lean: a detached scalar tensor (a loss) passes as is.
        for name, value in metrics.items():
            if isinstance(value, torch.Tensor) and (value.requires_grad or value.dim()):
                if value.numel() != 1:
                    raise ValueError(
                        f"Metric {name!r} must be a number or a one-element tensor, got a tensor "
                        f"of shape {tuple(value.shape)}; reduce it first (e.g. .mean())."
                    )
                value = value.detach().reshape(())
            series = self._pending.get(name)
            if series is None:
                series = self._pending[name] = _Series(smooth, check_finite, reduce, [], [])
            series.iters.append(iter)
            series.values.append(value)

    def flush(self, every_rank: bool = False) -> None:
        """Move pending values into the buffers; raise on a non-finite loss. ``every_rank``:
        every rank calls this now, so the ``reduce`` series are flushed too."""
        distributed = get_world_size() > 1
        names = [
            n for n, s in self._pending.items() if every_rank or not (distributed and s.reduce)
        ]
        if not names:
            return
        pending = {name: self._pending.pop(name) for name in names}
        if distributed and any(series.reduce for series in pending.values()):
            from .metric_flush import reduced_numbers

            numbers = reduced_numbers(pending, self._cpu.group)
        else:  # note: the one CPU-GPU sync of a log period
            numbers = dict(zip(pending, _to_host([series.values for series in pending.values()])))
        for name, series in pending.items():
            if series.check_finite and not all(map(math.isfinite, numbers[name])):
                from .metric_flush import keep_until_first_bad

                keep_until_first_bad(self, pending, numbers, self._epoch_len)
        for name, series in pending.items():
            self.extend(name, series.iters, numbers[name], series.smooth)


class _Series(NamedTuple):  # one metric's values waiting for the next flush
    smooth: bool
    check_finite: bool
    reduce: bool
    iters: list[int]
    values: list[Any]


# Reduced across ranks by max (the slowest rank sets the pace); the other metrics by mean.
_MAX_REDUCED = frozenset({"data_time", "iter_time", "amp_skipped_steps"})
#: The metrics the trainer logs itself (the losses a model returns aside).
TRAINER_METRICS = frozenset({"total_loss", "lr", "grad_norm", *_MAX_REDUCED})
#: The times the trainer logs as each log period's own mean, never smoothed.
PERIOD_TIMES = ("data_time", "iter_time")


def _has_tensor(values: list[Any]) -> bool:
    return any(map(isinstance, values, itertools.repeat(torch.Tensor)))  # at C speed


def _to_host(series: list[list[Any]]) -> list[list[float]]:
    """Each series of numbers and scalar tensors as floats, the tensors copied in one transfer."""
    with_tensors = [_has_tensor(values) for values in series]
    # each series to float32 first: stacked together, an int series would take a bfloat16's type
    stacks = [_stacked(values, None, torch.float32) for values, t in zip(series, with_tensors) if t]
    if len({stack.device for stack in stacks}) > 1:  # tensors on several devices (rare)
        stacks = [stack.cpu() for stack in stacks]
    copied = iter(torch.cat(stacks).tolist() if stacks else ())
    return [
        list(itertools.islice(copied, len(values))) if t else list(map(float, values))
        for values, t in zip(series, with_tensors)
    ]


def _stacked(values: list[Any], device: Optional[torch.device], dtype: torch.dtype) -> torch.Tensor:
    """Numbers and scalar tensors as one 1-D tensor of ``dtype`` on ``device`` (None: that of
    the first tensor among them), without a sync."""
    if not _has_tensor(values):
        return torch.tensor(list(map(float, values)), dtype=dtype, device=device)
    try:
        stacked = torch.stack(values)  # the common case: scalar tensors on one device
    except (TypeError, RuntimeError):  # numbers among them, or tensors on several devices
        device = device or next(v.device for v in values if isinstance(v, torch.Tensor))
        stacked = torch.stack([torch.as_tensor(v, dtype=dtype).to(device) for v in values])
    return stacked.to(device or stacked.device, dtype)
