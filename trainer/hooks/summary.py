"""The end-of-run summary table."""

import datetime
import os
from typing import Any

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
        data = _share(trainer.progress.data_seconds, seconds)
        rows = [["wall time", speed], ["data loading", data]]
        hooks = sorted(trainer.hooks.seconds_by_class().items(), key=lambda item: -item[1])
        rows += [[f"hook {name}", _share(s, seconds)] for name, s in hooks]
    else:
        rows = [["wall time", f"{wall}, no iteration to train: {done}"]]
    for name, entry in evals.items():
        value = f"final {entry['final']:.5g}"
        if entry["best"] is not None:
            value += f", best {entry['best']:.5g} (after iteration {entry['best_iter']})"
        rows.append([name, value])
    last = trainer.checkpointer.last_path
    rows.append(["last checkpoint", os.path.abspath(last) if last else "none"])
    for hook in trainer.hooks:  # a BestCheckpointHook's, on disk or still being written (last)
        best = getattr(hook, "best_checkpoint", None)
        if isinstance(best, str) and (os.path.exists(best) or best == last):
            rows.append(["best checkpoint", os.path.abspath(best)])
            break
    folders = {os.path.dirname(path) for path in logs}
    if len(folders) == 1:  # the usual: all in work_dir
        logs = [f"{', '.join(map(os.path.basename, logs))} in {folders.pop()}"]
    rows.append(["logs", ", ".join(logs)])
    return tabulate(rows, headers=["Run summary", ""], tablefmt="simple")


def _share(part: float, whole: float) -> str:
    return f"{format_seconds(part)} ({100 * part / max(whole, 1e-9):.1f}%)"
