"""Saves checkpoints periodically and deletes old ones."""

import logging
import os
from typing import Any, Optional

from ..distributed import is_main_process
from .hookbase import HookBase, Priority

logger = logging.getLogger(__name__)


class CheckpointHook(HookBase):
    """Saves a checkpoint every ``period`` epochs (or iterations), and always at the end.

    An epoch is one pass over the data, in iteration-based training too. A checkpoint saved at an
    epoch's end in epoch-based training is ``epoch_{N}.pth`` (N epochs done); any other is
    ``iter_{N}.pth`` (N iterations done).

    A save due on the last iteration of an epoch waits for the epoch's end, so that the checkpoint
    holds the state after ``after_epoch`` (the epoch's LR step included) and resume is exact.

    Args:
        period: Epochs (``by_epoch``) or iterations between checkpoints.
        max_to_keep: Keep the newest N checkpoints this hook wrote; None keeps all.
        by_epoch: Count ``period`` in epochs (True) or iterations.

    Example::

        >>> hook = CheckpointHook(period=1000, max_to_keep=3, by_epoch=False)
    """

    priority = Priority.CHECKPOINT

    def __init__(self, period: int = 1, max_to_keep: Optional[int] = None, by_epoch: bool = True):
        self._period = period
        self._max_to_keep = max_to_keep
        self._by_epoch = by_epoch
        self._saved: list[str] = []

    def after_iter(self) -> None:
        """Save mid-epoch checkpoints in iteration mode."""
        if (
            not self._by_epoch
            and self.every_n_iters(self._period)
            and not self.is_last_inner_iter()
        ):
            self._save(f"iter_{self.trainer.cur_iter + 1}.pth")

    def after_epoch(self) -> None:
        """Save epoch checkpoints, and iteration checkpoints due at the epoch's last iteration."""
        if self._by_epoch:
            due = self.every_n_epochs(self._period)
        else:
            due = self.every_n_iters(self._period)
        if due or self.is_last_epoch():
            if self.trainer.epoch_based:
                self._save(f"epoch_{self.trainer.cur_epoch + 1}.pth")
            else:
                self._save(f"iter_{self.trainer.cur_iter + 1}.pth")

    def _save(self, file_name: str) -> None:
        self._saved = [name for name in self._saved if name != file_name] + [file_name]
        # The list is part of the saved state, so a resumed run knows which files to rotate.
        self.trainer.save_checkpoint(file_name)
        if self._max_to_keep is None or not is_main_process():
            return
        while len(self._saved) > self._max_to_keep:
            old = os.path.join(self.trainer.ckpt_dir, self._saved.pop(0))
            if os.path.exists(old):
                os.remove(old)
                logger.info(f"Deleted old checkpoint {old}")

    def state_dict(self) -> dict[str, Any]:
        """The checkpoints this hook wrote, oldest first."""
        return {"saved": list(self._saved)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._saved = list(state["saved"])
