"""Exiting for a preemption signal, with the status a shell reports for death by it (128 + its
number): imported once a signal has arrived."""

import logging
import signal
from typing import NoReturn, Optional

logger = logging.getLogger("trainer.preemption")  # the public module, in log lines


def exit_preempted(signum: int, path: Optional[str], iters_done: int) -> NoReturn:
    """Exit after the checkpoint at ``path`` (None on ranks that do not write) was saved."""
    status = 128 + signum
    logger.warning(
        f"Preempted by {signal.Signals(signum).name} after iteration {iters_done}: saved "
        f"{path or 'a checkpoint (rank 0 writes)'}; exiting with status {status}. Rerun the "
        "same command to resume."
    )
    raise SystemExit(status)


def exit_after_training(signum: int) -> NoReturn:
    """Exit for a signal that arrived after the last iteration: training is complete."""
    status = 128 + signum
    logger.warning(
        f"{signal.Signals(signum).name} arrived after the last iteration: training is complete; "
        f"exiting with status {status}, as the signal asks."
    )
    raise SystemExit(status)
