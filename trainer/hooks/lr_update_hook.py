"""Steps the warmup-wrapped LR schedule."""

from typing import Any, Optional

from ..misc import check_type
from .hookbase import HookBase, Priority
from .metric_watch import warn_if_missing

DEFAULT_PLATEAU_METRIC = "Eval Metric"


class LRUpdateHook(HookBase):
    """Calls ``trainer.lr_scheduler.iter_update()`` after every iteration (where it can change
    the LR) and ``epoch_update()`` after every epoch. Iterations whose step the float16
    GradScaler skipped count too, as in PyTorch's AMP recipe (seeing a skip costs a sync).

    Args:
        plateau_metric: The metric ReduceLROnPlateau judges, stepping at an epoch end only when
            a new value was logged (by an [`EvalHook`][], which runs first). None: ``"Eval
            Metric"``, as core-pytorch-utils, raising at the first epoch end if none was logged.
            The first evaluation that lacks a named one is warned about (see
            ``trainer.hooks.metric_watch.warn_if_missing``).

    Example::

        >>> hook = LRUpdateHook()  # the Trainer registers one by default
    """

    priority = Priority.LR_UPDATE

    def __init__(self, plateau_metric: Optional[str] = None) -> None:
        check_type("plateau_metric", plateau_metric, (str, type(None)), "a str or None")
        self._plateau_metric = plateau_metric or DEFAULT_PLATEAU_METRIC
        self._metric_named = plateau_metric is not None
        self._metric_count = 0  # values of plateau_metric already fed to the scheduler
        self._warned = False  # that an evaluation lacked plateau_metric

    def before_train(self) -> None:
        """Refuse a ``plateau_metric`` that no ReduceLROnPlateau judges: it would be ignored."""
        scheduler = self.trainer.lr_scheduler
        if self._metric_named and not scheduler.is_plateau:
            name = type(scheduler.torch_scheduler or scheduler).__name__
            raise ValueError(f"plateau_metric is for ReduceLROnPlateau, not {name}: remove it.")

    def after_eval(self, results: dict[str, float]) -> None:
        """Warn if the first evaluation lacks the plateau metric."""
        if self._metric_named and not self._warned:  # a missing default raises instead
            self._warned = warn_if_missing(self, "plateau_metric", self._plateau_metric, results)

    def after_iter_period(self) -> int:
        """Every iteration; never for an epoch schedule without a warmup in iterations."""
        return 1 if self.trainer.lr_scheduler.changes_per_iter else 0

    def after_iter(self) -> None:
        """Advance the iteration schedule."""
        self.trainer.lr_scheduler.iter_update()

    def after_epoch(self) -> None:
        """Advance the epoch schedule, with the newest plateau metric if any."""
        scheduler = self.trainer.lr_scheduler
        if not scheduler.changes_per_iter:  # not counted after each iteration
            scheduler.last_iter = self.trainer.cur_iter + 1
        metric = None
        if scheduler.is_plateau:
            buffer = self.trainer.metric_storage.get(self._plateau_metric)
            if buffer is None and not self._metric_named:
                epoch = self.trainer.cur_epoch + 1
                raise RuntimeError(
                    f"No {DEFAULT_PLATEAU_METRIC!r}, the default plateau_metric, by epoch {epoch}: "
                    "pass yours."
                )
            if buffer is not None and buffer.count > self._metric_count:
                metric = buffer.latest
                self._metric_count = buffer.count
        scheduler.epoch_update(metric)

    def state_dict(self) -> dict[str, Any]:
        """How many plateau metric values were used."""
        return {"metric_count": self._metric_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned."""
        self._metric_count = state["metric_count"]
