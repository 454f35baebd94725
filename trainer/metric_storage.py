"""Metrics: [`MetricStorage`][], a [`HistoryBuffer`][] per name, with the values
still waiting on their device for the next log point."""

import contextlib
import itertools
import math
from collections.abc import Collection, Iterator, Mapping
from typing import Any, NamedTuple, Optional

import torch

from .distributed import CpuGroup, all_gather, get_world_size
from .history_buffer import HistoryBuffer
from .misc import check_int


class MetricStorage(Mapping):
    """A mapping from metric name to [`HistoryBuffer`][], with each metric's latest iteration.
    [`add`][] keeps scalar tensors on their device until [`flush`][] copies them in one
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
        self._recording: Optional[list[Logged]] = None  # see recording()

    def __getitem__(self, name: str) -> HistoryBuffer:
        return self._buffers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._buffers)

    def __len__(self) -> int:
        return len(self._buffers)

    def update(self, iter: Optional[int] = None, smooth: bool = True, **values: float) -> None:
        """Add one number per metric name, produced at iteration index ``iter`` (``cur_iter``,
        from 0; None: count each metric's updates). ``smooth``: whether
        [`values_maybe_smooth`][] reports the window mean or the latest value; a metric keeps
        the choice of its first update."""
        self._update(iter, smooth, values)

    def _update(self, iter: Optional[int], smooth: bool, values: dict[str, float]) -> None:
        # a dict, not keywords: a metric may be named like an argument (`smooth`)
        for name, value in values.items():
            _check_metric(name, value)
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
                f"Metric {name!r} was first logged with smooth={self._smooth[name]}, now with "
                f"smooth={smooth}; give each source of values a name of its own."
            )
        return self._buffers[name]

    def latest_iter(self, name: str) -> int:
        """The iteration index (``cur_iter``, from 0) of the latest value of ``name``."""
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
            name: {
                "buffer": buf.state_dict(),
                "iter": self._latest_iter[name],
                "smooth": self._smooth[name],
            }
            for name, buf in self._buffers.items()
        }
        return {"window_size": self._window_size, "metrics": metrics}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the content with what [`state_dict`][] returned, and drop what is pending."""
        self._window_size = state["window_size"]
        for table in (self._buffers, self._latest_iter, self._smooth, self._pending):
            table.clear()
        for name, entry in state["metrics"].items():
            self._buffer(name, entry["smooth"]).load_state_dict(entry["buffer"])  # its own window
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
        ``check_finite``) at once, as [`update`][] does; scalar tensors and the rest at the next
        [`flush`][] (a one-element tensor is reshaped and detached; what is neither a number
        nor a one-element tensor with a value raises, naming the metric)."""
        if self._recording is not None:
            options = {"smooth": smooth, "check_finite": check_finite, "reduce": reduce}
            self._recording.append((metrics, options))
            return
        if not (reduce or check_finite):
            now = {
                name: value
                for name, value in metrics.items()
                if not isinstance(value, torch.Tensor) and name not in self._pending
            }
            self._update(iter, smooth, now)
            metrics = {name: value for name, value in metrics.items() if name not in now}
        # Called every iteration, so kept lean: a detached scalar tensor (a loss) passes on its
        # metadata, never its value (a CUDA tensor's would be a sync)
        for name, value in metrics.items():
            if not isinstance(value, torch.Tensor):
                _check_metric(name, value)
            elif value.requires_grad or value.dim() or value.is_meta:
                _check_metric(name, value)
                value = value.detach().reshape(())
            series = self._pending.get(name)
            if series is None:
                series = self._pending[name] = _Series(smooth, check_finite, reduce, [], [])
            series.iters.append(iter)
            series.values.append(value)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list["Logged"]]:
        """For the block, keep what [`add`][] is given in the list yielded, as ``(metrics,
        options)``, instead of adding it: what a CUDA graph's capture logs, which each replay
        adds again."""
        self._recording = []
        try:
            yield self._recording
        finally:
            self._recording = None

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
        # note: the one CPU-GPU sync of a log period
        numbers = dict(zip(pending, _to_host([series.values for series in pending.values()])))
        reduced = {name: numbers[name] for name, series in pending.items() if series.reduce}
        if distributed and reduced:  # over the trainer's gloo group while it trains
            means = reduce_over_ranks(reduced, self._cpu.group, maximum=_MAX_REDUCED)
            numbers.update(means or {})
        for name, series in pending.items():
            if series.check_finite and not all(map(math.isfinite, numbers[name])):
                self._raise_at_first_bad(pending, numbers)
        for name, series in pending.items():
            self.extend(name, series.iters, numbers[name], series.smooth)

    def _raise_at_first_bad(
        self, pending: dict[str, "_Series"], numbers: dict[str, list[float]]
    ) -> None:
        """Add the values from before the first iteration with a non-finite ``check_finite``
        value, and raise ``FloatingPointError`` naming that iteration."""
        first_bad = min(
            it
            for name, series in pending.items()
            if series.check_finite
            for it, value in zip(series.iters, numbers[name])
            if not math.isfinite(value)
        )
        at_first_bad = {}
        for name, series in pending.items():
            iters = series.iters
            values = numbers[name]
            if first_bad in iters:
                at_first_bad[name] = values[iters.index(first_bad)]
            keep = [i for i, it in enumerate(iters) if it < first_bad]
            self.extend(name, [iters[i] for i in keep], [values[i] for i in keep], series.smooth)
        checked = [n for n, s in pending.items() if s.check_finite and n in at_first_bad]
        bad = [n for n in checked if not math.isfinite(at_first_bad[n])]
        # clip_and_step's norms: grad_norm, and grad_norm/<name> for other optimizers
        norms = [n for n in bad if n == "grad_norm" or n.startswith("grad_norm/")]
        what = "Loss"
        fix = "Lower the LR, enable clip_grad_norm, or check"
        if len(norms) == len(bad):  # clipping is on: what is left is the LR and the data
            named = "" if norms == ["grad_norm"] else f" {', '.join(norms)}"
            what = f"The gradient norm{named} (the loss was not)"
            fix = "Lower the LR, or check"
        # named by number, from 1: iteration first_bad + 1 is the (first_bad + 1)-th trained
        epoch = f" (epoch {first_bad // self._epoch_len + 1})" if self._epoch_len else ""
        raise FloatingPointError(
            f"{what} became NaN or infinite at iteration {first_bad + 1}{epoch}: "
            f"{at_first_bad}. {fix} the data of that iteration."
        )


def _check_metric(name: str, value: Any) -> None:
    """Refuse a metric ``value`` that is neither a number nor a one-element tensor that holds a
    value, from its type, shape and device: never its value (a CUDA tensor's would be a sync)."""
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise ValueError(f"Metric {name!r} is a tensor on the meta device: no value to log.")
        if value.numel() != 1:
            raise ValueError(
                f"Metric {name!r} must be a number or a one-element tensor, got {value.shape}."
            )
        return
    # a number has __float__ (bool, NumPy scalars and 0-d arrays too; a str has not)
    if not hasattr(value, "__float__") or getattr(value, "ndim", 0) != 0:
        raise TypeError(
            f"Metric {name!r} must be a number or a one-element tensor, not {value!r:.40}."
        )


Logged = tuple[dict[str, Any], dict[str, bool]]  # what add() was given: (metrics, options)


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


def reduce_over_ranks(
    totals: Optional[dict[str, list[float]]],
    group: Any = None,
    *,
    count: float = 1,
    maximum: Collection[str] = (),
    source: str = "trainer.log(reduce=True)",
) -> Optional[dict[str, list[float]]]:
    """Every rank's metrics as one, the same on every rank: the metrics logged over ranks, and
    an evaluation's results. One gather of host numbers over ``group`` (of every rank; None:
    the default group).

    Each value is the sum of the ranks' ``totals`` over the sum of their ``count``: with
    ``count=1``, the mean of the ranks' values; with sums over samples and the samples
    counted, the exact mean over every sample. Names in ``maximum`` take the ranks' maximum
    instead (the slowest rank's time). A rank without numbers (``totals`` None, or ``count``
    0) does not count; None when no rank has any. The ranks that count must give the same
    names, one value per position of each list, or every rank raises, naming ``source``.
    """
    everyone = [(totals, count)] if get_world_size() == 1 else all_gather((totals, count), group)
    given = {rank: (own, n) for rank, (own, n) in enumerate(everyone) if own is not None and n}
    if not given:
        return None
    names = {rank: sorted(own) for rank, (own, _) in given.items()}
    first = next(iter(names.values()))
    if any(ranks_names != first for ranks_names in names.values()):
        raise ValueError(f"{source} gave different names on different ranks: {names}.")
    lengths = {rank: [len(own[name]) for name in first] for rank, (own, _) in given.items()}
    if len({tuple(n) for n in lengths.values()}) > 1:
        raise ValueError(f"{source} gave {first} a different number of times by rank: {lengths}.")
    weight = math.fsum(n for _, n in given.values())
    reduced = {}
    for name in first:
        columns = zip(*(own[name] for own, _ in given.values()))  # each: every rank's value
        reduced[name] = [
            max(column) if name in maximum else math.fsum(column) / weight for column in columns
        ]
    return reduced


def _has_tensor(values: list[Any]) -> bool:
    return any(isinstance(value, torch.Tensor) for value in values)


def _to_host(series: list[list[Any]]) -> list[list[float]]:
    """Each series of numbers and scalar tensors as floats, the tensors copied in one transfer."""
    with_tensors = [_has_tensor(values) for values in series]
    # each series to float32 first: stacked together, an int series would take a bfloat16's type
    stacks = [_stacked(values) for values, t in zip(series, with_tensors) if t]
    if len({stack.device for stack in stacks}) > 1:  # tensors on several devices (rare)
        stacks = [stack.cpu() for stack in stacks]
    copied = iter(torch.cat(stacks).tolist() if stacks else ())
    return [
        list(itertools.islice(copied, len(values))) if t else list(map(float, values))
        for values, t in zip(series, with_tensors)
    ]


def _stacked(values: list[Any]) -> torch.Tensor:
    """Scalar tensors (and numbers among them) as one 1-D float32 tensor on the device of the
    first tensor, without a sync."""
    try:
        stacked = torch.stack(values)  # the common case: scalar tensors on one device
    except (TypeError, RuntimeError):  # numbers among them, or tensors on several devices
        device = next(v.device for v in values if isinstance(v, torch.Tensor))
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32).to(device) for v in values])
    return stacked.to(torch.float32)
