"""What a :class:`~trainer.progress.DataStream` does only to continue a pass exactly: resume
from a checkpoint, start an interrupted pass again, make a persistent loader's iterator.

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

import logging
import random
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from .distributed import get_rank, get_world_size
from .progress import DataStream, _samplers
from .rng_state import get_rng_state, set_rng_state

logger = logging.getLogger(__name__)
# Mixed into a number drawn from the data's RNG to seed another stream (any odd constant).
_WORKER_STREAM = 0x5851F42D4C957F2D
# Random number generators that a sampler may hold and checkpoints do not save.
_FOREIGN_RNGS = (random.Random, np.random.RandomState, np.random.Generator)
# What a pass over a DataLoader depends on, besides its dataset and sampler
_LOADER_OPTIONS = (
    "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
    "multiprocessing_context", "generator", "prefetch_factor", "pin_memory_device", "in_order",
)  # fmt: skip


def resume(
    stream: DataStream, per_rank: list[dict[str, Any]], path: str, to_skip: int, remapped: bool
) -> None:
    """Restore this rank's RNG state from a checkpoint's ``per_rank`` states; the next pass skips
    ``to_skip`` batches (``remapped``: a number mapped to another world or batch size)."""
    rank, world_size = get_rank(), get_world_size()
    loader = stream.data_loader
    foreign = [
        f"{type(owner).__name__}.{name} (a {type(value).__name__})"
        for owner in _samplers(loader)[1:]
        for name, value in getattr(owner, "__dict__", {}).items()
        if isinstance(value, _FOREIGN_RNGS)
    ]
    if foreign:
        logger.warning(
            f"The data loader's sampler holds {', '.join(foreign)}, whose state "
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
    set_rng_state(state["now"], stream.generators)
    stream._pass_rng = state["epoch_start"]
    stream._iter, stream._restored = None, False
    loader_state = state.get("loader") if stream._stateful and not remapped else None
    if to_skip and loader_state is not None:
        loader.load_state_dict(loader_state)
        logger.info(
            f"Resuming in mid-epoch from the state of the {type(loader).__name__}, "
            f"after the {to_skip} batches already trained on."
        )
        to_skip, stream._restored = 0, True
    elif to_skip and not stream.sized:
        logger.warning(
            f"Resuming in mid-pass over a data loader without a length or a state_dict() "
            f"(a {type(loader).__name__}): its stream starts again from the "
            f"beginning, so the {to_skip} batches of this pass already trained on "
            "come again and the run is not bit for bit as an uninterrupted one. A loader "
            "with state_dict() and load_state_dict(), such as torchdata's "
            "StatefulDataLoader, resumes exactly."
        )
        to_skip = 0
    stream._to_skip = to_skip


def make_persistent_iterator(stream: DataStream) -> None:
    """Make a persistent loader's iterator, which draws its workers' base seed, and put the RNG
    state back, so that every pass draws what a later pass draws: the first of a run and the
    first after a resume alike."""
    now = get_rng_state(stream.generators)
    # The base seed comes from a stream derived from the state: the state's own first number is
    # the first pass's shuffle seed, which would seed worker 0's RNG.
    source = getattr(stream.data_loader, "generator", None) or torch.default_generator
    drawn = int(torch.empty((), dtype=torch.int64).random_(generator=source))
    source.manual_seed(drawn ^ _WORKER_STREAM)
    iter(stream.data_loader)
    set_rng_state(now, stream.generators)
    stream._persistent_to_make = False


def replay_pass(stream: DataStream) -> Any:
    """The interrupted pass again: what starting it drew (a shuffle, the worker seeds) is drawn
    from the state it started with, then the checkpoint's state goes on."""
    now = get_rng_state(stream.generators)
    if stream._pass_rng is not None:
        set_rng_state(stream._pass_rng, stream.generators)
    if stream._restored:  # the loader was given its state: it goes on where it was
        data_iter = iter(stream.data_loader)
    else:
        data_iter = _skipping_iter(stream, stream._to_skip)  # draws what the skipped drew
    set_rng_state(now, stream.generators)
    stream._to_skip, stream._restored = 0, False
    return data_iter


def _skipping_iter(stream: DataStream, n: int) -> Any:
    """An iterator over the current pass without its first ``n`` batches."""
    loader = stream.data_loader
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
    if loader.persistent_workers:  # a later pass of the persistent loader draws no base seed
        options["generator"] = torch.Generator()
    if batched:
        clone = DataLoader(loader.dataset, batch_sampler=index_sampler, **options)
    else:
        clone = DataLoader(loader.dataset, batch_size=None, sampler=index_sampler, **options)
    data_iter = iter(clone)
    index_sampler.skip_now()  # without workers the sampler draws at the first batch: now
    logger.info(f"Resuming in mid-epoch: skipped the {n} batches already trained on by index, "
                "without loading them.")  # fmt: skip
    return data_iter


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
