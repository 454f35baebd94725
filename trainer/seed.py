"""Seeding every random number generator that training depends on."""

import logging
import os
import random
from typing import Optional

import numpy as np
import torch

from .distributed import get_rank
from .logger import ensure_console_logging

logger = logging.getLogger(__name__)


def set_random_seed(seed: Optional[int] = None, deterministic: bool = False) -> int:
    """Seed Python, NumPy and torch (CPU and every CUDA device).

    Args:
        seed: The seed; None or a negative one (core-pytorch-utils' -1) draws one from the OS
            and logs it, so that the run can be repeated. It is returned.
        deterministic: Also make cuDNN and torch pick deterministic algorithms (slower).

    Example::

        >>> set_random_seed(0)
        0
    """
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}.")
        seed = int(seed)
        if seed >= 2**32:
            raise ValueError(
                f"seed must be below 2**32 (NumPy's limit), got {seed}; pass None or a negative "
                "seed to have one picked."
            )
    if seed is None or seed < 0:
        # under torchrun each rank picks its own; rank 0 shows it, even before logging is set up
        seed = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        ensure_console_logging("trainer", get_rank())
        logger.info(f"Using a random seed: {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    return seed
