"""Saves checkpoints periodically and deletes old ones."""

import logging
import os
from typing import Any, Optional

from ..checkpoint_io import remove_checkpoint
from ..misc import check_file_name, check_int, check_type
from .hookbase import HookBase, Priority

logger = logging.getLogger(__name__)


class CheckpointHook(HookBase):
    """Saves a checkpoint every ``period`` epochs (or iterations), and always at the end.

    Args:
        period: Epochs (``by_epoch``) or iterations between checkpoints; 0 saves at the end only.
        max_to_keep: Keep the newest N checkpoints this hook wrote (with those of preemptions
            that a run resumed from); None keeps all.
        by_epoch: Count ``period`` in epochs (True) or iterations.

    Example::

        >>> hook = CheckpointHook(period=1000, max_to_keep=3, by_epoch=False)
    """

    priority = Priority.CHECKPOINT

    def __init__(self, period: int = 1, max_to_keep: Optional[int] = None, by_epoch: bool = True):
        check_int("period", period, minimum=0, note="0 saves at the end only")
        if max_to_keep is not None:
            check_int("max_to_keep", max_to_keep, minimum=1, note="or None to keep all")
        check_type("by_epoch", by_epoch, bool, "True or False")
        self._period = period
        self._max_to_keep = max_to_keep
        self._by_epoch = by_epoch
        self._saved: list[str] = []  # the checkpoints this hook wrote, oldest first

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

    def after_iter_period(self) -> int:
        """Counting in iterations, every ``period``-th; counting in epochs, never."""
        return 0 if self._by_epoch else self._period

    def after_iter(self) -> None:
        """Save mid-epoch checkpoints. One due at an epoch's last iteration waits for its end, to
        hold the state after ``after_epoch`` (the epoch's LR step) so that resume is exact."""
        if not self.is_last_inner_iter():
            self._add(self.trainer.checkpointer.name())

    def after_epoch(self) -> None:
        """Save epoch checkpoints, and iteration checkpoints due at the epoch's last iteration."""
        every_n = self.every_n_epochs if self._by_epoch else self.every_n_iters
        if every_n(self._period) or self.is_last_epoch():
            self._add(self.trainer.checkpointer.name())

    def _add(self, file_name: str, save: bool = True) -> None:
        """Save ``file_name`` (or adopt it, durable already), then delete all but the newest
        ``max_to_keep``."""
        self._saved = [name for name in self._saved if name != file_name] + [file_name]
        old = self._saved[: -self._max_to_keep] if self._max_to_keep else []
        paths = [self._path(name) for name in old]
        # The checkpoint still lists the old files: a run killed before they are deleted deletes
        # them after resuming. They go in the background, once the new one is durable.
        if save:
            self.trainer.save_checkpoint(file_name, then=lambda: _delete(paths))
        else:
            _delete(paths)
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


def _delete(paths: list[str]) -> None:
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
