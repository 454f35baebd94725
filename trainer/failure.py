"""What :meth:`Trainer.train` does when training fails or is interrupted (Ctrl-C)."""

import logging
import signal
from typing import Any

from . import logger as trainer_logging
from .logger import TRACEBACK_FOLLOWS

logger = logging.getLogger("trainer.trainer")


def after_failure(trainer: Any, error: BaseException) -> None:
    """Erase the progress bar's line, release the loader's workers, keep this rank's values
    logged since the last log point (no collective), and say what failed where. Ctrl-C ends
    the program with the status a shell reports for it; other errors go on being raised."""
    if trainer_logging.live_line is not None:  # a progress bar is drawing
        trainer_logging.live_line.erase()
    trainer._data.release()
    try:
        trainer._storage.flush()
    except FloatingPointError:
        pass  # a NaN loss among them: kept up to it, and the error in flight says the rest
    done = f"{trainer.cur_iter + 1} of {trainer.max_iters}"
    if isinstance(error, KeyboardInterrupt):
        last = trainer.checkpointer.last_path or "none yet: from the start"
        logger.warning(
            f"Interrupted (Ctrl-C) in iteration {done}: not saved. Rerun to resume from the "
            f"last checkpoint ({last})."
        )
        raise SystemExit(128 + signal.SIGINT) from None
    # the traceback in this rank's log file; on the console Python prints it, once
    where = f"in iteration {done}" if trainer.cur_iter >= trainer.start_iter else "as it started"
    logger.exception(
        f"Training failed {where}: {type(error).__name__}: {error}",
        extra={TRACEBACK_FOLLOWS: True},
    )
