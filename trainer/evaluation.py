"""Exact evaluation: the mean of per-sample metrics over a data set, each sample counted once,
in one process or shared among the ranks under torchrun."""

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import (
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from .distributed import get_rank, get_world_size, is_sharded, raise_on_every_rank
from .metric_storage import reduce_over_ranks

MetricFn = Callable[[nn.Module, Any], dict[str, torch.Tensor]]
# Samplers that draw their order from the RNG, which differs by rank.
_SHUFFLING = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def evaluate(
    model: nn.Module, data_loader: Any, metric_fn: MetricFn, group: Any = None
) -> dict[str, float]:
    """The mean of ``metric_fn(model, batch)``'s per-sample values over every sample of
    ``data_loader``, each counted once; see [`Trainer.evaluate`][].

    Under torchrun every rank calls it. A ``DistributedSampler`` gives each rank its shard, and
    the samples it repeats to make the shards equal are not counted; any other loader is shared:
    rank r evaluates batches r, r + world_size, ... . The sums stay on the device until the end,
    when the ranks agree over ``group`` (None: the default group) and every rank gets the same
    numbers.

    Args:
        model: What ``metric_fn`` is given: the model to evaluate, unwrapped from DDP (whose
            forward may wait for the other ranks, which see other numbers of batches).
        data_loader: An iterable of batches.
        metric_fn: ``metric_fn(model, batch) -> {name: tensor of shape [batch]}``.
        group: The group of every rank that reduces the results.

    Example::

        >>> model = nn.Linear(2, 2)
        >>> batches = [(torch.randn(3, 2), torch.tensor([0, 1, 1]))] * 2
        >>> def accuracy(model, batch):
        ...     x, y = batch
        ...     return {"acc": (model(x).argmax(1) == y).float()}
        >>> sorted(evaluate(model, batches, accuracy))
        ['acc']
    """
    # this rank's samples of a DistributedSampler, (real, with padding), or None: shared
    shard = _shard(data_loader, get_rank(), get_world_size())
    with torch.no_grad(), eval_mode(model):
        sums, count, seen, batches = _sums(model, data_loader, metric_fn, shard)
    error = None
    if shard is not None and seen != shard[1]:  # its padding is told by position
        error = ValueError(
            f"metric_fn returned {seen} values for the {shard[1]} samples of this rank's "
            "DistributedSampler shard; return one value per sample."
        )
    lengths = raise_on_every_rank(error, batches, group)
    if shard is None and len(set(lengths)) > 1:
        # evaluation shares one loader's batches among the ranks
        raise ValueError(f"Ranks' data_loaders gave {lengths} batches: use a DistributedSampler.")
    # note: the evaluation's one CPU-GPU sync
    numbers = torch.stack(list(sums.values())).tolist() if sums else []
    totals = {name: [total] for name, total in zip(sums, numbers)} if count else None
    means = reduce_over_ranks(totals, group, count=count, source="metric_fn")
    if means is None:
        raise ValueError("data_loader yielded no samples to evaluate.")
    return {name: values[0] for name, values in means.items()}


def _sums(
    model: nn.Module, data_loader: Any, metric_fn: MetricFn, shard: Optional[tuple[int, int]]
) -> tuple[dict[str, torch.Tensor], int, int, int]:
    """This rank's sums of ``metric_fn``'s values, on the device, with the samples they count,
    the values met (a shard's padding included) and the batches the loader gave."""
    rank = get_rank()
    world_size = get_world_size()
    sums: dict[str, torch.Tensor] = {}
    count = 0  # the samples counted, known on the host from the values' shapes: no sync
    seen = 0  # the values met so far, one per sample of this rank's shard, padding included
    batches = 0  # the loader's
    forwards = 0  # this rank's
    spare = None  # a batch to run forwards on that count nothing
    for batch in data_loader:
        mine = shard is not None or batches % world_size == rank
        batches += 1
        if not mine:
            spare = batch  # another rank's
            continue
        values = _checked(metric_fn(model, batch), sums.keys() or None, _rows(batch))
        forwards += 1
        n = next(iter(values.values())).shape[0]
        keep = n if shard is None else max(0, min(n, shard[0] - seen))
        seen += n
        for name, value in values.items():
            total = value[:keep].sum(dtype=torch.float64)  # a DistributedSampler's padding
            sums[name] = sums[name] + total if name in sums else total
        count += keep
        spare = batch
    if is_sharded(model) and world_size > 1 and shard is None:
        # FSDP2 gathers weights in every forward, a collective: each rank runs as many,
        # known without asking the others (which wait in their forwards); a
        # DistributedSampler gives every rank as many batches
        for _ in range(math.ceil(batches / world_size) - forwards):
            if spare is not None:
                metric_fn(model, spare)  # not counted
    return sums, count, seen, batches


def _shard(data_loader: Any, rank: int, world_size: int) -> Optional[tuple[int, int]]:
    """The samples of a ``DistributedSampler``'s shard for this rank, ``(real ones, with the
    padding)``, or None for another loader, which the ranks share; refuse what would count a
    sample twice or not at all."""
    batches = getattr(data_loader, "batch_sampler", None)  # a DataLoader's: drop_last is there
    dataset = getattr(data_loader, "dataset", None)
    if isinstance(dataset, IterableDataset):  # its sampler yields None forever: no length
        _check_stream(dataset, batches, world_size)
        return None
    sampler = getattr(batches, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        n = len(sampler.dataset)  # type: ignore[arg-type]
        replicas = sampler.num_replicas
        if (replicas, sampler.rank) != (world_size, rank):
            raise ValueError(
                f"data_loader's DistributedSampler is for rank {sampler.rank} of {replicas}."
            )
        if sampler.drop_last and n % replicas:
            raise ValueError("data_loader's DistributedSampler drops samples (drop_last=True).")
        _refuse_a_dropped_batch(batches, sampler.num_samples)
        return len(range(rank, n, replicas)), sampler.num_samples
    drawn = isinstance(sampler, WeightedRandomSampler) or (
        isinstance(sampler, RandomSampler)
        and (sampler.replacement or sampler.num_samples != len(sampler.data_source))
    )
    if drawn:
        raise ValueError(f"data_loader's {type(sampler).__name__} does not draw each sample once.")
    if world_size > 1 and isinstance(sampler, _SHUFFLING):  # each rank's RNG orders it its way
        raise ValueError("data_loader shuffles on each rank its own way: pass shuffle=False.")
    if dataset is not None and sampler is not None:
        _refuse_a_dropped_batch(batches, len(sampler))
    return None


def _check_stream(dataset: IterableDataset, batches: Any, world_size: int) -> None:
    """Refuse a stream that evaluation would not count once: one shared by torchrun's ranks, or
    batched with ``drop_last``. In one process a stream is counted as it comes, the samples of
    every worker (each worker yields its share: the dataset splits itself by
    ``get_worker_info()``, as PyTorch documents)."""
    name = type(dataset).__name__
    if world_size > 1:  # it may give each rank a part of its own, or all of it
        raise ValueError(f"data_loader is an IterableDataset ({name}): evaluate it in one process.")
    if getattr(batches, "drop_last", False):
        raise ValueError(f"data_loader drops a last batch of {name} (drop_last=True).")


def _refuse_a_dropped_batch(batches: Any, samples: int) -> None:
    """Refuse a batch sampler that drops the last batch of ``samples``, smaller than the rest."""
    size = getattr(batches, "batch_size", None)
    if getattr(batches, "drop_last", False) and size and samples % size:
        raise ValueError(f"data_loader drops the last {samples % size} samples (drop_last=True).")


@contextlib.contextmanager
def rank_0_buffers(module: nn.Module, group: Any) -> Iterator[None]:
    """``module``'s buffers replaced by rank 0's for the block, then its own put back: each
    rank's drift (BatchNorm's running statistics, from its own batches), and checkpoints hold
    rank 0's, which DDP also gives every rank at each training forward unless told not to
    (``broadcast_buffers=False``). A broadcast per buffer, once per evaluation."""
    buffers = list(module.buffers())
    own = [buffer.detach().clone() for buffer in buffers]
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for buffer in buffers:
            dist.broadcast(buffer, src=source, group=group)
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, own):
                buffer.copy_(value)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block, then every module back in the mode it was in."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _rows(batch: Any) -> Optional[int]:
    """The number of samples in ``batch``, where its tensors tell: the first dimension that the
    batch (a tensor) or each tensor of its items (a tuple's, a list's, a mapping's values) has,
    as a DataLoader collates them; None when they disagree (a sequence-first batch) or there
    are none."""
    items = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(batch, torch.Tensor) or not isinstance(batch, (Mapping, tuple, list)):
        items = [batch]
    firsts = {t.shape[0] for t in items if isinstance(t, torch.Tensor) and t.dim()}
    return firsts.pop() if len(firsts) == 1 else None


def _checked(values: Any, names: Optional[Any], rows: Optional[int]) -> dict[str, torch.Tensor]:
    """``metric_fn``'s result for a batch of ``rows`` samples (None: not known), checked: a dict
    of same-length 1-D tensors, under the names of the first batch (shapes only: no host-device
    sync)."""
    if not isinstance(values, dict) or not values:
        raise TypeError(
            f"metric_fn must return {{name: tensor of shape [batch]}}, got {type(values)}."
        )
    lengths = set()
    for name, value in values.items():
        # one value per sample, not the batch's mean: batches of different sizes would weigh alike
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            raise ValueError(f"metric_fn returned {name!r} not as a tensor of shape [batch].")
        lengths.add(value.shape[0])
    if len(lengths) > 1:
        raise ValueError(f"metric_fn returned {sorted(lengths)} values for one batch's names.")
    if lengths == {1} and rows is not None and rows > 1:  # a mean with keepdim=True, most often
        raise ValueError(
            f"metric_fn returned {next(iter(values))!r} of shape [1] for a batch of {rows} "
            f"samples: return one value per sample (shape [{rows}]), not the batch's mean."
        )
    if names is not None and values.keys() != names:
        raise ValueError(f"metric_fn returned {sorted(names)}, then {sorted(values)}.")
    return values
