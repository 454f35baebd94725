"""Where training is: :class:`Progress`, and :class:`DataStream`, the data passes that a
mid-epoch resume continues exactly."""

import dataclasses
import time
from typing import Any, Optional

import torch

from .distributed import CpuGroup, get_world_size
from .rng_state import get_rng_state

Position = tuple[int, int]  # (epoch, iterations done in it): where training goes on from


@dataclasses.dataclass
class Progress:
    """The counters of a run. ``epoch``, ``inner_iter`` and ``iter`` name the iteration running
    (or the last one); ``position``, where a checkpoint taken now resumes, moves when an iteration
    or an epoch ends. ``epoch_len`` is None for a loader without a length (epochs are its passes).
    """

    epoch_len: Optional[int]
    max_iters: int
    epoch: int = 0
    inner_iter: int = 0
    iter: int = -1
    start_iter: int = 0
    epoch_start: int = 0  # the iterations done before the current epoch
    position: Position = (0, 0)
    stopped: bool = False  # Trainer.stop was called (or the resumed checkpoint remembers it)
    saved: tuple[Position, bool] = ((-1, -1), False)  # the last checkpoint's position and stop
    last_log_iter: int = -1  # the last iteration that was a log point
    data_seconds: float = 0.0  # waiting for batches in this train(), up to the last log point

    def begin_epoch(self, epoch: int) -> int:
        """Enter ``epoch``; returns the iterations of it already done (when resuming)."""
        done = self.position[1] if self.position[0] == epoch else 0
        self.epoch, self.epoch_start = epoch, self.iter + 1 - done
        return done

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

    def end_epoch(self) -> None:
        self.position = (self.epoch + 1, 0)

    def mark_saved(self) -> None:
        self.saved = (self.position, self.stopped)

    @property
    def is_saved(self) -> bool:
        """Whether the last checkpoint holds exactly this position and stop."""
        return self.saved == (self.position, self.stopped)

    def stay_stopped(self, continue_after_stop: bool) -> bool:
        """At the start of a run: whether it resumed where :meth:`Trainer.stop` ended one and so
        stays stopped (unless ``continue_after_stop``)."""
        self.stopped = self.saved == (self.position, True) and not continue_after_stop
        return self.stopped

    def resume(self, position: Position, stopped: bool, iters_done: int) -> None:
        """Go on from a loaded checkpoint's ``position``, after ``iters_done`` iterations (for a
        stream; with a length they follow from the position)."""
        self.position = position
        self.saved = (position, stopped)
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


class DataStream:
    """Passes over a data loader (any iterable), one per epoch, that a mid-epoch resume continues
    exactly (``data_resume.py``); :func:`data_stream` makes one. ``cpu``: the trainer's gloo group.
    """

    sized = True  # False for an UnsizedDataStream, whose has_next() ends its passes
    pass_ended = False  # an UnsizedDataStream's pass ended (has_next said so)

    def __init__(self, data_loader: Any, cpu: Optional[CpuGroup] = None) -> None:
        self.data_loader = data_loader
        self.data_time = 0.0  # seconds spent waiting for batches, since the caller reset it
        self._cpu = cpu or CpuGroup()
        self._iter: Optional[Any] = None
        self._pass_rng: Optional[dict[str, Any]] = None  # the RNG state the pass started with
        self._to_skip = 0
        self._restored = False  # the loader was given its state from a checkpoint
        # torchdata's StatefulDataLoader, say: checkpointed through its own state, not replayed
        self._stateful = all(
            callable(getattr(data_loader, name, None)) for name in ("state_dict", "load_state_dict")
        )
        # the generators of the loader, its samplers and the samplers these wrap, each once
        found = [getattr(owner, "generator", None) for owner in _samplers(data_loader)]
        self.generators = tuple(dict.fromkeys(g for g in found if isinstance(g, torch.Generator)))
        # A loader with persistent workers makes its iterator once, drawing the workers' base
        # seed then; its later passes draw only what the sampler draws.
        persistent = getattr(data_loader, "persistent_workers", False)
        self._persistent_to_make = bool(persistent) and getattr(data_loader, "num_workers", 0) > 0

    def next_batch(self) -> Any:
        """The next batch of the current pass (a new pass starts when there is none)."""
        start = time.perf_counter()
        if self._iter is None:
            self._iter = self._start_pass()
        try:
            batch = next(self._iter)
        except StopIteration:
            raise RuntimeError(self._ended_early()) from None
        self.data_time += time.perf_counter() - start
        return batch

    def _ended_early(self) -> str:
        return (
            f"data_loader ended after fewer batches than its len() of {len(self.data_loader)}; "
            "make __len__ of the dataset or sampler match what it yields."
        )

    def has_next(self, n: int) -> bool:
        """Whether the pass has another iteration's ``n`` batches: always, with a length."""
        return True

    def release(self) -> None:
        """After a failure, drop the pass and shut its worker processes down now (unless
        persistent)."""
        data_iter, self._iter = self._iter, None
        if not getattr(data_iter, "_persistent_workers", False):
            # what the iterator's __del__ does, which a traceback holding it would delay
            shutdown = getattr(data_iter, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()

    def end_pass(self) -> None:
        """Forget the current pass: the next batch starts a new one."""
        self._iter = None

    def _start_pass(self) -> Any:
        if self._persistent_to_make:
            from .data_resume import make_persistent_iterator

            make_persistent_iterator(self)
        if self._to_skip or self._restored:
            from .data_resume import replay_pass

            return replay_pass(self)
        # A pass over a sequence draws no random numbers: nothing to replay (and capturing the
        # state costs 50 to 200 us, a noticeable share of a short epoch of small batches).
        sequence = isinstance(self.data_loader, (list, tuple))
        self._pass_rng = None if sequence else get_rng_state(self.generators)
        return iter(self.data_loader)

    def rng_state(self, mid_pass: bool) -> dict[str, Any]:
        """Every RNG's state now and, ``mid_pass``, the pass's at its start and the state of a
        loader that keeps its own (``state_dict()``)."""
        state: dict[str, Any] = {"now": get_rng_state(self.generators)}
        state["epoch_start"] = self._pass_rng if mid_pass else None
        if self._stateful:
            state["loader"] = self.data_loader.state_dict() if mid_pass else None
        return state


def _samplers(data_loader: Any) -> list[Any]:
    """``data_loader``, its ``sampler`` and ``batch_sampler``, theirs, ..., breadth first."""
    found: list[Any] = []
    queue = [data_loader]
    while queue:
        owner = queue.pop(0)
        if owner is not None and all(owner is not seen for seen in found):
            found.append(owner)
            queue += [getattr(owner, name, None) for name in ("sampler", "batch_sampler")]
    return found


def loader_length(data_loader: Any) -> Optional[int]:
    """``len(data_loader)``, or None when it has none (a DataLoader over an IterableDataset
    without ``__len__`` has the method, which raises)."""
    try:
        return len(data_loader)
    except TypeError:
        return None


def data_stream(data_loader: Any, cpu: Optional[CpuGroup], *, sized: bool) -> DataStream:
    """The passes over ``data_loader``: an ``UnsizedDataStream`` unless ``sized`` (the loader has
    a length, as :func:`loader_length` tells)."""
    if not sized:
        from .unsized_stream import UnsizedDataStream

        return UnsizedDataStream(data_loader, cpu)
    return DataStream(data_loader, cpu)
