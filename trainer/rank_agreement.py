"""The checks every rank makes together before a torchrun run trains."""

from typing import Any, Optional

from .distributed import all_gather, get_rank


def agree_at_start(lock_problem: Optional[str], epoch_len: Optional[int], group: Any) -> None:
    """Raise on every rank at once where rank 0 found ``work_dir`` held by another run
    (``lock_problem``) or the ranks' data loaders differ in length (they would hang in
    mismatched collectives)."""
    everyone = all_gather((lock_problem, epoch_len), group=group)
    problem = everyone[0][0]
    if problem:
        raise RuntimeError(problem if get_rank() == 0 else f"Rank 0: {problem}")
    lengths = [length for _, length in everyone]
    if len(set(lengths)) > 1:
        each = ", ".join(
            f"rank {rank} {'a stream' if n is None else f'{n} iterations'}"
            for rank, n in enumerate(lengths)
        )
        raise RuntimeError(
            f"The ranks' data loaders differ in length per epoch ({each}), so the ranks would "
            "disagree on when epochs and training end. Give every rank as many batches: a "
            "DistributedSampler does (drop_last=True on the loader, or an equal split)."
        )
