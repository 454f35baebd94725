"""The best value so far of an evaluation metric, for hooks that act on it."""

import math
from typing import Any, Optional


class MetricWatch:
    """Judges each new value of ``metric`` against the best one so far.

    Args:
        metric: A name that the ``EvalHook``'s function returns.
        mode: ``"max"`` (higher is better, e.g. accuracy) or ``"min"`` (e.g. a loss).
        min_delta: How much better a value must be to count as an improvement.

    Example::

        >>> watch = MetricWatch("val_acc", mode="max")
        >>> watch.improves(0.5), watch.improves(0.4)
        (True, False)
    """

    def __init__(self, metric: str, mode: str = "max", min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}.")
        if not min_delta >= 0:
            raise ValueError(f"min_delta must be >= 0, got {min_delta!r}.")
        self.metric = metric
        self.mode = mode
        self.min_delta = min_delta
        self.best: Optional[float] = None

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``; if so it becomes
        the best. NaN never does."""
        if math.isnan(value):
            return False
        if self.best is not None:
            margin = value - self.best if self.mode == "max" else self.best - value
            if margin <= self.min_delta:
                return False
        self.best = value
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
