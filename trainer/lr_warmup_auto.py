"""The target of ``warmup_mode="auto"``: the regular LRs at the end of warmup, imported only by
an :class:`~trainer.LRWarmupScheduler` in that mode."""

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lr_scheduler import LRWarmupScheduler


def regular_lrs_at_warmup_end(scheduler: "LRWarmupScheduler") -> list[float]:
    """Run ``scheduler``'s regular schedule to the end of warmup, and rewind it."""
    torch_scheduler = scheduler.torch_scheduler
    if torch_scheduler is None or scheduler.is_plateau:
        return list(scheduler.base_lrs)
    per_epoch = scheduler.by_epoch and not scheduler.warmup_by_epoch
    steps = scheduler.warmup_t // (scheduler.epoch_len or 1) if per_epoch else scheduler.warmup_t
    saved = torch_scheduler.state_dict()
    # A look-ahead, not training: torch's "step() before optimizer.step()" warning is moot.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        for _ in range(steps):
            torch_scheduler.step()
    end_lrs = scheduler._get_lrs()
    torch_scheduler.load_state_dict(saved)
    scheduler._set_lrs(scheduler.base_lrs)
    return end_lrs
