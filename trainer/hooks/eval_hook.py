"""Runs an evaluation function periodically and logs its results."""

import logging
import numbers
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch

from ..distributed import get_world_size
from ..evaluation import eval_mode
from ..metric_storage import TRAINER_METRICS, reduce_over_ranks
from ..misc import check_int, check_type
from ..writers import tensorboard_tag, trainer_writes
from .hookbase import HookBase, Priority

logger = logging.getLogger(__name__)


class EvalHook(HookBase):
    """Evaluates every ``period`` epochs (epoch-based training) or iterations (iteration-based),
    and at the end of training, and logs the results under their names.

    Two forms:

    - ``EvalHook(period, data_loader=..., metric_fn=...)`` evaluates exactly, through
      [`Trainer.evaluate`][]: the mean of ``metric_fn(model, batch)``'s per-sample values
      over every sample of ``data_loader``, each counted once, also under torchrun.
    - ``EvalHook(period, eval_func)`` calls ``eval_func()``, with the model in eval mode (every
      module put back in its mode after), and logs the dict of numbers it returns.
      ``eval_func`` turns off autograd itself (``torch.no_grad()``). Under torchrun every rank
      calls it and logs the mean of the results over the ranks that returned some, each
      rank's numbers weighing alike (exact for equal shards): evaluate a shard per rank and
      return its numbers, or evaluate on rank 0 and return None elsewhere (the others wait in
      the collective that shares rank 0's results).

    Results land in ``trainer.metric_storage`` (not smoothed), TensorBoard (``eval/<name>``) and
    the console, where ``LRUpdateHook`` finds the metric that ``ReduceLROnPlateau`` judges, and
    ``after_eval`` hooks (best checkpoint, early stopping) get them.

    Args:
        period: Epochs or iterations between evaluations; 0 evaluates at the end only.
        eval_func: A callable with no arguments returning ``{name: number}`` (or None).
        data_loader: The batches to evaluate (with ``metric_fn``, instead of ``eval_func``).
        metric_fn: ``metric_fn(model, batch) -> {name: tensor of shape [batch]}``.

    Example::

        >>> hook = EvalHook(1, lambda: {"val_acc": 0.9})
        >>> def accuracy(model, batch):
        ...     x, y = batch
        ...     return {"val_acc": (model(x).argmax(1) == y).float()}
        >>> hook = EvalHook(1, data_loader=[(torch.randn(4, 2), torch.ones(4))],
        ...                 metric_fn=accuracy)
    """

    priority = Priority.EVAL

    def __init__(
        self,
        period: int,
        eval_func: Optional[Callable[[], Optional[dict]]] = None,
        *,
        data_loader: Any = None,
        metric_fn: Optional[Callable[[Any, Any], dict[str, torch.Tensor]]] = None,
    ) -> None:
        check_int("period", period, minimum=0, note="0 evaluates at the end only")
        given = (eval_func is not None, data_loader is not None, metric_fn is not None)
        if given not in ((True, False, False), (False, True, True)):
            raise TypeError("Pass EvalHook either eval_func, or data_loader and metric_fn.")
        for name, value in (("eval_func", eval_func), ("metric_fn", metric_fn)):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}.")
        if data_loader is not None:  # not at the first evaluation, after training some
            expected = "an iterable of batches (a DataLoader, a list)"
            check_type("data_loader", data_loader, Iterable, expected)
        self._period = period
        self._eval_func = eval_func
        self._data_loader = data_loader
        self._metric_fn = metric_fn
        # the names of its results, in the runs it resumes too: they are not another's
        self._names: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        """The names of the results so far, so that a resumed run tells them from others'."""
        return {"names": sorted(self._names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned."""
        self._names = set(state["names"])

    def after_iter_period(self) -> int:
        """In iteration-based training, every ``period``-th iteration (and the last); in
        epoch-based training, never."""
        if self.trainer.train_by_epoch:
            return 0
        return self._period if self._period > 0 else self.trainer.max_iters

    def after_iter(self) -> None:
        """Evaluate in iteration-based training."""
        self._evaluate()

    def after_epoch(self) -> None:
        """Evaluate in epoch-based training."""
        if self.trainer.train_by_epoch and (
            self.every_n_epochs(self._period) or self.is_last_epoch()
        ):
            self._evaluate()

    def _evaluate(self) -> None:
        if self._eval_func is None:  # the same numbers on every rank
            results: Optional[dict[str, float]] = self.trainer.evaluate(
                self._data_loader, self._metric_fn
            )
        else:
            results = self._call_eval_func()
        if results is None:
            return
        self._refuse_clashes(results)
        line = "  ".join(f"{k}: {v:.5g}" for k, v in results.items())
        logger.info(f"Evaluation after iteration {self.trainer.cur_iter + 1}: {line}")
        # numbers already, the same on every rank: in the storage at once, for the hooks
        self.trainer.metric_storage.add(self.trainer.cur_iter, results, smooth=False)
        self.trainer.hooks.call("after_eval", results)

    def _call_eval_func(self) -> Optional[dict[str, float]]:
        # dropout off, batch norm on its running statistics; then every module in its mode
        with eval_mode(self.trainer.model):
            results = self._eval_func()
        if results is not None:
            results = _check_results(results)
        if get_world_size() > 1:  # over the trainer's gloo group, whose threads end with training
            totals = None if results is None else {name: [v] for name, v in results.items()}
            means = reduce_over_ranks(totals, self.trainer.cpu_group, source="eval_func")
            results = None if means is None else {name: v[0] for name, v in means.items()}
        return results

    def _refuse_clashes(self, results: dict[str, float]) -> None:
        """Refuse a new result name that the trainer writes itself, or that another series logs,
        under that name or its TensorBoard tag: mixed into one, they would log neither what was
        evaluated nor what was trained."""
        new = results.keys() - self._names
        if not new:
            return
        evaluated = {
            name
            for hook in self.trainer.hooks
            if isinstance(hook, EvalHook) and hook is not self
            for name in hook._names
        }
        others = TRAINER_METRICS | self.trainer.metric_storage.keys() - self._names
        tags = {tensorboard_tag(name, name in evaluated): name for name in others}
        source = "eval_func" if self._eval_func else "metric_fn"
        for name in sorted(new):
            if trainer_writes(name):  # in metrics.jsonl's rows
                raise ValueError(
                    f"{source} returned {name!r}, a name the trainer writes itself (iter, epoch, "
                    f"lr/..., grad_norm/...): rename it, e.g. 'val_{name}'."
                )
            clash = name if name in others else tags.get(tensorboard_tag(name, evaluated=True))
            if clash is not None:  # logged in training or by another EvalHook
                raise ValueError(
                    f"{source} returned {name!r}, which would mix with the {clash!r}: rename it."
                )
        self._names |= new


def _check_results(results: object) -> dict[str, float]:
    if not isinstance(results, dict):
        raise TypeError(f"eval_func must return a dict of numbers or None, got {type(results)}.")
    checked = {}
    for name, value in results.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"eval_func returned {name!r}={value!r}, not a number.")
        checked[str(name)] = float(value)
    return checked
