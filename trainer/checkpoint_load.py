"""Loading checkpoints: the newest one that loads, what makes one usable (keys, types, finite
values, a matching configuration), the state put back, and where a resumed run goes on (mapped
when the world size or batch size changed). Imported by a run that loads a checkpoint."""

import glob
import logging
import math
import os
import re
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from .checkpoint_files import LATEST_POINTER, bad_tensors
from .data_resume import resume as resume_data
from .distributed import get_world_size
from .fsdp import keyed_by_name, load_full_model_state, load_full_optimizer_state
from .progress import Position

if TYPE_CHECKING:
    from .checkpoint import Checkpointer

logger = logging.getLogger(__name__)

# What a checkpoint needs to resume a run (a weights-only load needs "model" alone).
RESUME_KEYS = ("progress", "config", "model", "optimizer", "lr_scheduler", "grad_scaler",
               "metric_storage", "hooks", "rng")  # fmt: skip


def load(
    ckpt: "Checkpointer",
    path: Optional[str],
    auto_resume: bool,
    resume: bool,
    strict: bool,
    revise_keys: Optional[Sequence[tuple[str, str]]],
) -> bool:
    """What :meth:`Checkpointer.load` does once a fresh run is ruled out.

    Args:
        path: A checkpoint file, or a sharded checkpoint's folder; it must exist and load.
        auto_resume: With no ``path``, use the newest checkpoint in ``ckpt_dir`` that loads,
            ``latest.txt``'s first. One that fails to load is skipped with a warning; if none
            loads, this raises rather than start from scratch.
        resume: Restore everything (optimizer, LR schedule, GradScaler, progress, RNG,
            metrics, hooks, registered extras) to continue the run exactly. False loads the
            model's weights only, for fine-tuning or evaluation, from a trainer checkpoint
            or any file of weights: a ``state_dict``, or a dict holding one under
            ``"state_dict"`` or ``"model"``.
        strict: The model's keys and shapes must match the checkpoint's. False loads the
            weights that match in name and shape and logs what it skipped (fine-tuning a
            changed head, say); a file of which none matches is refused.
        revise_keys: ``[(regex, replacement), ...]`` applied in order to the file's keys
            with ``re.sub`` before loading, with ``resume=False``: ``[("^module[.]", "")]``
            drops the prefix of a checkpoint saved from a DDP model.
    """
    if revise_keys is not None:
        check_revise_keys(revise_keys, resume)
    if path is None and not auto_resume:
        raise ValueError("Pass a checkpoint path, or auto_resume=True to use the latest.")
    ckpt.wait()  # a write in flight may be the newest checkpoint
    candidates = list_checkpoints(ckpt.ckpt_dir) if path is None else []
    if path is None and not candidates:
        logger.debug(f"No checkpoint in {ckpt.ckpt_dir}: training from scratch.")
        return False
    parameters = ckpt.parameters()
    auto_picked = path is None
    if path is None:
        path, data = load_newest(candidates, ckpt)
        weights = data["model"]
    elif resume:
        data = load_resumable(path, ckpt)
        weights = data["model"]
    else:
        weights = model_weights(load_checkpoint_file(path), path)
    # weights saved from a torch.compile-d model by other means carry its prefix
    weights = {k.replace("_orig_mod.", ""): v for k, v in weights.items()}
    weights = revised(weights, revise_keys or (), path)
    if not resume and not auto_picked:  # load_newest checked the one it picked
        check_finite({"model": weights}, path, parameters)
    load_model_state(ckpt._module, weights, path, strict, ckpt._model_sharded)
    if not resume:
        logger.info(f"Loaded model weights from {path}; the training state is not restored.")
        return True
    _load_state(ckpt, data, path)
    ckpt.last_path = path
    logger.info(f"Resumed from checkpoint {path} at iteration {ckpt._progress.start_iter}.")
    return True


