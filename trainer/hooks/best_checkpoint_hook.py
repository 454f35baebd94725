"""Keeps the checkpoints of the best evaluation results."""

import logging
import math
import os
import re
from typing import Any, Optional

from ..checkpoint import written_by_trainer
from ..distributed import is_main_process
from ..misc import check_file_name, check_int
from .checkpoint_hook import delete_checkpoints
from .hookbase import HookBase, Priority
from .metric_watch import MetricWatch, warn_if_missing

logger = logging.getLogger(__name__)


class BestCheckpointHook(HookBase):
    """Keeps the checkpoints of the ``top_k`` best evaluations by ``metric`` (full checkpoints,
    written atomically like every other): by default one, ``best.pth``, replaced at each new
    best. A NaN never enters; a tie keeps the earlier.

    With ``top_k`` > 1 each is a file of its own, named by the iteration and the value:
    ``best-iter=1200-val_acc=0.9312.pth`` for ``file_name="best.pth"``. A file is never renamed
    (a path you copied keeps its meaning); a result better than the worst kept is saved, and
    the worst is deleted once the new one is on disk. [`best_checkpoint`][] is the best's
    path, [`best_checkpoints`][] maps each kept path to its value, best first.

    The first evaluation that lacks ``metric`` (a misspelt name) is warned about, naming the
    results that came (see ``trainer.hooks.metric_watch.warn_if_missing``).

    The save waits for the end of the iteration or epoch (after the LR update and the regular
    checkpoint), so a best checkpoint resumes exactly too. The kept files and values are saved
    in checkpoints, so a resumed run goes on with the same ones; a best found but not yet on
    disk when the run was killed is written first thing.

    Args:
        metric: A name that the ``EvalHook``'s function returns.
        mode: ``"max"`` (higher is better) or ``"min"``; by default inferred from the name
            (``loss``, ``err``: min; ``acc``, ``ap``, ``f1``, ``iou``: max), and a name that does
            not tell is refused (docs/evaluation.md has the rule); logged when training starts.
        file_name: The file name in ``trainer.ckpt_dir`` (a sub-folder is made); not one the
            trainer writes itself (``epoch_N.pth``, ``iter_N.pth``, ``latest.txt``, a name ending
            in ``.tmp``, one in ``previous/``). With ``top_k`` > 1, the stem of the names. Two
            hooks that would write the same files are refused when training starts: each needs
            its own, unless both keep ``top_k`` > 1 of different metrics.
        top_k: How many of the best checkpoints to keep (Lightning's ``save_top_k``).

    Example::

        >>> hook = BestCheckpointHook("val_acc")  # mode="max", from the name
        >>> hook = BestCheckpointHook("val_loss", top_k=3)
    """

    priority = Priority.CHECKPOINT + 5

    def __init__(
        self, metric: str, mode: Optional[str] = None, file_name: str = "best.pth", top_k: int = 1
    ) -> None:
        check_file_name("file_name", file_name)
        if written_by_trainer(file_name):  # it would overwrite, or be overwritten or removed
            raise ValueError(
                f"file_name={file_name!r} is a name the trainer writes itself (epoch_N.pth, "
                "iter_N.pth, latest.txt, *.tmp, previous/...): pass another, such as 'best.pth'."
            )
        check_int("top_k", top_k, minimum=1)
        self._watch = MetricWatch(metric, mode)
        self._file_name = file_name
        self._top_k = top_k
        self._kept: list[tuple[str, float]] = []  # the files on disk and their values, best first
        self._due: Optional[tuple[str, float]] = None  # a result that enters, not saved yet
        self._warned = False  # that an evaluation lacked the metric

    @property
    def metric_watch(self) -> MetricWatch:
        """What judges ``metric``: its name and ``mode`` (the run summary's best follows it)."""
        return self._watch

    def before_train(self) -> None:
        """Refuse another ``BestCheckpointHook`` that would write the same files; log which way
        the metric is judged; delete what a resumed run keeps beyond ``top_k`` (a run stopped
        before it deleted the file that its last best replaced)."""
        for other in self.trainer.hooks:
            if other is self or not isinstance(other, BestCheckpointHook):
                continue
            same_names = 1 in (self._top_k, other._top_k) or self._metric == other._metric
            if self._file_name == other._file_name and same_names:
                raise ValueError(
                    f"Two BestCheckpointHooks, of metric={self._watch.metric!r} and "
                    f"metric={other._watch.metric!r}, would write the same files of "
                    f"file_name={self._file_name!r}: give each its own file_name."
                )
        self._watch.log_mode(self.class_name)
        dropped = self._kept[self._top_k :]
        self._kept = self._kept[: self._top_k]
        if dropped and is_main_process():  # the rank that writes
            for name, value in dropped:  # a lower top_k than the saved run's drops kept files
                logger.info(
                    f"Deleting {name} ({self._watch.metric} {value:.5g}): not among the "
                    f"top_k={self._top_k} best."
                )
            delete_checkpoints([self.trainer.checkpointer.path(name) for name, _ in dropped])

    def after_eval(self, results: dict[str, float]) -> None:
        """Note a result that enters the best; it is saved when the state is complete."""
        if not self._warned:
            self._warned = warn_if_missing(self, "metric", self._watch.metric, results)
        value = results.get(self._watch.metric)
        if value is None or not self._enters(value):
            return
        name = self._file_name if self._top_k == 1 else self._name(value)
        metric = self._watch.metric
        if self._top_k == 1:
            best = self._due or (self._kept[0] if self._kept else None)
            was = "" if best is None else f" (was {best[1]:.5g})"
            logger.info(f"New best {metric}: {value:.5g}{was}: saving {name}.")
        else:
            logger.info(f"{metric} {value:.5g} is among the {self._top_k} best: saving {name}.")
        self._due = (name, value)

    def _enters(self, value: float) -> bool:
        """Whether ``value`` beats the one due (if any) and the worst kept, or there is room."""
        if math.isnan(value):
            return False
        if self._due is not None and not self._watch.beats(value, self._due[1]):
            return False
        full = len(self._kept) >= self._top_k
        return not full or self._watch.beats(value, self._kept[self._top_k - 1][1])

    def _name(self, value: float) -> str:
        """``best-iter=1200-val_acc=0.9312.pth``: the stem of ``file_name``, the iterations done
        and the value."""
        stem, ext = os.path.splitext(self._file_name)
        return f"{stem}-iter={self.trainer.cur_iter + 1}-{self._metric}={value:.4g}{ext}"

    @property
    def _metric(self) -> str:
        """The metric's name as the names of the top_k > 1 files hold it."""
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self._watch.metric)  # val/acc: no folder

    def before_epoch(self) -> None:
        """Save the best due that the resumed checkpoint holds (see [`state_dict`][]): the
        state is the one it was found in. One found at an epoch's last iteration (a preemption's
        checkpoint there) waits for the epoch's end, as it did."""
        progress = self.trainer.progress
        if self._due and progress.position[1] < progress.epoch_iters:
            self._save()

    def after_iter(self) -> None:
        """Save a best found in iteration-based evaluation (at an epoch's end: after it)."""
        if self._due and not self.is_last_inner_iter():
            self._save()

    def after_epoch(self) -> None:
        """Save a best found in this epoch's evaluation."""
        if self._due:
            self._save()

    def after_train(self) -> None:
        """Save a due best that a finished run resumed with (its last, whose save was cut)."""
        if self._due and self.trainer.progress.outcome == "finished":
            self._save()

    @property
    def best_checkpoint(self) -> str:
        """The path of the best checkpoint (written once a best was found)."""
        name = self._kept[0][0] if self._kept else self._file_name
        return self.trainer.checkpointer.path(name)

    @property
    def best_checkpoints(self) -> dict[str, float]:
        """The path of each kept checkpoint and its value, best first (Lightning's
        ``best_k_models``)."""
        return {self.trainer.checkpointer.path(name): value for name, value in self._kept}

    def _save(self) -> None:
        """Save the result due; the checkpoint lists the one it pushes out, deleted once the new
        one is on disk (a run stopped before that deletes it when it resumes)."""
        name, value = self._due
        self._due = None
        kept = [entry for entry in self._kept if entry[0] != name] + [(name, value)]
        sign = -1 if self._watch.mode == "max" else 1
        self._kept = sorted(kept, key=lambda entry: sign * entry[1])  # stable: ties keep order
        dropped = [self.trainer.checkpointer.path(n) for n, _ in self._kept[self._top_k :]]
        self.trainer.save_checkpoint(name, then=lambda: delete_checkpoints(dropped))
        self._kept = self._kept[: self._top_k]

    def state_dict(self) -> dict[str, Any]:
        """The metric and file name, the best value saved, with ``top_k`` > 1 the files kept
        and their values, and a best found but not saved yet as ``due``. A periodic checkpoint
        of the same iteration or epoch end is saved before the best: a run killed while the
        best is written resumes from it, and writes the best due first thing."""
        best = self._kept[0][1] if self._kept else None
        state = {"metric": self._watch.metric, "file_name": self._file_name, "best": best}
        if self._top_k > 1:
            state["kept"] = [[name, value] for name, value in self._kept]
        if self._due:
            state["due"] = list(self._due)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][] returned. The state of a hook with another metric or
        file name (hooks' states are matched by class and order) is ignored with a warning:
        this hook starts afresh, and never adopts nor deletes that hook's files. A name that is
        not a file of this hook's in ``ckpt_dir`` is ignored with a warning, never deleted."""
        ours = (self._watch.metric, self._file_name)
        theirs = (state.get("metric", ours[0]), state.get("file_name", ours[1]))  # older: ours
        if theirs != ours:
            logger.warning(
                f"{self.class_name}(metric={ours[0]!r}, file_name={ours[1]!r}) ignores the "
                f"saved state of one with metric={theirs[0]!r}, file_name={theirs[1]!r}: it "
                "starts afresh, and leaves those files alone."
            )
            return
        best = state["best"]
        kept = state.get("kept", [[self._file_name, best]] if best is not None else [])
        self._kept = [(name, value) for name, value in kept if _may_be_ours(name)]
        due = state.get("due")
        self._due = (due[0], due[1]) if due and _may_be_ours(due[0]) else None


def _may_be_ours(name: Any) -> bool:
    """Whether ``name``, from a loaded state, can be a best checkpoint in ``ckpt_dir``; one that
    cannot is ignored with a warning, never written nor deleted."""
    try:
        check_file_name("kept", name)
        if not written_by_trainer(name):
            return True
    except (TypeError, ValueError):
        pass
    logger.warning(f"Ignoring {name!r} among the best checkpoints the state lists.")
    return False
