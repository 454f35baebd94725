"""The data a run trains on: [`DataStream`][], passes over a data loader (any iterable) that a
mid-epoch resume continues exactly, its [`UnsizedDataStream`][] for a loader without a length,
and the state of every random number generator that training depends on.

A pass that runs its course ends as ``for batch in loader`` does: its left-over batches (fewer than
an iteration takes) are drawn, and its end, where a sampler with a generator of its own draws once
more, so every epoch's order is the loop's.

A pass remembers the RNG state it started with. Resuming in mid-epoch starts the interrupted pass
again from that state, so its shuffle and worker seeds are the same, without the consumed
batches, then goes back to the RNG state of the checkpoint. With torch's ``DataLoader`` over a
map-style dataset the consumed batches are skipped by index: their indices are drawn as before,
their samples are never loaded. Any other loader (a custom ``batch_sampler``, a ``DataLoader``
subclass, an iterable) loads them and drops them, which one log line says. A list or tuple of
batches draws no random numbers, so its passes remember no state. A stream (no length) goes on
from the loader's own state where it has one (``state_dict()``); otherwise it starts again, with
a warning.
"""

import collections
import itertools
import logging
import random
import time
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from .distributed import CpuGroup, get_rank, get_world_size

logger = logging.getLogger(__name__)

# Mixed into a number drawn from the data's RNG to seed another stream (any odd constant).
_WORKER_STREAM = 0x5851F42D4C957F2D
# Random number generators that a sampler may hold and checkpoints do not save.
_FOREIGN_RNGS = (random.Random, np.random.RandomState, np.random.Generator)
# What a pass over a DataLoader depends on, besides its dataset and sampler
_LOADER_OPTIONS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "prefetch_factor",
    "pin_memory_device",
    "in_order",
)