def _load_state(ckpt: "Checkpointer", data: dict[str, Any], path: str) -> None:
    """Put back the training state besides the model's weights."""
    check_config(data["config"], ckpt.config(), path)
    progress, accumulation = ckpt._progress, ckpt._config["accumulation_steps"]
    position = map_position(
        data["progress"], path, progress.epoch_len, ckpt._batch_size, accumulation
    )
    load_optimizer_state(
        ckpt._module, ckpt._optimizer, data["optimizer"], path, ckpt._model_sharded
    )
    for key, part in ckpt._parts.items():
        part.load_state_dict(data[key])
    for kind, owners, states in (
        ("hook", ckpt._hooks(), data["hooks"]),
        ("checkpointable", ckpt._extra, data.get("extra", {})),
    ):
        for key, owner in owners.items():
            if key in states:
                owner.load_state_dict(states[key])
            else:
                logger.warning(f"Checkpoint {path} holds no state for {kind} {key!r}.")
        for key in states.keys() - owners.keys():
            logger.warning(f"Checkpoint {path} has state for {kind} {key!r}, not registered.")
    # A checkpoint from an epoch's last iteration (a preemption there) resumes with the
    # epoch's end: the next pass starts fresh, nothing to skip.
    inner = position[1]
    mid_pass = progress.epoch_len is None or inner < progress.epoch_len
    remapped = inner != data["progress"]["inner_iter"] or len(data["rng"]) != get_world_size()
    resume_data(ckpt._data, data["rng"], path, inner * accumulation if mid_pass else 0, remapped)
    saved = data["progress"]
    progress.resume(position, saved.get("stopped", False), saved.get("iters_done", 0))


def load_checkpoint_file(path: str) -> dict[str, Any]:
    """Load a checkpoint with ``weights_only=True``: tensors and plain data only, never code.
    Of a sharded checkpoint's folder, the model's full weights alone (``{"model": ...}``)."""
    if os.path.isdir(path):
        from .sharded_checkpoint import is_sharded_checkpoint, read_weights

        if is_sharded_checkpoint(path):
            return {"model": read_weights(path)}
        raise IsADirectoryError(f"Checkpoint {path!r} is a directory, not a file.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint {path!r} does not exist.")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RuntimeError(
            f"Checkpoint {path!r} could not be loaded safely (weights_only=True): {e}"
        ) from e
    if not isinstance(data, dict):
        raise RuntimeError(f"Checkpoint {path!r} holds a {type(data).__name__}, expected a dict.")
    return data


def load_resumable(path: str, ckpt: "Checkpointer") -> dict[str, Any]:
    """The checkpoint at ``path``, if it can resume a run: every part there, of the types that
    loading uses, its tensors finite; else a RuntimeError naming ``path`` and the problem."""
    sharded = os.path.isdir(path)
    if sharded:  # a sharded checkpoint's folder (or an error naming what it is)
        from .sharded_checkpoint import read_resumable

        data = read_resumable(path, ckpt)  # its tensors checked already, on every rank alike
    else:
        data = load_checkpoint_file(path)
    check_keys(data, path, RESUME_KEYS)
    check_structure(data, path, RESUME_KEYS)
    if not sharded:
        check_finite(data, path, ckpt.parameters())
    return data


def read_latest_pointer(ckpt_dir: str) -> Optional[str]:
    """The path ``latest.txt`` names, or None when there is no pointer yet or it is damaged
    (then with a warning: the checkpoints are searched by age instead)."""
    pointer = os.path.join(ckpt_dir, LATEST_POINTER)
    if not os.path.lexists(pointer):
        return None
    try:
        with open(pointer, "rb") as f:
            name = f.read().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        reason = (
            "a directory, not a file" if os.path.isdir(pointer)
            else "not UTF-8 text" if isinstance(e, UnicodeDecodeError)
            else e.strerror or str(e)
        )  # fmt: skip
        logger.warning(f"{pointer} is damaged ({reason}); using the newest checkpoint by age.")
        return None
    return os.path.join(ckpt_dir, name) if name else None


