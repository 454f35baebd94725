"""core-pytorch-utils' ``cpu.misc`` path: :func:`set_random_seed` and :func:`collect_env`."""

from .env import collect_env
from .seed import set_random_seed

__all__ = ["collect_env", "set_random_seed"]
