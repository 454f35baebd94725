"""What makes a checkpoint usable: the keys and types loading needs, finite weights (checked on
save and on load), and a training configuration that matches the trainer resuming it."""

import logging
import math
from collections.abc import Collection, Iterator
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)


def non_finite(state: Any, prefix: str = "", inf_ok: Collection[str] = ()) -> list[str]:
    """The names (``model.linear.weight``, ``optimizer.0.momentum_buffer``, ...) of the
    floating-point tensors in the nested dicts and lists of ``state`` that hold a NaN or an
    infinity (only a NaN for the names in ``inf_ok``); sharded tensors are checked in this
    rank's shard. One host read per device."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in _named_tensors(state, prefix):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor
        if local.is_floating_point() or local.is_complex():
            by_device.setdefault(local.device, []).append((name, local))
    bad = []
    for items in by_device.values():
        fine = [
            torch.isnan(t).any().logical_not() if name in inf_ok else torch.isfinite(t).all()
            for name, t in items
        ]
        bad += [name for (name, _), ok in zip(items, torch.stack(fine).tolist()) if not ok]
    return bad


def _named_tensors(state: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _named_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _named_tensors(value, f"{prefix}.{i}" if prefix else str(i))


def check_keys(data: dict[str, Any], path: str, keys: tuple[str, ...]) -> None:
    """Raise a RuntimeError naming ``path`` when ``data`` lacks any of ``keys``."""
    missing = [k for k in keys if k not in data]
    if missing:
        raise RuntimeError(
            f"Checkpoint {path!r} lacks {missing}: it was not written by trainer.save_checkpoint. "
            "For weights alone, use load_checkpoint(path, resume=False)."
        )


# What each part of a checkpoint must be: its type, and for dicts the keys it must have.
_STRUCTURE: dict[str, tuple[type, tuple[str, ...]]] = {
    "model": (dict, ()),
    "optimizer": (dict, ("state", "param_groups")),
    "progress": (dict, ("epoch", "inner_iter", "epoch_len")),
    "config": (dict, ("accumulation_steps", "amp")),
    "lr_scheduler": (dict, ()),
    "grad_scaler": (dict, ()),
    "metric_storage": (dict, ()),
    "hooks": (dict, ()),
    "rng": (list, ()),
}


def check_structure(data: dict[str, Any], path: str, keys: tuple[str, ...]) -> None:
    """Raise a RuntimeError naming ``path`` and the first problem when the parts ``keys`` of a
    checkpoint do not have the types and keys that loading them uses."""

    def damaged(reason: str) -> RuntimeError:
        return RuntimeError(f"Checkpoint {path!r} is damaged: {reason}.")

    for key in keys:
        kind, required = _STRUCTURE[key]
        value = data[key]
        if not isinstance(value, kind):
            raise damaged(f"{key!r} is of type {type(value).__name__}, expected {kind.__name__}")
        for name in required:
            if name not in value:
                raise damaged(f"{key!r} lacks {name!r}")
    if "model" in keys:
        wrong = [k for k, v in data["model"].items() if not isinstance(v, torch.Tensor)]
        if wrong:
            raise damaged(f"'model' holds {len(wrong)} entries that are not tensors ({wrong[0]!r})")
    if "progress" in keys:
        problem = _progress_problem(data["progress"])
        if problem:
            raise damaged(f"'progress' has {problem}")
    if "rng" in keys and not (
        data["rng"] and all(isinstance(r, dict) and "now" in r for r in data["rng"])
    ):
        raise damaged("'rng' is not a list of per-rank RNG states")


def _progress_problem(progress: dict[str, Any]) -> Optional[str]:
    """What is out of range in a checkpoint's ``progress``, or None: a wrong position would
    train from a negative iteration, or take an unfinished epoch for a finished one."""
    epoch_len = progress["epoch_len"]
    if epoch_len is not None and (not _is_int(epoch_len) or epoch_len < 1):
        return f"'epoch_len' = {epoch_len!r}, expected an int >= 1 or None"
    last_inner = epoch_len if epoch_len is not None else math.inf
    for key, upper in (("epoch", math.inf), ("inner_iter", last_inner), ("iters_done", math.inf)):
        if key == "iters_done" and key not in progress:  # older checkpoints lack it
            continue
        value = progress[key]
        if not _is_int(value) or not 0 <= value <= upper:
            expected = "an int >= 0" if upper == math.inf else f"an int from 0 to {upper}"
            return f"{key!r} = {value!r}, expected {expected}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def bad_tensors(data: dict[str, Any], parameters: Collection[str]) -> list[str]:
    """The tensors of a checkpoint's ``data`` that no run should go on from: the model's
    ``parameters``, the optimizer's state and the registered objects' must be finite, the
    model's buffers free of NaN (an infinity may be on purpose, as a causal mask's -inf is)."""
    state = {key: data[key] for key in ("model", "optimizer", "extra") if key in data}
    buffers = {f"model.{key}" for key in state.get("model", {}) if key not in parameters}
    return non_finite(state, inf_ok=buffers)


def check_finite(data: dict[str, Any], path: str, parameters: Collection[str]) -> None:
    """Raise a RuntimeError naming ``path`` when its tensors hold values no run should go on
    from (see :func:`bad_tensors`): a checkpoint written before saves refused them, or weights
    from elsewhere."""
    bad = bad_tensors(data, parameters)
    if bad:
        what = "resuming it would fail at once. Resume from an older checkpoint."
        if "optimizer" not in data:  # weights alone
            what = "training or evaluating from them would give NaN. Load other weights."
        raise RuntimeError(
            f"Checkpoint {path!r} holds NaN or infinite values in {len(bad)} tensors "
            f"({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}): {what}"
        )


def check_config(saved: dict[str, Any], now: dict[str, Any], path: str) -> None:
    """Refuse a checkpoint whose ``accumulation_steps`` (the data position would not map) or
    optimizer classes differ; warn about a changed AMP setting (training goes on, not bit for
    bit)."""
    if saved["accumulation_steps"] != now["accumulation_steps"]:
        raise ValueError(
            f"Checkpoint {path!r} was trained with accumulation_steps="
            f"{saved['accumulation_steps']}, this trainer has {now['accumulation_steps']}; "
            "the data position cannot be mapped. Resume with the same accumulation_steps."
        )
    for key, saved_class in saved.get("classes", {}).items():  # none in older checkpoints
        now_class = now["classes"].get(key, saved_class)
        if now_class != saved_class:
            raise ValueError(
                f"Checkpoint {path!r} holds the state of a {saved_class} for {key}, and this "
                f"trainer's {key} is a {now_class}: that state does not fit it. Resume with a "
                f"{saved_class}, or start the new optimizer from the checkpoint's weights alone: "
                "trainer.load_checkpoint(path, resume=False), then train(auto_resume=False) in "
                "a new work_dir."
            )
    if saved["amp"] != now["amp"]:
        logger.warning(
            f"Checkpoint {path} was trained with AMP {saved['amp']}, this run uses AMP "
            f"{now['amp']}: training goes on, but not bit for bit as the original run would."
        )
