"""Where training is: :class:`Progress`, and :class:`DataStream`, the data iteration that a
mid-epoch resume continues exactly."""

import collections
import dataclasses
import logging
import random
import time
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from .distributed import CpuGroup, get_rank, get_world_size
from .seed import get_rng_state, set_rng_state

logger = logging.getLogger(__name__)
# Mixed into a number drawn from the data's RNG to seed another stream (any odd constant).
_WORKER_STREAM = 0x5851F42D4C957F2D

Position = tuple[int, int]  # (epoch, iterations done in it): where training goes on from


@dataclasses.dataclass
class Progress:
    """The counters of a run, kept in one place.

    ``epoch``, ``inner_iter`` and ``iter`` name the iteration running (or the last one, between
    iterations); ``position`` is where a checkpoint taken now resumes: it moves when an
    iteration or an epoch ends. ``stopped``: :meth:`Trainer.stop` was called (or the resumed
    checkpoint remembers it). ``saved``: the position and stop of the last checkpoint saved or
    loaded. ``last_log_iter``: the last iteration that was a log point (set at log points
    only). ``epoch_len`` is None for a data loader without a length (a stream), whose epochs
    are passes that end when its iterator does. The Trainer's loop sets ``inner_iter``,
    ``iter`` and ``position`` itself at each iteration (attribute writes, no calls).
    """

    epoch_len: Optional[int]
    max_iters: int
    epoch: int = 0
    inner_iter: int = 0
    iter: int = -1
    start_iter: int = 0
    epoch_start: int = 0  # the iterations done before the current epoch
    position: Position = (0, 0)
    stopped: bool = False
    saved: tuple[Position, bool] = ((-1, -1), False)
    last_log_iter: int = -1

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
    """Passes over a data loader, one per epoch, that a mid-epoch resume continues exactly.

    A pass remembers the RNG state it started with. Resuming in mid-epoch starts the interrupted
    pass again from that state, so its shuffle and worker seeds are the same, without the
    consumed batches, then goes back to the RNG state of the checkpoint. With torch's
    ``DataLoader`` over a map-style dataset the consumed batches are skipped by index: their
    indices are drawn as before, their samples are never loaded. Any other loader (a custom
    ``batch_sampler``, a ``DataLoader`` subclass, an iterable) loads them and drops them, which
    one log line says. A list or tuple of batches draws no random numbers, so its passes
    remember no state.

    A data loader without a length (an ``IterableDataset`` without ``__len__``: a stream) has
    passes that end when its iterator does, which :meth:`has_next` finds out. Resuming in
    mid-pass goes on from the loader's own state where it has one; otherwise the stream starts
    again, with a warning.

    Args:
        data_loader: A data loader, or any iterable.
        cpu: The trainer's gloo group, over which a stream's ranks agree on a pass's end.
    """

    def __init__(self, data_loader: Any, cpu: Optional[CpuGroup] = None) -> None:
        self.data_loader = data_loader
        self.data_time = 0.0  # seconds spent waiting for batches, since the caller reset it
        self.sized = loader_length(data_loader) is not None
        self.pass_ended = False  # a stream's pass ended (has_next said so)
        self._ahead: collections.deque = collections.deque()  # a stream's batches fetched early
        self._drawn = 0  # batches drawn from the current pass (counted for streams)
        self._cpu = cpu or CpuGroup()  # the trainer's gloo group: a stream's ranks agree on its end
        self._iter: Optional[Any] = None
        self._pass_rng: Optional[dict[str, Any]] = None  # the RNG state the pass started with
        self._to_skip = 0
        self._restored = False  # the loader was given its state from a checkpoint
        self._restored_pass = False  # the current pass went on from such a state
        # torchdata's StatefulDataLoader, say: checkpointed through its own state, not replayed
        self._stateful = all(
            callable(getattr(data_loader, name, None)) for name in ("state_dict", "load_state_dict")
        )
        self._generators, self._foreign_rngs = _generators_of(data_loader)
        # A loader with persistent workers makes its iterator once, drawing the workers' base
        # seed then; its later passes draw only what the sampler draws.
        self._persistent = bool(getattr(data_loader, "persistent_workers", False)) and (
            getattr(data_loader, "num_workers", 0) > 0
        )
        self._persistent_made = False  # this stream made the persistent iterator
        self._cloned = False  # the pass runs on a clone of the loader (a mid-pass replay)

    def next_batch(self) -> Any:
        """The next batch of the current pass (a new pass starts when there is none)."""
        if self._ahead:
            return self._ahead.popleft()
        start = time.perf_counter()
        if self._iter is None:
            self._iter = self._start_pass()
        try:
            batch = next(self._iter)
        except StopIteration:
            if not self.sized:
                raise RuntimeError(
                    "data_loader's pass ended inside an iteration: train_one_iter asked for more "
                    "batches than accumulation_steps, which is what an iteration fetches ahead "
                    "from a data loader without a length. Pass that many accumulation_steps."
                ) from None
            raise RuntimeError(
                f"data_loader ended after fewer batches than its len() of {len(self.data_loader)}; "
                "make __len__ of the dataset or sampler match what it yields."
            ) from None
        self.data_time += time.perf_counter() - start
        return batch

    def has_next(self, n: int) -> bool:
        """Whether the current pass has the ``n`` batches of another iteration: always, with a
        length (epochs are then counted in iterations). A stream's batches are fetched now to
        find out (:meth:`next_batch` returns them); a pass that ends with fewer drops them, as a
        loader with a length drops what is left over. Under torchrun every rank ends the pass
        when one rank's ends (a CPU flag over gloo, no device sync)."""
        if self.sized:
            return True
        start = time.perf_counter()
        if self._iter is None:
            self._iter = self._start_pass()
        while len(self._ahead) < n:
            batch = next(self._iter, _END)
            if batch is _END:
                break
            self._ahead.append(batch)
            self._drawn += 1
        self.data_time += time.perf_counter() - start
        full = len(self._ahead) == n
        if get_world_size() > 1:
            full = self._on_every_rank(full)
        if not full:
            if self._drawn < n and not self._restored_pass:
                raise RuntimeError(
                    f"data_loader yielded {self._drawn} batches in a pass, fewer than the "
                    f"{n} of one iteration (accumulation_steps). A generator yields once only: "
                    "pass an iterable whose __iter__ starts a new pass (a DataLoader, say)."
                )
            self._ahead.clear()
            self.pass_ended = True
        return full

    def _on_every_rank(self, flag: bool) -> bool:
        everyone = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self._cpu.group)
        return bool(everyone.item())

    def release(self) -> None:
        """Drop the pass in progress and shut its worker processes down now (after a failure:
        a rerun resumes from a checkpoint). A loader with persistent workers keeps its own."""
        data_iter, self._iter = self._iter, None
        self._ahead.clear()
        if data_iter is not None and not (self._persistent and not self._cloned):
            # what the iterator's __del__ does, which a traceback holding it would delay
            shutdown = getattr(data_iter, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()

    def end_pass(self) -> None:
        """Forget the current pass: the next batch starts a new one."""
        self._iter, self.pass_ended, self._drawn = None, False, 0
        self._ahead.clear()

    def _start_pass(self) -> Any:
        generators = self.generators()
        if self._persistent and not self._persistent_made:
            # Made now and the RNG state put back, so that every pass draws what a later pass of
            # a persistent loader draws: the first of a run, and the first after a resume alike.
            # Its workers' base seed comes from a stream derived from the state: the state's own
            # first number is the first pass's shuffle seed, which would seed worker 0's RNG.
            now = get_rng_state(generators)
            source = getattr(self.data_loader, "generator", None) or torch.default_generator
            drawn = int(torch.empty((), dtype=torch.int64).random_(generator=source))
            source.manual_seed(drawn ^ _WORKER_STREAM)
            iter(self.data_loader)
            set_rng_state(now, generators)
            self._persistent_made = True
        self._restored_pass, self._cloned = self._restored, False
        if self._to_skip or self._restored:
            # the interrupted pass again: what starting it drew (a shuffle, the worker seeds) is
            # drawn from the state it started with, then the checkpoint's state goes on
            now = get_rng_state(generators)
            if self._pass_rng is not None:
                set_rng_state(self._pass_rng, generators)
            if self._restored:  # the loader was given its state: it goes on where it was
                data_iter = iter(self.data_loader)
            else:
                data_iter = self._skipping_iter(self._to_skip)  # draws what the skipped drew
            set_rng_state(now, generators)
            self._to_skip, self._restored = 0, False
            return data_iter
        # A pass over a sequence draws no random numbers: nothing to replay (and capturing the
        # state costs 50 to 200 us, a noticeable share of a short epoch of small batches).
        sequence = isinstance(self.data_loader, (list, tuple))
        self._pass_rng = None if sequence else get_rng_state(generators)
        return iter(self.data_loader)

    def _skipping_iter(self, n: int) -> Any:
        """An iterator over the current pass without its first ``n`` batches."""
        loader = self.data_loader
        why_not = _why_not_skippable(loader)
        if why_not is not None:
            logger.info(f"Resuming in mid-epoch: {why_not}, so the {n} batches already trained "
                        "on are loaded again and dropped.")  # fmt: skip
            data_iter = iter(loader)
            for _ in range(n):
                next(data_iter)
            return data_iter
        batched = loader.batch_sampler is not None
        index_sampler = _SkipFirst(loader.batch_sampler if batched else loader.sampler, n)
        options = {name: getattr(loader, name) for name in _LOADER_OPTIONS if hasattr(loader, name)}
        if loader.num_workers == 0:
            options.pop("prefetch_factor", None)  # refused without workers
        options["persistent_workers"] = False  # this loader serves one pass
        if self._persistent:  # a later pass of the persistent loader draws no base seed
            options["generator"] = torch.Generator()
        if batched:
            clone = DataLoader(loader.dataset, batch_sampler=index_sampler, **options)
        else:
            clone = DataLoader(loader.dataset, batch_size=None, sampler=index_sampler, **options)
        data_iter = iter(clone)
        self._cloned = True
        index_sampler.skip_now()  # without workers the sampler draws at the first batch: now
        logger.info(f"Resuming in mid-epoch: skipped the {n} batches already trained on by index, "
                    "without loading them.")  # fmt: skip
        return data_iter

    def generators(self) -> tuple[torch.Generator, ...]:
        """The generators of the loader, its sampler and batch sampler, and the samplers these
        wrap (a ``BatchSampler`` over a ``RandomSampler(generator=g)``, say)."""
        return self._generators

    def rng_state(self, mid_pass: bool) -> dict[str, Any]:
        """Every RNG's state now, the state the pass started with when ``mid_pass``, and then
        too the state of a loader that keeps its own (``state_dict()``)."""
        state = {
            "now": get_rng_state(self.generators()),
            "epoch_start": self._pass_rng if mid_pass else None,
        }
        if self._stateful:
            state["loader"] = self.data_loader.state_dict() if mid_pass else None
        return state

    def resume(
        self, per_rank: list[dict[str, Any]], path: str, batches_to_skip: int, remapped: bool
    ) -> None:
        """Restore this rank's RNG state from a checkpoint; the next pass goes on after
        ``batches_to_skip`` batches of the interrupted one (``remapped``: that number was mapped
        to another world or batch size). A loader that keeps its own state is given it back."""
        rank, world_size = get_rank(), get_world_size()
        if self._foreign_rngs:
            logger.warning(
                f"The data loader's sampler holds {', '.join(self._foreign_rngs)}, whose state "
                "checkpoints do not save: its order after this resume may differ from an "
                "uninterrupted run's. For an exact resume, draw from torch's RNG or from a "
                "torch.Generator held as the sampler's `generator`."
            )
        if len(per_rank) != world_size:
            logger.warning(
                f"Checkpoint {path} was saved by {len(per_rank)} ranks, resuming with "
                f"{world_size}: rank {rank} takes the RNG state of rank {rank % len(per_rank)}, "
                "so the run goes on but not bit for bit as before."
            )
        state = per_rank[rank % len(per_rank)]
        set_rng_state(state["now"], self.generators())
        self._pass_rng = state["epoch_start"]
        self._iter, self._restored = None, False
        loader_state = state.get("loader") if self._stateful and not remapped else None
        if batches_to_skip and loader_state is not None:
            self.data_loader.load_state_dict(loader_state)
            logger.info(
                f"Resuming in mid-epoch from the state of the {type(self.data_loader).__name__}, "
                f"after the {batches_to_skip} batches already trained on."
            )
            batches_to_skip, self._restored = 0, True
        elif batches_to_skip and not self.sized:
            logger.warning(
                f"Resuming in mid-pass over a data loader without a length or a state_dict() "
                f"(a {type(self.data_loader).__name__}): its stream starts again from the "
                f"beginning, so the {batches_to_skip} batches of this pass already trained on "
                "come again and the run is not bit for bit as an uninterrupted one. A loader "
                "with state_dict() and load_state_dict(), such as torchdata's "
                "StatefulDataLoader, resumes exactly."
            )
            batches_to_skip = 0
        self._to_skip = batches_to_skip


_END = object()  # what next() returns at the end of a pass


# Random number generators that a sampler may hold and checkpoints do not save.
_FOREIGN_RNGS = (random.Random, np.random.RandomState, np.random.Generator)


def _generators_of(data_loader: Any) -> tuple[tuple[torch.Generator, ...], list[str]]:
    """The ``generator`` of ``data_loader`` and of its ``sampler`` and ``batch_sampler``, and of
    theirs, breadth first, each once; and the other kinds of generators these samplers hold, as
    ``Sampler.attribute (type)``."""
    found: list[torch.Generator] = []
    foreign: list[str] = []
    owners, seen = [data_loader], set()
    while owners:
        owner = owners.pop(0)
        if owner is None or id(owner) in seen:
            continue
        seen.add(id(owner))
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
        if owner is not data_loader:
            foreign += [
                f"{type(owner).__name__}.{name} (a {type(value).__name__})"
                for name, value in getattr(owner, "__dict__", {}).items()
                if isinstance(value, _FOREIGN_RNGS)
            ]
        owners += [getattr(owner, name, None) for name in ("sampler", "batch_sampler")]
    return tuple(found), foreign


def loader_length(data_loader: Any) -> Optional[int]:
    """``len(data_loader)``, or None when it has none (a DataLoader over an IterableDataset
    without ``__len__`` has the method, which raises)."""
    try:
        return len(data_loader)
    except TypeError:
        return None


# What a pass over a DataLoader depends on, besides its dataset and sampler
_LOADER_OPTIONS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
    "multiprocessing_context", "generator", "prefetch_factor", "pin_memory_device", "in_order",
)  # fmt: skip


