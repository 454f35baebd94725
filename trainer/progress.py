"""Where training is: :class:`Progress`, the resume-position mapping, and :class:`DataStream`,
the data iteration that a mid-epoch resume continues exactly."""

import dataclasses
import logging
import time
from typing import Any, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from .distributed import get_rank, get_world_size
from .seed import get_rng_state, set_rng_state

logger = logging.getLogger(__name__)

Position = tuple[int, int]  # (epoch, iterations done in it): where training goes on from


@dataclasses.dataclass
class Progress:
    """The counters of a run, kept in one place.

    ``epoch``, ``inner_iter`` and ``iter`` name the iteration running (or the last one, between
    iterations); ``position`` is where a checkpoint taken now resumes: it moves when an
    iteration or an epoch ends. ``stopped``: :meth:`Trainer.stop` was called (or the resumed
    checkpoint remembers it). ``saved``: the position and stop of the last checkpoint saved or
    loaded.
    """

    epoch_len: int
    max_iters: int
    epoch: int = 0
    inner_iter: int = 0
    iter: int = -1
    start_iter: int = 0
    position: Position = (0, 0)
    stopped: bool = False
    saved: tuple[Position, bool] = ((-1, -1), False)

    def begin_iter(self, inner_iter: int) -> None:
        self.inner_iter = inner_iter
        self.iter = self.epoch * self.epoch_len + inner_iter

    def end_iter(self) -> None:
        self.position = (self.epoch, self.inner_iter + 1)

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

    def resume(self, position: Position, stopped: bool) -> None:
        """Go on from a loaded checkpoint's ``position``."""
        self.position = position
        self.saved = (position, stopped)
        self.start_iter = min(self.max_iters, position[0] * self.epoch_len + position[1])
        self.iter = self.start_iter - 1

    def state_dict(self, batch_size: Optional[int]) -> dict[str, Any]:
        """The position as plain data, with what mapping it to another world size needs."""
        epoch, inner = self.position
        return {
            "epoch": epoch,
            "inner_iter": inner,
            "epoch_len": self.epoch_len,
            "world_size": get_world_size(),
            "batch_size": batch_size,
            "stopped": self.stopped,
        }


def map_position(
    saved: dict[str, Any], path: str, epoch_len: int, batch_size: Optional[int], accumulation: int
) -> Position:
    """Where to go on from a checkpoint's ``progress``: (epoch, iterations done in it). When the
    number of processes or the batch size changed, the iterations done are mapped by the samples
    they consumed."""
    epoch, inner, saved_len = saved["epoch"], saved["inner_iter"], saved["epoch_len"]
    before = (saved.get("world_size", get_world_size()), saved.get("batch_size"))
    now = (get_world_size(), batch_size)
    if before == now or "world_size" not in saved:  # the latter: an older checkpoint
        if saved_len != epoch_len:
            raise ValueError(
                f"Checkpoint {path!r} was saved with {saved_len} iterations per epoch, this "
                f"trainer has {epoch_len}; resume with the same data loader."
            )
        return epoch, inner
    how = f"{before[0]} processes x batches of {before[1]} to {now[0]} x {now[1]}"
    if inner in (0, saved_len):  # between epochs: nothing to map
        logger.warning(
            f"Resuming {path} with {how}, at the {'start' if inner == 0 else 'end'} of "
            f"epoch {epoch}: the data position needs no mapping."
        )
        return epoch, 0 if inner == 0 else epoch_len
    samples = [w * b * accumulation if b else None for w, b in (before, now)]
    consumed = inner * samples[0] if samples[0] else None
    if consumed is None or samples[1] is None or consumed % samples[1]:
        raise RuntimeError(
            f"Checkpoint {path!r} stopped in the middle of epoch {epoch} ({inner} of "
            f"{saved_len} iterations, {consumed or 'an unknown number of'} samples), and "
            f"this run changes from {how}: {samples[1] or 'an unknown number of'} samples "
            "per iteration cannot continue at that sample. Resume with the same number of "
            "processes and batch size, pick a batch size whose iterations divide the "
            "samples consumed, or resume from a checkpoint saved at an epoch's end."
        )
    new_inner = min(consumed // samples[1], epoch_len)
    logger.warning(
        f"Resuming {path} with {how}: epoch {epoch} stopped after {inner} iterations = "
        f"{consumed} samples, so this run goes on from iteration {new_inner} of "
        f"{epoch_len} of that epoch. With a DistributedSampler (its order depends "
        "on seed and epoch only) these are exactly the samples not yet seen; the LR "
        "schedule goes on from its saved step."
    )
    return epoch, new_inner


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

    Args:
        data_loader: A data loader, or any iterable with a length.
    """

    def __init__(self, data_loader: Any) -> None:
        self.data_loader = data_loader
        self.data_time = 0.0  # seconds spent waiting for batches, since the caller reset it
        self._iter: Optional[Any] = None
        self._pass_rng: Optional[dict[str, Any]] = None  # the RNG state the pass started with
        self._to_skip = 0
        self._restored = False  # the loader was given its state from a checkpoint
        # torchdata's StatefulDataLoader, say: checkpointed through its own state, not replayed
        self._stateful = all(
            callable(getattr(data_loader, name, None)) for name in ("state_dict", "load_state_dict")
        )

    def next_batch(self) -> Any:
        """The next batch of the current pass (a new pass starts when there is none)."""
        start = time.perf_counter()
        if self._iter is None:
            self._iter = self._start_pass()
        try:
            batch = next(self._iter)
        except StopIteration:
            raise RuntimeError(
                f"data_loader ended after fewer batches than its len() of {len(self.data_loader)}; "
                "make __len__ of the dataset or sampler match what it yields."
            ) from None
        self.data_time += time.perf_counter() - start
        return batch

    def end_pass(self) -> None:
        """Forget the current pass: the next batch starts a new one."""
        self._iter = None

    def _start_pass(self) -> Any:
        generators = self.generators()
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
        if batched:
            clone = DataLoader(loader.dataset, batch_sampler=index_sampler, **options)
        else:
            clone = DataLoader(loader.dataset, batch_size=None, sampler=index_sampler, **options)
        data_iter = iter(clone)
        index_sampler.skip_now()  # without workers the sampler draws at the first batch: now
        logger.info(f"Resuming in mid-epoch: skipped the {n} batches already trained on by index, "
                    "without loading them.")  # fmt: skip
        return data_iter

    def generators(self) -> tuple[torch.Generator, ...]:
        """The loader's and its sampler's own generators, if they have any."""
        found: list[torch.Generator] = []
        for owner in (self.data_loader, getattr(self.data_loader, "sampler", None)):
            g = getattr(owner, "generator", None)
            if isinstance(g, torch.Generator) and all(g is not f for f in found):
                found.append(g)
        return tuple(found)

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
        self._to_skip = batches_to_skip


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
