"""The type and integer checks the Trainer's arguments, the hooks and the LR warmup share."""

from typing import Any, Union

NUMBER = (int, float)


def check_type(name: str, value: Any, types: Union[type, tuple[type, ...]], what: str) -> None:
    """Raise ``TypeError`` unless ``value`` is one of ``types`` (a bool is no int here)."""
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}.")


def check_int(name: str, value: Any, minimum: int, note: str = "") -> None:
    """Raise ``TypeError`` unless ``value`` is an int, ``ValueError`` if below ``minimum``."""
    what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    what += f" ({note})" if note else ""
    check_type(name, value, int, what)
    if value < minimum:
        raise ValueError(f"{name} must be {what}, got {value!r}.")
