"""The best value so far of an evaluation metric, for hooks that act on it, and the warning
when the metric never comes."""

import logging
import math
import re
from collections.abc import Iterable
from typing import Any, Optional

from ..misc import NUMBER, check_type
from .eval_hook import EvalHook

logger = logging.getLogger(__name__)

# Words in a metric's name that tell which way is better.
_LOWER_IS_BETTER = {"loss", "err", "error", "errors", "mse", "mae", "rmse", "nll", "ppl",
                    "perplexity", "cer", "wer", "fid", "distance", "dist"}  # fmt: skip
_HIGHER_IS_BETTER = {"acc", "accuracy", "ap", "map", "f1", "iou", "miou", "auc", "auroc",
                     "precision", "recall", "bleu", "rouge", "dice", "psnr", "ssim", "r2",
                     "score", "reward"}  # fmt: skip


def infer_mode(metric: str) -> Optional[str]:
    """``"min"`` or ``"max"`` from the words of a metric's name (``val_loss``: min, ``top1_acc``:
    max), None when they do not tell or disagree.

    Example::

        >>> infer_mode("val/loss"), infer_mode("mAP50"), infer_mode("step")
        ('min', 'max', None)
    """
    words = set()
    for part in re.split(r"[^A-Za-z0-9]+", metric):  # val_mIoU -> val, mIoU
        for word in [part, *re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", part)]:  # valError
            word = word.lower()
            words |= {word, word.rstrip("0123456789")}  # mAP50 -> map50, map
    lower, higher = words & _LOWER_IS_BETTER, words & _HIGHER_IS_BETTER
    if bool(lower) == bool(higher):
        return None
    return "min" if lower else "max"


class MetricWatch:
    """Judges each new value of ``metric`` against the best one so far.

    Args:
        metric: A name that the ``EvalHook``'s function returns.
        mode: ``"max"`` (higher is better, e.g. accuracy) or ``"min"`` (e.g. a loss); None
            infers it from the name (:func:`infer_mode`) and refuses a name that does not tell.
        min_delta: How much better a value must be to count as an improvement.

    Example::

        >>> watch = MetricWatch("val_acc")  # mode="max", from the name
        >>> watch.improves(0.5), watch.improves(0.4)
        (True, False)
    """

    def __init__(self, metric: str, mode: Optional[str] = None, min_delta: float = 0.0) -> None:
        check_type("metric", metric, str, "a str (the name an EvalHook logs)")
        check_type("min_delta", min_delta, NUMBER, "a number >= 0")
        if mode is None:
            mode = infer_mode(metric)
            if mode is None:
                raise ValueError(
                    f"mode: the name {metric!r} does not tell whether higher or lower is better. "
                    "Pass mode='min' (a loss or an error) or mode='max' (an accuracy or a score)."
                )
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min', 'max' or None (inferred from the name), "
                             f"got {mode!r}.")  # fmt: skip
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


