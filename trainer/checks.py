"""The integer check that the Trainer's arguments, the hooks, the LR warmup and the metric
buffers share, so that one bad value gives one kind of error wherever it is passed."""

from typing import Any


def check_int(name: str, value: Any, minimum: int, note: str = "") -> None:
    """Raise ``TypeError`` unless ``value`` is an int (a bool is not), ``ValueError`` if it is
    below ``minimum``; the message names ``name``, what it must be (and ``note`` in brackets:
    what 0 means, say) and what it got.

    Example::

        >>> check_int("period", 0, minimum=1)
        Traceback (most recent call last):
        ...
        ValueError: period must be a positive int, got 0.
    """
    what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    what += f" ({note})" if note else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be {what}, got {value!r}.")
