"""The best value so far of an evaluation metric, for hooks that act on it, and the warning
when an evaluation lacks it."""

import logging
import math
import re
from typing import Any, Optional

from ..misc import NUMBER, check_type
from .eval_hook import EvalHook

logger = logging.getLogger(__name__)

# Words in a metric's name that tell which way is better.
_LOWER_IS_BETTER = set(
    "loss err error errors mse mae rmse nll ppl perplexity cer wer fid distance dist brier".split()
)
_HIGHER_IS_BETTER = set(
    "acc accuracy ap map f1 iou miou auc auroc precision recall bleu rouge dice psnr ssim r2 "
    "score reward".split()
)
# Words that negate a metric or speak of its change: which way is better then depends on how it
# is signed (scikit-learn's neg_log_loss is better high, accuracy_drop low), and the name does
# not tell.
_AMBIGUOUS = set(
    "neg negative minus inv inverse drop gain delta diff change increase decrease reduction "
    "improvement gap".split()
)


def infer_mode(metric: str) -> Optional[str]:
    """``"min"`` or ``"max"`` from the words of a metric's name (``val_loss``: min, ``top1_acc``:
    max), None when they do not tell, disagree, or negate the metric or speak of its change
    (``neg_log_loss``, ``accuracy_drop``).

    Example::

        >>> infer_mode("val/loss"), infer_mode("mAP50"), infer_mode("step")
        ('min', 'max', None)
        >>> infer_mode("neg_log_loss"), infer_mode("accuracy_drop")
        (None, None)
    """
    words = set()
    for part in re.split(r"[^A-Za-z0-9]+", metric):  # val_mIoU -> val, mIoU
        for word in [part, *re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", part)]:  # valError
            word = word.lower()
            words |= {word, word.rstrip("0123456789")}  # mAP50 -> map50, map
    lower = words & _LOWER_IS_BETTER
    higher = words & _HIGHER_IS_BETTER
    if bool(lower) == bool(higher) or words & _AMBIGUOUS:
        return None
    return "min" if lower else "max"


class MetricWatch:
    """Judges each new value of ``metric`` against the best one so far.

    Args:
        metric: A name that the ``EvalHook``'s function returns.
        mode: ``"max"`` (higher is better, e.g. accuracy) or ``"min"`` (e.g. a loss); None
            infers it from the name ([`infer_mode`][]) and refuses a name that does not tell.
        min_delta: How much better a value must be to count as an improvement.

    Example::

        >>> watch = MetricWatch("val_acc")  # mode="max", from the name
        >>> watch.improves(0.5), watch.improves(0.4)
        (True, False)
    """

    def __init__(self, metric: str, mode: Optional[str] = None, min_delta: float = 0.0) -> None:
        check_type("metric", metric, str, "a str (the name an EvalHook logs)")
        check_type("min_delta", min_delta, NUMBER, "a number >= 0")
        self._inferred = mode is None  # for log_mode()
        if mode is None:
            mode = infer_mode(metric)
            if mode is None:
                raise ValueError(f"mode: is {metric!r} better high or low? Pass 'max' or 'min'.")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min', 'max' or None, got {mode!r}.")
        if not min_delta >= 0:
            raise ValueError(f"min_delta must be >= 0, got {min_delta!r}.")
        self.metric = metric
        self.mode = mode
        self.min_delta = min_delta
        self.best: Optional[float] = None

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``; if so it becomes
        the best. A NaN never does, nor infinity after infinity."""
        if math.isnan(value):
            return False
        if self.best is not None and not self.beats(value, self.best):
            return False
        self.best = value
        return True

    def beats(self, value: float, other: float) -> bool:
        """Whether ``value`` is better than ``other`` by more than ``min_delta`` (a NaN never
        is, nor infinity than infinity)."""
        margin = value - other if self.mode == "max" else other - value
        return margin > self.min_delta  # inf - inf is NaN

    def log_mode(self, hook: str) -> None:
        """Log which way ``hook`` judges the metric, and whether its name told."""
        better = "lower" if self.mode == "min" else "higher"
        how = "from the name" if self._inferred else "given"
        logger.info(f"{hook} judges {self.metric}: {better} is better (mode={self.mode!r}, {how}).")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]


def warn_if_missing(hook: Any, argument: str, metric: str, results: dict[str, float]) -> bool:
    """Warn that an evaluation's ``results`` lack the ``metric`` that ``hook`` watches (a misspelt
    name, most likely, which would leave the hook idle), unless it is known to come: the metric
    storage holds it (from an earlier evaluation, or the run resumed), or another ``EvalHook``
    may return it. Returns whether it warned."""
    trainer = hook.trainer
    if metric in results or metric in trainer.metric_storage:
        return False
    if sum(isinstance(h, EvalHook) for h in trainer.hooks) > 1:
        return False  # the other may return it, perhaps at a later epoch
    logger.warning(
        f"{hook.class_name} watches {metric!r}, but the evaluation gave only: "
        f"{', '.join(sorted(results))}; set {argument} to one of those."
    )
    return True


def record_results(
    record: dict[str, dict[str, Any]],
    results: dict[str, float],
    iters: int,
    modes: dict[str, str],
) -> None:
    """Keep in ``record`` the final and best value of every result of an evaluation after
    ``iters`` iterations, with the iteration of the best (the best judged by ``modes``, the
    modes hooks judge metrics by, else by the name, see [`infer_mode`][]; none for a name that
    does not tell)."""
    for name, value in results.items():
        entry = record.setdefault(name, {"best": None, "best_iter": None})
        entry["final"] = value
        mode = modes.get(name) or infer_mode(name)
        if mode is not None:
            watch = MetricWatch(name, mode)
            watch.best = entry["best"]
            if watch.improves(value):
                entry["best"] = value
                entry["best_iter"] = iters