class MetricArrival:
    """Warns, once, when evaluations ran and none gave the metric a hook judges: a misspelt
    name, most likely, which would leave the hook idle without a word.

    The hook calls :meth:`note` with each evaluation's results (in ``after_eval``) and
    :meth:`check` when an epoch starts and when training ends. The metric is missing once every
    ``EvalHook`` has evaluated (in this run or the one it resumes) and neither their results nor
    any other ``after_eval`` named it. An evaluation is judged once it is complete: at the next
    epoch's start, or at an evaluation after a later iteration, since a hook that runs after it
    in the same event may still evaluate the metric. Every rank sees the same results and the
    same metric storage (reduced at the epoch's end), so every rank warns alike, in its own log,
    without a collective.

    Args:
        owner: The hook, as the warning names it (``"BestCheckpointHook"``).
        metric: The name the hook judges.
        consequence: What the hook does without it (``"no best.pth is written"``).
        logged: The metric also counts when it is in ``trainer.metric_storage`` (logged with
            ``trainer.log``), for a hook that reads it there.
        argument: The hook's argument that names the metric.

    Example::

        >>> arrival = MetricArrival("BestCheckpointHook", "val_acc", "no best.pth is written")
    """

    def __init__(
        self, owner: str, metric: str, consequence: str, logged: bool = False,
        argument: str = "metric",
    ) -> None:  # fmt: skip
        self.owner, self.metric, self.consequence, self.logged = owner, metric, consequence, logged
        self.argument = argument
        self._names: set[str] = set()  # the names evaluated in this run
        self._last: Optional[tuple[int, int]] = None  # (epochs, iterations) done at the last one
        self._evaluations = 0  # the iterations after which evaluations ran
        self._done = False  # the metric came, or the warning was logged

    def note(self, trainer: Any, results: Iterable[str]) -> None:
        """Note an evaluation's result names, judging the earlier evaluations first when this
        one comes after a later iteration (they are complete)."""
        done = (trainer.cur_epoch + 1, trainer.cur_iter + 1)
        if self._last is not None and done[1] != self._last[1]:
            self.check(trainer)
        if self._last is None or done[1] != self._last[1]:
            self._evaluations += 1
        self._names.update(results)
        self._last = done
        self._done |= self.metric in self._names

    def check(self, trainer: Any, ended: bool = False) -> None:
        """Warn if the evaluations so far are complete and none gave the metric; ``ended``:
        training ended (a run that evaluated nothing to its end is warned about too)."""
        if self._done or (ended and trainer.cur_iter < trainer.start_iter):  # nothing trained
            return
        names, pending = set(self._names), False
        for hook in trainer.hooks:  # their names include those of the run they resume
            if isinstance(hook, EvalHook):
                names |= hook.names
                pending |= not hook.evaluated
        storage = trainer.metric_storage
        if self.metric in names or (self.logged and self.metric in storage):
            self._done = True
            return
        if names and not pending and (self._last is not None or ended):
            self._done = True
            logger.warning(
                f"{self.owner} watches {self.metric!r}, but {self._evaluated(trainer)} gave only: "
                f"{', '.join(sorted(names))}; {self.consequence}. Set {self.argument} to one of "
                f"those{self._hint(storage)}."
            )
        elif not names and ended and trainer.progress.finished:  # not failed early
            self._done = True
            if self.logged:
                logger.warning(
                    f"{self.owner} watches {self.metric!r}, but nothing evaluated or logged it "
                    f"(logged: {', '.join(sorted(storage))}), so {self.consequence}. Return it "
                    "from an EvalHook's function or log it with trainer.log."
                )
            else:
                logger.warning(
                    f"{self.owner} watches {self.metric!r}, but no evaluation ran, so "
                    f"{self.consequence}. Register an EvalHook whose function returns it."
                )

    def _evaluated(self, trainer: Any) -> str:
        """Which evaluations the warning speaks of."""
        if self._last is None or trainer.start_iter > 0:  # those of the run resumed too
            return "the evaluations so far"
        epochs, iters = self._last
        when = f"epoch {epochs}" if trainer.train_by_epoch else f"iteration {iters}"
        if self._evaluations == 1:
            return f"the evaluation after {when}"
        return f"the evaluations up to {when}"

    def _hint(self, storage: Any) -> str:
        """Why a metric logged with ``trainer.log`` does not count for this hook."""
        if self.logged or self.metric not in storage:
            return ""
        return (
            f", or return {self.metric!r} from an EvalHook's function: {self.owner} judges "
            "evaluation results, not values logged with trainer.log"
        )


def record_results(
    record: dict[str, dict[str, Any]], results: dict[str, float], iters: int
) -> None:
    """Keep in ``record`` the final and best value of every result of an evaluation after
    ``iters`` iterations, with the iteration of the best (the best judged by the name, see
    :func:`infer_mode`; none for a name that does not tell)."""
    for name, value in results.items():
        entry = record.setdefault(name, {"best": None, "best_iter": None})
        entry["final"] = value
        mode = infer_mode(name)
        if mode is not None:
            watch = MetricWatch(name, mode)
            watch.best = entry["best"]
            if watch.improves(value):
                entry["best"], entry["best_iter"] = value, iters
