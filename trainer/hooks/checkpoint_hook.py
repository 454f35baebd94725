"""Saves checkpoints periodically and deletes old ones."""

import logging
import os
from typing import Any, Optional

from ..checks import check_int
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
        period: Epochs (``by_epoch``) or iterations between checkpoints; 0 saves at the end
            only.
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
        self._period = period
        self._max_to_keep = max_to_keep
        self._by_epoch = by_epoch
        self._saved: list[str] = []

    @property
    def saves_by_epoch(self) -> bool:
        """Whether it saves every ``period`` epochs (rather than iterations, or at the end only)."""
        return self._by_epoch and self._period > 0

    def before_train(self) -> None:
        """Count the checkpoint this run resumed from among this hook's, if the trainer saved
        it outside this hook (a preemption): it is then deleted in turn, and preemptions do
        not pile up checkpoints beyond ``max_to_keep``."""
        name = self.trainer.checkpoint_name()
        resumed = self.trainer.start_iter > 0
        if resumed and name not in self._saved:
            if os.path.isfile(os.path.join(self.trainer.ckpt_dir, name)):
                self._saved.append(name)
                old = self._old()
                _delete(self.trainer.ckpt_dir, old)  # the resumed checkpoint is durable
                self._saved = self._saved[len(old) :]

    def after_iter_period(self) -> int:
        """Counting in iterations, every ``period``-th; counting in epochs, never."""
        return 0 if self._by_epoch else self._period

    def after_iter(self) -> None:
        """Save mid-epoch checkpoints in iteration mode (one due at an epoch's last iteration
        waits for :meth:`after_epoch`)."""
        if not self.is_last_inner_iter():
            self._save(self.trainer.checkpoint_name())

    def after_epoch(self) -> None:
        """Save epoch checkpoints, and iteration checkpoints due at the epoch's last iteration."""
        if self._by_epoch:
            due = self.every_n_epochs(self._period)
        else:
            due = self.every_n_iters(self._period)
        if due or self.is_last_epoch():
            self._save(self.trainer.checkpoint_name())

    def _save(self, file_name: str) -> None:
        self._saved = [name for name in self._saved if name != file_name] + [file_name]
        old, ckpt_dir = self._old(), self.trainer.ckpt_dir
        # The checkpoint still lists the old files: a run killed before they are deleted deletes
        # them after resuming. They go in the background, once the new one is durable.
        self.trainer.save_checkpoint(file_name, then=lambda: _delete(ckpt_dir, old))
        self._saved = self._saved[len(old) :]

    def _old(self) -> list[str]:
        """The names beyond the newest ``max_to_keep``, oldest first."""
        return self._saved[: -self._max_to_keep] if self._max_to_keep else []

    def state_dict(self) -> dict[str, Any]:
        """The checkpoints this hook wrote, oldest first."""
        return {"saved": list(self._saved)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned. Only plain file names are kept: this hook
        deletes old checkpoints by these names, and must never reach outside ``ckpt_dir``."""
        self._saved = []
        for name in state["saved"]:
            if is_file_name(name):
                self._saved.append(name)
            else:
                logger.warning(
                    f"Ignoring {name!r} among the checkpoints the loaded state lists: not a file "
                    "name in the checkpoint folder, so it is never deleted."
                )


def is_file_name(name: Any) -> bool:
    """Whether ``name`` is a plain file name: no folder, no ``..``, no absolute path."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and os.path.basename(name) == name
        and not any(sep in name for sep in (os.sep, os.altsep, "\0") if sep)
    )


def _delete(ckpt_dir: str, names: list[str]) -> None:
    """Delete old checkpoints. One that cannot be deleted (permissions, an immutable file) is a
    warning: training and the new checkpoint are fine."""
    for name in names:
        path = os.path.join(ckpt_dir, name)
        if not is_file_name(name) or not os.path.lexists(path):
            continue
        try:
            os.remove(path)
        except OSError as e:
            logger.warning(f"Could not delete the old checkpoint {path} ({e.strerror or e}); "
                           "it stays, and training goes on.")  # fmt: skip
        else:
            logger.debug(f"Deleted old checkpoint {path}")