def list_checkpoints(ckpt_dir: str) -> list[str]:
    """The ``.pth`` entries in ``ckpt_dir``, newest first, ``latest.txt``'s leading (a dangling
    link stays: loading it fails with a reason worth a warning)."""
    paths = sorted(glob.glob(os.path.join(ckpt_dir, "*.pth")), key=lambda p: (_mtime(p), p))[::-1]
    latest = read_latest_pointer(ckpt_dir)
    if latest in paths:
        paths.remove(latest)
        paths.insert(0, latest)
    return paths


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:  # a dangling link
        return 0.0


def load_newest(candidates: list[str], ckpt: "Checkpointer") -> tuple[str, dict[str, Any]]:
    """The first of ``candidates`` (newest first) that loads and can resume a run, as ``(path,
    data)``; one that does not is skipped with a warning, and if none does, this raises."""
    failures = []
    for path in candidates:
        try:
            data = load_resumable(path, ckpt)
        except (RuntimeError, OSError) as e:
            logger.warning(f"Skipping a checkpoint that does not load: {e}")
            failures.append(str(e))
            continue
        if failures:
            logger.warning(f"Resuming from {path}, the newest checkpoint that loads.")
        return path, data
    raise RuntimeError(
        f"None of the {len(failures)} checkpoints in {ckpt.ckpt_dir} loads:\n"
        + "\n".join(failures)
        + "\nMove them out of the folder to start afresh, or pass "
        "resume_from_checkpoint= a good file."
    )


def load_model_state(
    module: nn.Module, state: dict[str, Any], path: str, strict: bool, sharded: bool
) -> None:
    """Load checkpointed weights into ``module`` (the unwrapped model), listing the keys and
    shapes that differ; ``strict=False`` loads those that match."""
    own = module.state_dict()
    shape = {k: _shape(v) for k, v in own.items()}
    wrong_shape = [k for k in own if k in state and _shape(state[k]) != shape[k]]
    problems = "".join(
        f"\n  {title}: {', '.join(keys)}"
        for title, keys in [
            ("missing from the checkpoint", [k for k in own if k not in state]),
            ("not in the model", [k for k in state if k not in own]),
            (
                "shapes differ",
                [f"{k} {_shape(state[k])} vs {shape[k]}" for k in wrong_shape],
            ),
        ]
        if keys
    )
    matching = [k for k in state if k in own and k not in wrong_shape]
    hint = _prefix_hint(list(state), list(own)) if problems else ""
    if problems and strict:
        raise RuntimeError(
            f"Checkpoint {path!r} does not match the model:{problems}\nIf the model changed on "
            "purpose, train it in a new work_dir, or pass train(auto_resume=False) to start "
            "afresh in this one. To fine-tune from these weights instead, loading those that "
            f"match: load_checkpoint(path, resume=False, strict=False).{hint}"
        )
    if problems and not matching:  # strict=False would load nothing, and say it succeeded
        raise RuntimeError(
            f"Checkpoint {path!r} holds no weight that matches the model in name and shape: its "
            f"keys begin {_first(state)}, the model's {_first(own)}.{hint}"
        )
    if problems:
        logger.warning(
            f"Loading {path} with strict=False loaded {len(matching)} of the model's {len(own)} "
            f"entries and skipped:{problems}"
        )
        state = {k: state[k] for k in matching}
    if sharded:
        load_full_model_state(module, state, strict)
    else:
        module.load_state_dict(state, strict=strict)