def _why_not_skippable(loader: Any) -> Optional[str]:
    """Why the batches of ``loader`` cannot be skipped by index; None when they can."""
    if type(loader) is not DataLoader:
        return f"the data loader is a {type(loader).__name__}, not a torch DataLoader"
    if isinstance(loader.dataset, IterableDataset):
        return "the dataset is an IterableDataset, which has no indices to skip"
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        return f"its batch_sampler is a {type(loader.batch_sampler).__name__}, not a BatchSampler"
    return None


class _SkipFirst(Sampler):
    """The indices (or index batches) of ``sampler`` without the first ``n``. They are drawn
    all the same, so the sampler's random numbers are drawn as in a full pass."""

    def __init__(self, sampler: Any, n: int) -> None:
        self.sampler, self.n = sampler, n
        self._latest: Optional[_Skipping] = None

    def __iter__(self) -> "_Skipping":
        self._latest = _Skipping(iter(self.sampler), self.n)
        return self._latest

    def __len__(self) -> int:
        return max(len(self.sampler) - self.n, 0)

    def skip_now(self) -> None:
        """Draw the skipped indices now rather than at the first batch."""
        if self._latest is not None:
            self._latest.skip()


class _Skipping:
    def __init__(self, indices: Any, n: int) -> None:
        self._indices, self._n = indices, n

    def skip(self) -> None:
        for _ in range(self._n):
            next(self._indices, None)
        self._n = 0

    def __iter__(self) -> "_Skipping":
        return self

    def __next__(self) -> Any:
        if self._n:
            self.skip()
        return next(self._indices)
