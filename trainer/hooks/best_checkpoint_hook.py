"""Keeps a checkpoint of the best evaluation result."""

import logging
from typing import Any, Optional

from ..checkpoint import written_by_trainer
from ..misc import check_file_name
from .hookbase import HookBase, Priority
from .metric_watch import MetricWatch, warn_if_missing

logger = logging.getLogger(__name__)


class BestCheckpointHook(HookBase):
    """Saves ``best.pth`` (a full checkpoint, written atomically like every other) whenever the
    evaluation metric ``metric`` reaches a new best (a NaN never is one).

    The first evaluation that lacks ``metric`` (a misspelt name) is warned about, naming the
    results that came (see ``trainer.hooks.metric_watch.warn_if_missing``).

    The save waits for the end of the iteration or epoch (after the LR update and the regular
    checkpoint), so ``best.pth`` resumes exactly too. The best value is saved in checkpoints,
    so a resumed run only replaces ``best.pth`` with something better.

    Args:
        metric: A name that the ``EvalHook``'s function returns.
        mode: ``"max"`` (higher is better) or ``"min"``; by default inferred from the name
            (``loss``, ``err``: min; ``acc``, ``ap``, ``f1``, ``iou``: max), and a name that does
            not tell is refused (docs/evaluation.md has the rule); logged when training starts.
        file_name: The file name in ``trainer.ckpt_dir`` (a sub-folder is made); not one the
            trainer writes itself (``epoch_N.pth``, ``iter_N.pth``, ``latest.txt``, a name ending
            in ``.tmp``, one in ``previous/``).

    Example::

        >>> hook = BestCheckpointHook("val_acc")  # mode="max", from the name
    """

    priority = Priority.CHECKPOINT + 5

    def __init__(
        self, metric: str, mode: Optional[str] = None, file_name: str = "best.pth"
    ) -> None:
        check_file_name("file_name", file_name)
        if written_by_trainer(file_name):  # it would overwrite, or be overwritten or removed
            raise ValueError(
                f"file_name={file_name!r} is a name the trainer writes itself (epoch_N.pth, "
                "iter_N.pth, latest.txt, *.tmp, previous/...): pass another, such as 'best.pth'."
            )
        self._watch = MetricWatch(metric, mode)
        self._file_name = file_name
        self._due = False  # a new best, not saved yet
        self._saved_best = None  # the value best.pth holds
        self._warned = False  # that an evaluation lacked the metric

    def before_train(self) -> None:
        """Log which way the metric is judged."""
        self._watch.log_mode(self.class_name)

    def after_eval(self, results: dict[str, float]) -> None:
        """Note a new best; it is saved when the state is complete."""
        if not self._warned:
            self._warned = warn_if_missing(self, "metric", self._watch.metric, results)
        value = results.get(self._watch.metric)
        previous = self._watch.best
        if value is not None and self._watch.improves(value):
            was = "" if previous is None else f" (was {previous:.5g})"
            name = self._watch.metric
            logger.info(f"New best {name}: {value:.5g}{was}: saving {self._file_name}.")
            self._due = True

    def after_iter(self) -> None:
        """Save a best found in iteration-based evaluation (at an epoch's end: after it)."""
        if self._due and not self.is_last_inner_iter():
            self._save()

    def after_epoch(self) -> None:
        """Save a best found in this epoch's evaluation."""
        if self._due:
            self._save()

    @property
    def best_checkpoint(self) -> str:
        """The path of the best checkpoint (written once a best was found)."""
        return self.trainer.checkpointer.path(self._file_name)

    def _save(self) -> None:
        self._due = False
        self._saved_best = self._watch.best
        self.trainer.save_checkpoint(self._file_name)

    def state_dict(self) -> dict[str, Any]:
        """The value ``best.pth`` holds (a best not saved yet does not count: a run killed
        before saving it must not take it for saved)."""
        return {"best": self._saved_best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned."""
        self._watch.load_state_dict(state)
        self._saved_best = state["best"]