def model_weights(data: dict[str, Any], path: str) -> dict[str, Any]:
    """The model's ``state_dict`` in a file of weights: a dict holding it under
    ``"state_dict"``, ``"model_state_dict"`` (PyTorch's tutorials) or ``"model"`` (a trainer
    checkpoint), or the file's dict itself."""
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(data.get(key), dict):
            data = data[key]
            break
    if not any(isinstance(value, torch.Tensor) for value in data.values()):
        raise RuntimeError(
            f"Checkpoint {path!r} holds no weights: expected a model's state_dict (names to "
            f"tensors), or a dict holding one under 'state_dict', 'model_state_dict' or 'model'; "
            f"its keys are {_first(data)}."
        )
    return data


def check_revise_keys(revise_keys: Any, resume: bool) -> None:
    """Refuse ``revise_keys`` that are not ``(regex, replacement)`` pairs of strings, or that
    come with ``resume=True``, whose checkpoint is loaded as it was saved."""
    if resume:
        raise ValueError(
            "revise_keys renames the weights of a file loaded with resume=False (fine-tuning, "
            "evaluation); a resumed run loads its own checkpoint as saved. Pass resume=False."
        )
    pairs = list(revise_keys) if isinstance(revise_keys, (list, tuple)) else None
    if pairs is None or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, str) for x in p)
        for p in pairs
    ):
        raise TypeError(
            f"revise_keys must be a list of (regex, replacement) pairs of strings, got "
            f"{revise_keys!r}; e.g. revise_keys=[(r'^module\\.', '')]."
        )
    for pattern, replacement in pairs:
        try:
            re.sub(pattern, replacement, "")  # parses both: a bad group reference raises too
        except (re.error, IndexError) as e:  # IndexError: an unknown group name
            raise ValueError(
                f"revise_keys holds ({pattern!r}, {replacement!r}), which re.sub refuses: {e}."
            ) from None


def revised(
    state: dict[str, Any], revise_keys: Sequence[tuple[str, str]], path: str
) -> dict[str, Any]:
    """``state`` with its keys renamed by ``revise_keys``, in order; two keys renamed alike
    are refused (one would be lost)."""
    for pattern, replacement in revise_keys:
        renamed: dict[str, Any] = {}
        for key, value in state.items():
            new = re.sub(pattern, replacement, key)
            if new in renamed:
                raise ValueError(
                    f"revise_keys ({pattern!r} -> {replacement!r}) renames two keys of "
                    f"{path!r} to {new!r}: one would be lost. Make the renaming one to one."
                )
            renamed[new] = value
        state = renamed
    return state


