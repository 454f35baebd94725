"""The end-of-run summary table."""

import datetime
import os
from typing import Any, Optional

from tabulate import tabulate

from ..writers import format_seconds


def summary_table(
    trainer: Any, seconds: float, iters: int, evals: dict[str, dict[str, Any]], logs: list[str]
) -> str:
    """The table logged when training ends: the wall time of this ``train()`` (``seconds``, for
    ``iters`` iterations) and where it went, the evaluated metrics' final and best values
    (``evals``), the checkpoints and the ``logs`` written."""
    wall = format_seconds(seconds)
    if seconds >= 60:
        wall = str(datetime.timedelta(seconds=round(seconds)))
    done = f"iteration {trainer.cur_iter + 1} of {trainer.max_iters}"
    if iters:
        speed = f"{wall} for {iters} iterations ({iters / max(seconds, 1e-9):.3g} it/s), {done}"
        rows = [
            ["wall time", speed],
            ["data loading", _share(trainer.progress.data_seconds, seconds)],
        ]
        hooks = sorted(trainer.hooks.seconds_by_class().items(), key=lambda item: -item[1])
        rows += [[f"hook {name}", _share(s, seconds)] for name, s in hooks]
    else:
        rows = [["wall time", f"{wall}, no iteration to train: {done}"]]
    for name, entry in evals.items():
        value = f"final {entry['final']:.5g}"
        if entry["best"] is not None:
            value += f", best {entry['best']:.5g} (after iteration {entry['best_iter']})"
        rows.append([name, value])
    last, best = trainer.checkpointer.last_path, _best_checkpoint(trainer)
    rows.append(["last checkpoint", os.path.abspath(last) if last else "none"])
    if best is not None:
        rows.append(["best checkpoint", os.path.abspath(best)])
    folders = {os.path.dirname(path) for path in logs}
    if len(folders) == 1:  # the usual: all in work_dir
        logs = [f"{', '.join(map(os.path.basename, logs))} in {folders.pop()}"]
    rows.append(["logs", ", ".join(logs)])
    return tabulate(rows, headers=["Run summary", ""], tablefmt="simple")


def _share(part: float, whole: float) -> str:
    return f"{format_seconds(part)} ({100 * part / max(whole, 1e-9):.1f}%)"


def _best_checkpoint(trainer: Any) -> Optional[str]:
    for hook in trainer.hooks:
        path = getattr(hook, "best_checkpoint", None)
        # on disk, or the last save, which may still be written in the background
        if isinstance(path, str) and (
            os.path.exists(path) or path == trainer.checkpointer.last_path
        ):
            return path
    return None
