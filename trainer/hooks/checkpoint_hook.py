"""Saves checkpoints periodically and deletes old ones."""

import logging
import math
import os
from time import monotonic
from typing import Any, Optional

from ..checkpoint_io import remove_checkpoint
from ..distributed import all_gather
from ..misc import NUMBER, check_file_name, check_int, check_type
from .hookbase import HookBase, Priority

logger = logging.getLogger(__name__)


class CheckpointHook(HookBase):
    """Saves a checkpoint every ``period`` epochs (or iterations), every ``every_minutes`` of
    training if given, and always at the end.

    A timed save happens at the first log point (every ``log_period`` iterations) at which
    ``every_minutes`` have passed since training started (or resumed) or since the last
    checkpoint, whichever hook saved it; one due at an epoch's last iteration waits for its end.
    The clock is read at log points only, and under torchrun the ranks share what theirs say
    there (one small gloo all-gather), so they all save at the same iteration.

    Args:
        period: Epochs (``by_epoch``) or iterations between checkpoints; 0 saves at the end only.
        max_to_keep: Keep the newest N checkpoints this hook wrote (timed ones too, with those of
            preemptions that a run resumed from); None keeps all.
        by_epoch: Count ``period`` in epochs (True) or iterations.
        every_minutes: Also save when this many minutes of training passed without a
            checkpoint (Lightning's ``train_time_interval``); None: no timed saves.

    Example::

        >>> hook = CheckpointHook(period=1000, max_to_keep=3, by_epoch=False)
        >>> hook = CheckpointHook(period=0, max_to_keep=2, every_minutes=30)
    """

    priority = Priority.CHECKPOINT

    def __init__(
        self,
        period: int = 1,
        max_to_keep: Optional[int] = None,
        by_epoch: bool = True,
        *,
        every_minutes: Optional[float] = None,
    ) -> None:
        check_int("period", period, minimum=0, note="0 saves at the end only")
        if max_to_keep is not None:
            check_int("max_to_keep", max_to_keep, minimum=1, note="or None to keep all")
        check_type("by_epoch", by_epoch, bool, "True or False")
        if every_minutes is not None:
            check_type("every_minutes", every_minutes, NUMBER, "a number of minutes, or None")
            if not 0 < every_minutes < math.inf:
                raise ValueError(
                    f"every_minutes must be a number of minutes > 0, got {every_minutes!r}; "
                    "pass None for no timed saves."
                )
        self._period = period
        self._max_to_keep = max_to_keep
        self._by_epoch = by_epoch
        self._seconds = None if every_minutes is None else 60.0 * every_minutes
        self._saved: list[str] = []  # the checkpoints this hook wrote, oldest first
        self._last_save = 0.0  # the clock when training started, or the last checkpoint was saved
        self._time_is_up = False  # a timed save is due, at this iteration (or its epoch's end)

    @property
    def saves_by_epoch(self) -> bool:
        """Whether it saves every ``period`` epochs (rather than iterations, or at the end only)."""
        return self._by_epoch and self._period > 0

    def before_train(self) -> None:
        """Count a checkpoint that this run resumed from and the trainer saved outside this hook
        (a preemption's) among this hook's, so that preemptions do not pile up checkpoints."""
        name = self.trainer.checkpointer.name()
        resumed = self.trainer.start_iter > 0
        if resumed and name not in self._saved and os.path.exists(self._path(name)):
            self._add(name, save=False)
        self._last_save = monotonic()  # timed saves count from the start, or the resume
        self._time_is_up = False

    def after_iter_period(self) -> int:
        """Counting in iterations, every ``period``-th; counting in epochs, never; with
        ``every_minutes``, at the log points too (every gcd of the two periods)."""
        period = 0 if self._by_epoch else self._period
        if self._seconds is not None:
            period = math.gcd(period, self.trainer.log_period)
        return period

    def after_iter(self) -> None:
        """Save mid-epoch checkpoints, periodic or timed. One due at an epoch's last iteration
        waits for its end, to hold the state after ``after_epoch`` (the epoch's LR step) so that
        resume is exact."""
        if self._seconds is not None and self.every_n_iters(self.trainer.log_period):
            self._time_is_up = self._ranks_time_is_up()
        periodic = not self._by_epoch and self.every_n_iters(self._period)
        if (periodic or self._time_is_up) and not self.is_last_inner_iter():
            self._add(self.trainer.checkpointer.name())

    def after_epoch(self) -> None:
        """Save epoch checkpoints, and iteration or timed checkpoints due at the epoch's last
        iteration."""
        every_n = self.every_n_epochs if self._by_epoch else self.every_n_iters
        if every_n(self._period) or self.is_last_epoch() or self._time_is_up:
            self._add(self.trainer.checkpointer.name())

    def before_save_checkpoint(self) -> None:
        """Restart the clock of timed saves at every checkpoint, this hook's or another's."""
        self._last_save = monotonic()
        self._time_is_up = False

    def _ranks_time_is_up(self) -> bool:
        """Whether ``every_minutes`` passed since the last save by any rank's clock: every rank
        gets the same answer (at a log point, where the ranks meet for the metrics anyway)."""
        up = monotonic() - self._last_save >= self._seconds
        return any(all_gather(up, group=self.trainer.cpu_group))  # CPU only: no device sync

    def _add(self, file_name: str, save: bool = True) -> None:
        """Save ``file_name`` (or adopt it, durable already), then delete all but the newest
        ``max_to_keep``."""
        self._saved = [name for name in self._saved if name != file_name] + [file_name]
        old = self._saved[: -self._max_to_keep] if self._max_to_keep else []
        paths = [self._path(name) for name in old]
        # The checkpoint still lists the old files: a run killed before they are deleted deletes
        # them after resuming. They go in the background, once the new one is durable.
        if save:
            self.trainer.save_checkpoint(file_name, then=lambda: delete_checkpoints(paths))
        else:
            delete_checkpoints(paths)
        self._saved = self._saved[len(old) :]

    def _path(self, file_name: str) -> str:
        return self.trainer.checkpointer.path(file_name)

    def state_dict(self) -> dict[str, Any]:
        """The checkpoints this hook wrote, oldest first."""
        return {"saved": list(self._saved)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned; a name leading out of ``ckpt_dir`` is
        ignored with a warning, never deleted."""
        self._saved = []
        for name in state["saved"]:
            try:
                check_file_name("saved", name)
            except (TypeError, ValueError):
                logger.warning(f"Ignoring {name!r} among the checkpoints the loaded state lists.")
                continue
            self._saved.append(name)


def delete_checkpoints(paths: list[str]) -> None:
    """Delete old checkpoints; one that cannot be deleted is a warning (training is fine)."""
    for path in paths:
        try:
            if os.path.lexists(path):
                remove_checkpoint(path)
                logger.debug(f"Deleted old checkpoint {path}")
        except OSError as e:
            logger.warning(
                f"Could not delete the old checkpoint {path} ({e.strerror or e}); it stays, "
                "and training goes on."
            )
