"""Lazy exports (PEP 562): names whose module imports when first named, if a run uses them."""

from importlib import import_module
from typing import Any, Callable


def lazy_exports(namespace: dict[str, Any], lazy: dict[str, str]) -> tuple[Callable, Callable]:
    """``__getattr__`` and ``__dir__`` for the module whose ``globals()`` is ``namespace``;
    ``lazy`` maps each lazy name to its module, relative to the package."""

    def __getattr__(name: str) -> Any:
        if name not in lazy:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        return getattr(import_module(f".{lazy[name]}", namespace["__package__"]), name)

    def __dir__() -> list[str]:
        return sorted([*namespace, *lazy])

    return __getattr__, __dir__