def _shape(value: Any) -> Any:
    """A tensor's shape as a tuple, for comparing and naming; another value's type."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _first(keys: Any, n: int = 3) -> str:
    keys = list(keys)
    return f"{keys[:n]}{' ...' if len(keys) > n else ''} ({len(keys)} in all)"


def _prefix_hint(theirs: list[str], ours: list[str]) -> str:
    """A ``revise_keys`` that would match the file's keys to the model's, if they differ by a
    prefix (``module.`` of a DDP checkpoint, say)."""
    for keys, others, add in ((theirs, ours, False), (ours, theirs, True)):
        common = os.path.commonprefix(keys)
        for end in (i + 1 for i, c in enumerate(common) if c == "."):
            if {k[end:] for k in keys} & set(others):
                prefix = common[:end]
                pair = ("^", prefix) if add else ("^" + re.escape(prefix), "")
                return (
                    " The keys differ by a prefix: load_checkpoint(path, resume=False, "
                    f"revise_keys=[{pair!r}]) renames them."
                )
    return ""


def load_optimizer_state(
    module: nn.Module, optimizer: Optimizer, state: dict[str, Any], path: str, sharded: bool
) -> None:
    """Load an optimizer's checkpointed state; sharded models' checkpoints key it by name."""
    if keyed_by_name(state):
        load_full_optimizer_state(module, optimizer, state)
    elif sharded:
        raise RuntimeError(
            f"Checkpoint {path!r} was saved by a model that was not sharded; this one is "
            "(fully_shard), and the optimizer state cannot be mapped. Resume it without "
            "sharding, or load the weights alone: load_checkpoint(path, resume=False)."
        )
    else:
        optimizer.load_state_dict(state)


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


def map_position(
    saved: dict[str, Any],
    path: str,
    epoch_len: Optional[int],
    batch_size: Optional[int],
    accumulation: int,
) -> Position:
    """Where to go on from a checkpoint's ``progress``: (epoch, iterations done in it). When the
    number of processes or the batch size changed, the iterations done are mapped by the samples
    they consumed (a stream's position is not mapped: its iterations are counted as they were)."""
    epoch, inner, saved_len = saved["epoch"], saved["inner_iter"], saved["epoch_len"]
    if (saved_len is None) != (epoch_len is None):
        lengths = [
            f"{n} iterations per epoch" if n else "no length" for n in (saved_len, epoch_len)
        ]
        raise ValueError(
            f"Checkpoint {path!r} was saved with a data loader of {lengths[0]}, this trainer's "
            f"has {lengths[1]}; resume with the same kind of data loader."
        )
    if epoch_len is None:
        if not isinstance(saved.get("iters_done"), int):
            raise ValueError(f"Checkpoint {path!r} does not say how many iterations it did.")
        return epoch, inner
    before = (saved.get("world_size", get_world_size()), saved.get("batch_size"))
    now = (get_world_size(), batch_size)
    if before == now or "world_size" not in saved:  # the latter: an older checkpoint
        if saved_len != epoch_len:
            raise ValueError(
                f"Checkpoint {path!r} was saved with {saved_len} iterations per epoch, this "
                f"trainer has {epoch_len}; resume with the same data loader."
            )
        return epoch, inner
    how = f"{before[0]} processes x batches of {before[1]} to {now[0]} x {now[1]}"
    if inner in (0, saved_len):  # between epochs: nothing to map
        logger.warning(
            f"Resuming {path} with {how}, at the {'start' if inner == 0 else 'end'} of "
            f"epoch {epoch}: the data position needs no mapping."
        )
        return epoch, 0 if inner == 0 else epoch_len
    samples = [w * b * accumulation if b else None for w, b in (before, now)]
    consumed = inner * samples[0] if samples[0] else None
    if consumed is None or samples[1] is None or consumed % samples[1]:
        raise RuntimeError(
            f"Checkpoint {path!r} stopped in the middle of epoch {epoch} ({inner} of "
            f"{saved_len} iterations, {consumed or 'an unknown number of'} samples), and "
            f"this run changes from {how}: {samples[1] or 'an unknown number of'} samples "
            "per iteration cannot continue at that sample. Resume with the same number of "
            "processes and batch size, pick a batch size whose iterations divide the "
            "samples consumed, or resume from a checkpoint saved at an epoch's end."
        )
    new_inner = min(consumed // samples[1], epoch_len)
    logger.warning(
        f"Resuming {path} with {how}: epoch {epoch} stopped after {inner} iterations = "
        f"{consumed} samples, so this run goes on from iteration {new_inner} of "
        f"{epoch_len} of that epoch. With a DistributedSampler (its order depends "
        "on seed and epoch only) these are exactly the samples not yet seen; the LR "
        "schedule goes on from its saved step."
    )
    return epoch, new_inner


def file_names(names: list[Any]) -> list[str]:
    """The plain file names (no folder, no ``..``) among a loaded CheckpointHook's ``names``;
    the others are ignored with a warning."""
    kept = [name for name in names if _is_file_name(name)]
    for name in names:
        if not _is_file_name(name):  # the hook's warning, from the hook's logger
            logging.getLogger("trainer.hooks.checkpoint_hook").warning(
                f"Ignoring {name!r} among the checkpoints the loaded state lists: not a file "
                "name in the checkpoint folder, so it is never deleted."
            )
    return kept


def _is_file_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and os.path.basename(name) == name
        and not any(sep in name for sep in (os.sep, os.altsep, "\0") if sep)
    )