class DataStream:
    """Passes over a data loader (any iterable), one per epoch, that a mid-epoch resume continues
    exactly ([`resume`][]); [`data_stream`][] makes one. ``cpu``: the trainer's gloo group.
    """

    sized = True  # False for an UnsizedDataStream, whose has_next() ends its passes
    pass_ended = False  # an UnsizedDataStream's pass ended (has_next said so)

    def __init__(self, data_loader: Any, cpu: Optional[CpuGroup] = None) -> None:
        self.data_loader = data_loader
        self.data_time = 0.0  # seconds spent waiting for batches, in all
        self._cpu = cpu or CpuGroup()
        self._iter: Optional[Any] = None
        self._ahead: collections.deque = collections.deque()  # batches to give before the pass's
        # the RNG state the pass's sampler started from: the pass's start, but for the workers'
        # base seed that a persistent loader's first pass draws before it
        self._pass_rng: Optional[dict[str, Any]] = None
        self._to_skip = 0
        self._restored = False  # the loader was given its state from a checkpoint
        # torchdata's StatefulDataLoader, say: checkpointed through its own state, not replayed
        self._stateful = all(
            callable(getattr(data_loader, name, None)) for name in ("state_dict", "load_state_dict")
        )
        # the generators of the loader, its samplers and the samplers these wrap, each once
        found = [getattr(owner, "generator", None) for owner in _samplers(data_loader)]
        self.generators = tuple(dict.fromkeys(g for g in found if isinstance(g, torch.Generator)))
        # A loader with persistent workers makes its iterator once, at its first pass, which
        # draws the workers' base seed before its sampler draws; its later passes draw only what
        # the sampler draws. A resumed run makes it drawing nothing (the run it resumes did not).
        persistent = getattr(data_loader, "persistent_workers", False)
        self._persistent_to_make = bool(persistent) and getattr(data_loader, "num_workers", 0) > 0
        self._resumed = False

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
            if self.sized:
                raise RuntimeError(
                    f"data_loader yielded fewer batches than its len(), {len(self.data_loader)}: "
                    "make the dataset's or sampler's __len__ match what it yields."
                ) from None
            # a loader without a length: an iteration fetches accumulation_steps batches ahead
            raise RuntimeError(
                "train_one_iter took more batches than accumulation_steps from a data_loader "
                "without a length: take that many per iteration, or raise accumulation_steps."
            ) from None
        self.data_time += time.perf_counter() - start
        return batch

    def has_next(self, n: int) -> bool:
        """Whether the pass has another iteration's ``n`` batches: always, with a length."""
        return True

    def put_back(self, batches: list[Any]) -> None:
        """Give ``batches`` at the next calls of [`next_batch`][], before the pass's own."""
        self._ahead.extendleft(reversed(batches))

    def release(self) -> None:
        """Drop the pass and shut its worker processes down now (unless persistent): after a
        failure, or at the end of a pass cut short."""
        self._ahead.clear()
        data_iter, self._iter = self._iter, None
        if not getattr(data_iter, "_persistent_workers", False):
            # what the iterator's __del__ does, which a traceback (or a StatefulDataLoader, which
            # keeps its last iterator) holding it would delay
            shutdown = getattr(data_iter, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()

    def end_pass(self, left_over: Optional[int] = None) -> None:
        """End the current pass: the next batch starts a new one. ``left_over``: for a pass that
        ran its course, the batches no iteration took (fewer than ``accumulation_steps``); they
        and the pass's end are drawn, as a for loop does, where a sampler with a generator of
        its own draws once more. None for a pass cut short (``max_iters``) or ended already (a
        stream's). Its workers are shut down (unless persistent), also where a loader yields
        more than its length."""
        if left_over is not None:
            start = time.perf_counter()
            if self._iter is None:  # resumed at the pass's last iteration: the pass again
                self._iter = self._start_pass()
            for _ in itertools.islice(self._iter, left_over + 1):
                pass
            self.data_time += time.perf_counter() - start
        self.release()

    def _start_pass(self) -> Any:
        if self._persistent_to_make and self._resumed:
            self._make_persistent_iterator()
        if self._to_skip or self._restored:
            return self._replay_pass()
        # A pass over a sequence draws no random numbers: nothing to replay (and capturing the
        # state costs 50 to 200 us, a noticeable share of a short epoch of small batches).
        sequence = isinstance(self.data_loader, (list, tuple))
        self._pass_rng = None if sequence else get_rng_state(self.generators)
        if self._persistent_to_make:  # the run's first pass makes the iterator, as a loop does:
            # it draws the workers' base seed, then its sampler draws, where a replay starts
            start = self._pass_rng
            _draw_base_seed(self.data_loader)
            self._pass_rng = get_rng_state(self.generators)
            set_rng_state(start, self.generators)
            self._persistent_to_make = False
        return iter(self.data_loader)

    def rng_state(self, mid_pass: bool) -> dict[str, Any]:
        """Every RNG's state now and, ``mid_pass``, the pass's at its start and the state of a
        loader that keeps its own (``state_dict()``)."""
        state: dict[str, Any] = {"now": get_rng_state(self.generators)}
        state["epoch_start"] = self._pass_rng if mid_pass else None
        if self._stateful:
            state["loader"] = self.data_loader.state_dict() if mid_pass else None
        return state

    def resume(
        self, per_rank: list[dict[str, Any]], path: str, to_skip: int, remapped: bool
    ) -> None:
        """Restore this rank's RNG state from a checkpoint's ``per_rank`` states; the next pass
        skips ``to_skip`` batches (``remapped``: a number mapped to another world or batch
        size)."""
        rank = get_rank()
        world_size = get_world_size()
        loader = self.data_loader
        foreign = [
            f"{type(owner).__name__}.{name} (a {type(value).__name__})"
            for owner in _samplers(loader)[1:]
            for name, value in getattr(owner, "__dict__", {}).items()
            if isinstance(value, _FOREIGN_RNGS)
        ]
        if foreign:
            logger.warning(
                f"The data loader's sampler holds {', '.join(foreign)}, which checkpoints do not "
                "save, so its order may differ after this resume (a torch.Generator would not)."
            )
        if len(per_rank) != world_size:
            logger.warning(
                f"Checkpoint {path} was saved by {len(per_rank)} ranks, resuming with "
                f"{world_size}: the run goes on, not bit for bit as before."
            )
        state = per_rank[rank % len(per_rank)]
        set_rng_state(state["now"], self.generators)
        self._resumed = True
        self._pass_rng = state["epoch_start"]
        self._iter = None
        self._restored = False
        loader_state = state.get("loader") if self._stateful and not remapped else None
        if to_skip and loader_state is not None:
            loader.load_state_dict(loader_state)
            logger.info(
                f"Resuming in mid-epoch from the state of the {type(loader).__name__}, "
                f"after the {to_skip} batches already trained on."
            )
            to_skip = 0
            self._restored = True
        elif to_skip and not self.sized:
            logger.warning(
                f"Resuming in mid-pass over a {type(loader).__name__} without a length or a "
                f"state_dict(): its stream starts again, and the {to_skip} batches already "
                "trained on come again (torchdata's StatefulDataLoader would resume exactly)."
            )
            to_skip = 0
        self._to_skip = to_skip

    def _make_persistent_iterator(self) -> None:
        """Make a resumed run's persistent iterator, which draws its workers' base seed, and put
        the RNG state back: the run it resumes had made it, so its passes go on drawing only what
        the sampler draws."""
        now = get_rng_state(self.generators)
        # The base seed comes from a stream derived from the state: the state's own first number is
        # the next pass's shuffle seed, which would seed worker 0's RNG.
        drawn = _draw_base_seed(self.data_loader)
        _base_seed_source(self.data_loader).manual_seed(drawn ^ _WORKER_STREAM)
        iter(self.data_loader)
        set_rng_state(now, self.generators)
        self._persistent_to_make = False

    def _replay_pass(self) -> Any:
        """The interrupted pass again: what starting it drew (a shuffle, the worker seeds) is drawn
        from the state it started with, then the checkpoint's state goes on."""
        now = get_rng_state(self.generators)
        if self._pass_rng is not None:
            set_rng_state(self._pass_rng, self.generators)
        if self._restored:  # the loader was given its state: it goes on where it was
            data_iter = iter(self.data_loader)
        else:
            data_iter = self._skipping_iter(self._to_skip)  # draws what the skipped drew
        set_rng_state(now, self.generators)
        self._to_skip = 0
        self._restored = False
        return data_iter

    def _skipping_iter(self, n: int) -> Any:
        """An iterator over the current pass without its first ``n`` batches."""
        loader = self.data_loader
        why_not = _why_not_skippable(loader)
        if why_not is not None:
            logger.info(
                f"Resuming in mid-epoch: {why_not}, so the {n} batches already trained on are "
                "loaded again and dropped."
            )
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
        if loader.persistent_workers:  # a later pass of the persistent loader draws no base seed
            options["generator"] = torch.Generator()
        if batched:
            clone = DataLoader(loader.dataset, batch_sampler=index_sampler, **options)
        else:
            clone = DataLoader(loader.dataset, batch_size=None, sampler=index_sampler, **options)
        data_iter = iter(clone)
        index_sampler.skip_now()  # without workers the sampler draws at the first batch: now
        logger.info(
            f"Resuming in mid-epoch: skipped the {n} batches already trained on by index, "
            "without loading them."
        )
        return data_iter


_END = object()  # what next() returns at the end of a pass


class UnsizedDataStream(DataStream):
    """Passes that end when the loader's iterator does, which [`has_next`][] finds out by
    fetching an iteration's batches ahead."""

    sized = False

    def __init__(self, data_loader: Any, cpu: Optional[CpuGroup] = None) -> None:
        super().__init__(data_loader, cpu)
        self._drawn = 0  # batches drawn from the current pass
        self._restored_pass = False  # the current pass went on from the loader's own state

    def has_next(self, n: int) -> bool:
        """Whether the current pass has the ``n`` batches of another iteration, fetched now
        ([`next_batch`][DataStream.next_batch] returns them); a pass that ends with fewer
        drops them, as a loader with a length drops what is left over. Under torchrun every
        rank ends the pass when one rank's ends (a CPU flag over gloo, no device sync)."""
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
            everyone = torch.tensor([int(full)], dtype=torch.int32)
            dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self._cpu.group)
            full = bool(everyone.item())
        if not full:
            if self._drawn < n and not self._restored_pass:  # a generator's second pass, say
                raise RuntimeError(
                    f"data_loader yielded {self._drawn} batches in a pass: is it a generator?"
                )
            self._ahead.clear()
            self.pass_ended = True
        return full

    def end_pass(self, left_over: Optional[int] = None) -> None:
        self._drawn = 0
        self.pass_ended = False
        super().end_pass(left_over)

    def _start_pass(self) -> Any:
        self._restored_pass = self._restored
        return super()._start_pass()


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
    a length, as [`loader_length`][] tells)."""
    return DataStream(data_loader, cpu) if sized else UnsizedDataStream(data_loader, cpu)


def _base_seed_source(loader: Any) -> torch.Generator:
    """The generator a DataLoader's iterator draws its workers' base seed from."""
    return getattr(loader, "generator", None) or torch.default_generator


def _draw_base_seed(loader: Any) -> int:
    """Draw a number as a DataLoader's new iterator draws its workers' base seed."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=_base_seed_source(loader)))


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
        self.sampler = sampler
        self.n = n
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
        self._indices = indices
        self._n = n

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


def get_rng_state(extra_generators: tuple[torch.Generator, ...] = ()) -> dict[str, Any]:
    """The state of every RNG that training depends on, as plain data and tensors (loadable with
    ``weights_only=True``); [`set_rng_state`][] restores it."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "generators": [g.get_state() for g in extra_generators],
    }


def set_rng_state(
    state: dict[str, Any], extra_generators: tuple[torch.Generator, ...] = ()
) -> None:
    """Restore what [`get_rng_state`][] returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for g, g_state in zip(extra_generators, state["generators"]):
        g.set_state(g_state)
