"""Ends training when an evaluation metric stops improving."""

import logging
import math
from typing import Any, Optional

from ..misc import check_int
from .hookbase import HookBase, Priority
from .metric_watch import MetricWatch, warn_if_missing

logger = logging.getLogger(__name__)


class EarlyStoppingHook(HookBase):
    """Calls ``trainer.stop()`` after ``patience`` evaluations in a row without an improvement
    of ``metric`` (one that ``EvalHook``'s function returns) by more than ``min_delta``.

    Its counters are saved in checkpoints, so a resumed run counts on where it stopped. Every
    rank sees the same evaluation results, so under torchrun every rank stops together.

    A NaN value is never an improvement: it counts towards ``patience``.

    The first evaluation that lacks ``metric`` (a misspelt name) is warned about, naming the
    results that came (see ``trainer.hooks.metric_watch.warn_if_missing``).

    Args:
        metric: The evaluation metric to watch.
        patience: Evaluations without improvement to tolerate.
        mode: ``"max"`` (higher is better) or ``"min"``; by default inferred from the name
            (``loss``, ``err``: min; ``acc``, ``ap``, ``f1``, ``iou``: max), and a name that does
            not tell is refused (docs/evaluation.md has the rule); logged when training starts.
        min_delta: How much better a value must be to count as an improvement.

    Example::

        >>> hook = EarlyStoppingHook("val_loss", patience=3)  # mode="min", from the name
    """

    priority = Priority.EVAL

    def __init__(
        self, metric: str, patience: int = 5, mode: Optional[str] = None, min_delta: float = 0.0
    ) -> None:
        check_int("patience", patience, minimum=1)
        self._watch = MetricWatch(metric, mode, min_delta)
        self._patience = patience
        self._bad_evals = 0  # evaluations since the last improvement
        self._warned = False  # that an evaluation lacked the metric

    @property
    def metric_watch(self) -> MetricWatch:
        """What judges ``metric``: its name and ``mode`` (the run summary's best follows it)."""
        return self._watch

    def before_train(self) -> None:
        """Log which way the metric is judged."""
        self._watch.log_mode(self.class_name)

    def after_eval(self, results: dict[str, float]) -> None:
        """Count an evaluation without improvement; stop after ``patience`` of them."""
        if self._watch.metric not in results:
            if not self._warned:
                self._warned = warn_if_missing(self, "metric", self._watch.metric, results)
            return
        value = results[self._watch.metric]
        if self._watch.improves(value):
            self._bad_evals = 0
            return
        self._bad_evals += 1
        if self._bad_evals >= self._patience:
            best = self._watch.best  # None: every value was NaN
            on = "" if best is None else f" on {best:.5g}"
            nan = ": a NaN is never an improvement" if math.isnan(value) else ""
            logger.info(
                f"Early stopping: {self._watch.metric} has not improved{on} for "
                f"{self._bad_evals} evaluations (now {value:.5g}{nan})."
            )
            self.trainer.stop()

    def state_dict(self) -> dict[str, Any]:
        """The best value and the evaluations since it."""
        return {**self._watch.state_dict(), "bad_evals": self._bad_evals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned."""
        self._watch.load_state_dict(state)
        self._bad_evals = state["bad_evals"]
