"""Why a checkpoint save failed, as its error says: state that would not load, tensors not
finite, a write that failed. Imported only when one of those happens."""

from collections.abc import Iterator
from typing import Any, NoReturn, Optional

# The owners of a checkpoint's top-level keys, as a message names them.
_OWNERS = {
    "model": "the model", "optimizer": "the optimizer", "lr_scheduler": "the LR scheduler",
    "grad_scaler": "the GradScaler", "metric_storage": "the metric storage",
}  # fmt: skip


def unloadable_message(file_name: str, path: tuple, value: Any) -> str:
    """Why a state cannot be saved (``value`` at ``path`` would not load): whose
    ``state_dict()`` holds what, where, and the fix."""
    top, *rest = path or ("?",)
    if top in ("hooks", "extra") and rest:
        kind = "hook" if top == "hooks" else "checkpointable"
        owner, rest = f"{kind} {rest[0]!r}", rest[1:]
    elif top == "rng" and rest[1:2] == ["loader"]:  # a stateful data loader's own state
        owner, rest = "the data loader", rest[2:]
    else:
        owner = _OWNERS.get(top, f"the trainer's {top!r}")
    kind = type(value)
    module = "" if kind.__module__ == "builtins" else kind.__module__.split(".")[0] + "."
    where = "".join(f"[{key!r}]" for key in rest) or "the top"
    return (
        f"Not saving {file_name}: the state_dict() of {owner} holds a {module}"
        f"{kind.__qualname__} at state_dict(){where}, which torch.load(weights_only=True) "
        "cannot rebuild, so no run could resume from this checkpoint. Return plain data from "
        "state_dict() (dicts, lists, tuples, str, numbers, None, tensors) and rebuild the "
        "object in load_state_dict(): e.g. dict(x) for a defaultdict, tuple(x) or x._asdict() "
        "for a namedtuple, x.tolist() or torch.from_numpy(x) for a NumPy array, float(x) for a "
        "NumPy float32, x.as_subclass(torch.Tensor) for a tensor subclass."
    )


def refusal(
    file_name: str, iters_done: int, unloadable: Optional[str], bad: list[str]
) -> Exception:
    """The error of a save refused for an ``unloadable`` value or ``bad`` tensors."""
    if unloadable:
        return TypeError(unloadable)
    return FloatingPointError(
        f"Not saving {file_name}: after iteration {iters_done}, "
        f"{len(bad)} tensors hold NaN or infinite values ({', '.join(bad[:5])}"
        f"{', ...' if len(bad) > 5 else ''}). The latest checkpoint is still the last "
        "good one. Lower the LR, enable clip_grad_norm, or check the data and the loss "
        "of the last iterations (a NaN gradient can come with a finite loss)."
    )


def raise_write_failure(path: str, error: BaseException) -> NoReturn:
    """Raise the error of a failed write of ``path``, saying what is kept, if an ``OSError`` is
    behind ``error`` (torch.save reports a full disk as a RuntimeError of its own, with the
    OSError as its context); else ``error`` itself."""
    cause = next((c for c in _chain(error) if isinstance(c, OSError)), None)
    if cause is None:
        raise error
    message = (
        f"Could not write {path}: {cause.strerror or cause}. The previous checkpoint "
        "and latest.txt are untouched; free disk space or pick another work_dir."
    )
    # OSError(None, message) would read "[Errno None] ..."
    raise (OSError(cause.errno, message) if cause.errno else OSError(message)) from error


def _chain(error: Optional[BaseException]) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__
