"""Sharded checkpoints of FSDP2 models, with PyTorch's Distributed Checkpoint (DCP).

A sharded checkpoint is a folder named as a checkpoint file is (``iter_8.pth/``). Every rank
writes its own shards of the model and optimizer there (DCP's ``.distcp`` files; rank 0 adds
DCP's ``.metadata``), and rank 0 writes the rest of the training state as ``trainer.pth``. The
folder is written under a temporary name and renamed once every rank's files are complete, so
a checkpoint is whole or absent. Training waits only while the shards are copied off the live
tensors; the writing goes on in the background, on a gloo group of its own.

Loading runs no code from the files: ``.metadata`` is read by an unpickler that builds DCP's own
classes only, and every other entry by ``torch.load(weights_only=True)``. A checkpoint loads on
any number of processes, sharded or not (DCP reshards)::

    python -m trainer.sharded_checkpoint work_dir/checkpoints/epoch_3.pth model.pth

writes its model weights as one ``state_dict`` file, for inference.
"""

import contextlib
import io
import logging
import os
import pickle
import sys
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from . import checkpoint_files as files
from .distributed import all_gather, gather, get_rank, get_world_size, is_dtensor, is_main_process

if TYPE_CHECKING:
    from .checkpoint import Checkpointer

logger = logging.getLogger("trainer.checkpoint")

# DCP warns whenever one process saves or loads alone, even when asked to (no_dist=True).
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")

STATE_FILE = "trainer.pth"  # rank 0's part: everything but the model's and optimizer's shards
_SHARDED_KEYS = ("model", "optimizer")


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a sharded checkpoint's folder."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, STATE_FILE))


# Saving


def save(
    ckpt: "Checkpointer",
    state: dict[str, Any],
    own_rng: dict[str, Any],
    path: str,
    then: Optional[Callable[[], None]],
) -> None:
    """:meth:`Checkpointer.save` of a sharded checkpoint at ``path``. Every rank calls it. While
    ``train()`` runs (:func:`write_group`) the write goes on in the background; outside, it is
    done when this returns."""
    model_state = get_model_state_dict(ckpt._module)  # this rank's shards, as DTensors
    optimizer_state = get_optimizer_state_dict(ckpt._module, ckpt._optimizer)  # keyed by name
    rest = {key: value for key, value in state.items() if key not in _SHARDED_KEYS}
    rng = gather(own_rng, group=ckpt._cpu.group)
    folder, name = os.path.split(path)
    temp = os.path.join(folder, f".{name}{files.TEMP_SUFFIX}")
    ckpt.writer.wait()  # the last save's files are complete; raises if its write failed
    mode = 0o666 & ~files.current_umask()  # read here, in the training thread
    copied = files.copy_to_cpu({**rest, "rng": rng}) if is_main_process() else None
    shards = {"model": model_state, "optimizer": optimizer_state}
    writer, group = dcp.FileSystemWriter(temp), ckpt._write_group
    if group is None and dist.is_initialized():  # outside train(): over the default group
        future: Any = None
        _as_write_error(lambda: dcp.save(shards, storage_writer=writer), temp)
    else:  # training waits while the shards are copied (staged); a thread writes them
        future = dcp.async_save(
            shards, storage_writer=writer, process_group=group, async_stager=_Stager(),
            no_dist=group is None,
        )  # fmt: skip

    def write() -> None:
        if future is not None:  # raises on every rank alike: DCP shares a rank's error
            _as_write_error(future.result, temp)
        try:  # DCP writes its metadata last, on rank 0: every rank's files are complete
            if copied is not None:
                files.atomic_save(copied, os.path.join(temp, STATE_FILE), mode)
                _replace_folder(temp, path)
                files.update_latest_pointer(folder, name, mode)
                logger.debug(f"Saved checkpoint {path}")  # the next log line names it
        finally:
            if dist.is_initialized():  # every rank's wait() returns once the folder is in place
                dist.barrier(group=group)
        if copied is not None and then is not None:
            then()

    if future is None:
        write()
    else:
        ckpt.writer.submit(write)


def _as_write_error(step: Callable[[], Any], temp: str) -> None:
    """Run ``step``; a failure of DCP's (a ``CheckpointException``, a ``BaseException`` that
    ``except Exception`` misses) is raised as this rank's error, or the first failed rank's:
    an ``OSError`` naming the folder where it is one (a full disk, say)."""
    try:
        step()
    except dcp.CheckpointException as e:
        failures = e.failures
        error = (failures.get(get_rank()) or next(iter(failures.values())))[0]
        from .checkpoint_errors import raise_write_failure

        try:
            raise_write_failure(temp, error)
        except OSError:
            raise
        except BaseException:
            raise RuntimeError(f"Could not write the checkpoint folder {temp}: {error!r}") from e


def check_rank_state(ckpt: "Checkpointer", state: dict[str, Any]) -> None:
    """Of an FSDP2 model's checkpoint (either kind), what one copy keeps for every rank must
    be the same on every rank. DTensors in the state of the hooks and registered objects (an
    EMAHook's average, say), which rank 0 writes alone, are refused: every rank would resume
    with rank 0's shard. Model buffers that differ by rank (BatchNorm's running statistics
    without SyncBatchNorm) are named in a warning, once: one copy of each is kept."""
    rest = {key: value for key, value in state.items() if key not in _SHARDED_KEYS}
    named = files._named_tensors(rest, "")
    parts = sorted({".".join(name.split(".")[:2]) for name, t in named if is_dtensor(t)})
    if parts:
        raise ValueError(
            f"{', '.join(parts)} holds DTensors (shards of the FSDP2 model), which a checkpoint "
            "cannot keep: rank 0 writes the state of the hooks and registered objects, and the "
            "ranks' shards differ. Keep plain tensors there (a DTensor's full_tensor())."
        )
    if get_world_size() == 1 or ckpt in _WARNED:
        return
    buffers = {
        name: t for name, t in state["model"].items()
        if isinstance(t, torch.Tensor) and not is_dtensor(t) and t.is_floating_point()
    }  # fmt: skip
    sums = torch.stack([t.double().sum() for t in buffers.values()]).tolist() if buffers else []
    everyone = all_gather(sums, group=ckpt._cpu.group)
    differ = [name for i, name in enumerate(buffers) if len({s[i] for s in everyone}) > 1]
    if differ:
        _WARNED.add(ckpt)
        logger.warning(
            f"The model's buffers {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''} "
            "differ by rank (FSDP2 does not synchronize buffers), and a checkpoint keeps one "
            "copy of each: a resumed run gives it to every rank, so it does not go on exactly "
            "as this one would. Use SyncBatchNorm to keep them equal."
        )


_WARNED: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()  # said once per checkpointer


@contextlib.contextmanager
def write_group(ckpt: "Checkpointer") -> Iterator[None]:
    """While ``train()`` runs: a gloo group of every rank for the background writes of sharded
    saves (they talk from a thread while training talks too, and async_save needs a CPU
    backend beside NCCL), released with its threads when training ends."""
    if not dist.is_initialized():
        yield
        return
    ckpt._write_group = dist.new_group(backend="gloo")
    try:
        yield
    finally:
        group, ckpt._write_group = ckpt._write_group, None
        dist.destroy_process_group(group)  # the last reference: its threads are joined


def _replace_folder(temp: str, path: str) -> None:
    """Rename the complete folder ``temp`` to ``path``, durably. A checkpoint of that name is
    moved aside first (``checkpoint_files.aside``): a crash between the two renames leaves it
    there, and :func:`remove_stray` puts it back."""
    old = files.aside(path) if os.path.lexists(path) else None
    if old is not None:
        os.replace(path, old)
    os.replace(temp, path)
    files.fsync_folder(os.path.dirname(path))
    if old is not None:
        files.remove_checkpoint(old)


def remove_stray(path: str) -> None:
    """At a start, what a sharded save interrupted by a crash left (on rank 0): a folder being
    written is deleted; a checkpoint moved aside to be replaced is put back if its replacement
    never took its name."""
    base, suffix = os.path.basename(path), files.TEMP_SUFFIX + files.ASIDE_SUFFIX
    name = base[1 : -len(suffix)] if base.endswith(suffix) else None  # aside()'s inverse
    original = os.path.join(os.path.dirname(path), name) if name else None
    if original is not None and not os.path.lexists(original):
        os.replace(path, original)
        logger.info(f"Restored {original}, moved aside by an interrupted checkpoint write.")
        return
    files.remove_checkpoint(path)
    logger.info(f"Removed {path}, left by an interrupted checkpoint write.")


# Loading, without running code from the files


_METADATA_CLASSES = {
    **{("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
       for name in (*dcp_metadata.__all__, "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
}  # fmt: skip
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")


class _MetadataUnpickler(pickle.Unpickler):
    """Builds what DCP's ``.metadata`` holds and nothing else: DCP's metadata classes, sizes,
    dtypes, layouts, and the checkpoint's path (as a string), so a crafted file cannot call a
    function."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return _METADATA_CLASSES[module, name]
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]  # (read from the module: no lazy import)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        if module in ("pathlib", "pathlib._local") and name in _PATHS:  # informative only
            return _path
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def _path(*parts: str) -> str:
    if not all(isinstance(part, str) for part in parts):
        raise pickle.UnpicklingError("a path of other things than strings")
    return os.path.join(*parts) if parts else ""


def _layout(name: str) -> torch.layout:
    layout = vars(torch).get(name.removeprefix("torch."))
    if not isinstance(layout, torch.layout):
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return layout


class _SafeReader(dcp.FileSystemReader):
    """DCP's reader of a folder, whose ``.metadata`` is read by :class:`_MetadataUnpickler`
    (DCP's own uses ``pickle.load``) and may name files of the folder only."""

    def read_metadata(self) -> Any:
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not Metadata")
        for info in (metadata.storage_data or {}).values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".."):
                raise pickle.UnpicklingError(f"it names {name!r}, not a file of the folder")
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, except that it loads the entries that are not tensors (optimizer
    settings, say) with ``weights_only=True``: DCP's own unpickles them with
    ``weights_only=False``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: str) -> Any:
    """The DCP metadata of the sharded checkpoint at ``path``, read safely."""
    try:
        return _SafeReader(path).read_metadata()
    except Exception as e:
        how = "" if isinstance(e, OSError) else " safely"  # a missing file is not a threat
        raise RuntimeError(
            f"Checkpoint {path!r} could not be loaded{how}: its DCP metadata does not load "
            f"({type(e).__name__}: {e})."
        ) from e


def _dcp_load(state: dict[str, Any], path: str, group: Any = None, alone: bool = False) -> None:
    """Fill ``state``'s tensors in place from the checkpoint at ``path``: a collective of
    ``group`` (None: the default one) under torchrun, unless this process reads ``alone``."""
    try:
        dcp.load(
            state,
            storage_reader=_SafeReader(path),
            planner=_SafePlanner(),
            process_group=group,
            no_dist=alone or not dist.is_initialized(),
        )
    except (Exception, dcp.CheckpointException) as e:  # the latter, a BaseException
        failures = getattr(e, "failures", {})
        cause = (failures.get(get_rank()) or next(iter(failures.values()), (e,)))[0]
        how = " safely" if isinstance(cause, pickle.UnpicklingError) else ""  # code in it
        raise RuntimeError(
            f"Checkpoint {path!r} could not be loaded{how}: {type(cause).__name__}: {cause}"
        ) from e


def _saved_keys(metadata: Any, prefix: str) -> dict[str, Any]:
    """The entries of a checkpoint's metadata under ``prefix`` (``"model."``), by the rest of
    their keys."""
    return {
        key[len(prefix) :]: entry
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
    }


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The model's full weights in the sharded checkpoint at ``path``, as CPU tensors; each
    process reads them alone (no collective)."""
    entries = _saved_keys(read_metadata(path), "model.")
    try:
        template = {
            f"model.{key}": torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in entries.items()
            if isinstance(entry, dcp_metadata.TensorStorageMetadata)
        }
    except Exception as e:  # a size or dtype that is no such thing
        raise RuntimeError(f"Checkpoint {path!r} is damaged: its metadata says {e}") from e
    if not template:
        raise RuntimeError(f"Checkpoint {path!r} holds no model weights.")
    _dcp_load(template, path, alone=True)
    return {key[len("model.") :]: value for key, value in template.items()}


def read_resumable(path: str, ckpt: "Checkpointer") -> dict[str, Any]:
    """The sharded checkpoint at ``path`` as :func:`~trainer.checkpoint_load.load_resumable`
    sees a file: rank 0's ``trainer.pth``, and this process's part of the model and optimizer
    (its shards for a sharded model, the whole for another) read into fresh tensors. A
    collective under torchrun: the ranks agree on every refusal, so they skip the same
    checkpoints."""
    from .checkpoint_load import load_checkpoint_file, load_model_state

    group = ckpt._cpu.group  # None outside train(): the default group, under torchrun
    problem: Optional[Exception] = None
    try:
        if not is_sharded_checkpoint(path):
            raise IsADirectoryError(
                f"Checkpoint {path!r} is a directory, not a file (nor a sharded checkpoint: it "
                f"holds no {STATE_FILE})."
            )
        data = load_checkpoint_file(os.path.join(path, STATE_FILE))
        if any(key in data for key in _SHARDED_KEYS):
            raise RuntimeError(f"Checkpoint {path!r} is damaged: {STATE_FILE} holds model state.")
        metadata = read_metadata(path)
    except (RuntimeError, OSError) as e:
        problem = e
    _raise_on_every_rank(problem, group)
    saved = _saved_keys(metadata, "model.")
    shapes = {key: tuple(getattr(entry, "size", ())) for key, entry in saved.items()}
    if {k: tuple(v.shape) for k, v in ckpt._module.state_dict().items()} != shapes:
        # raises, naming the keys and shapes that differ (the weights are not read)
        meta = {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}
        load_model_state(ckpt._module, meta, path, strict=True, sharded=False)
    model = _mapped(get_model_state_dict(ckpt._module), torch.empty_like)  # DTensor shards
    optimizer = _mapped(get_optimizer_state_dict(ckpt._module, ckpt._optimizer), torch.empty_like)
    # the state of parameters that had none when saved (no gradient yet) stays out
    in_file = _saved_keys(metadata, "optimizer.state.")
    optimizer["state"] = {
        name: kept
        for name, entry in optimizer["state"].items()
        if (kept := {key: v for key, v in entry.items() if f"{name}.{key}" in in_file})
    }
    _dcp_load({"model": model, "optimizer": optimizer}, path, group)
    bad = files.bad_tensors({"model": model, "optimizer": optimizer}, ckpt.parameters())
    if get_world_size() > 1:  # each rank checked its own shards: the ranks agree
        bad = sorted({name for names in all_gather(bad, group=group) for name in names})
    if bad:
        raise RuntimeError(
            f"Checkpoint {path!r} holds NaN or infinite values in {len(bad)} tensors "
            f"({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}): resuming it would fail "
            "at once. Resume from an older checkpoint."
        )
    return {**data, "model": model, "optimizer": optimizer}


def _raise_on_every_rank(error: Optional[Exception], group: Any) -> None:
    """Raise ``error``; under torchrun, every rank raises when one has an error (the others a
    RuntimeError with its message), so that no rank goes on alone into a collective."""
    if get_world_size() > 1:
        messages = all_gather(None if error is None else str(error), group=group)
        first = next((message for message in messages if message), None)
        if error is None and first is not None:
            raise RuntimeError(first)
    if error is not None:
        raise error


def _mapped(state: Any, tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``state`` with ``tensor(t)`` in place of every tensor ``t`` (a DTensor's, a DTensor)."""
    if isinstance(state, torch.Tensor):
        return tensor(state)
    if isinstance(state, dict):
        return {key: _mapped(value, tensor) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_mapped(value, tensor) for value in state)
    return state


class _Stager(BlockingAsyncStager):
    """DCP's blocking staging, except that a state on the CPU (FSDP2 on CPU) is cloned once:
    DCP's own deep-copies every tensor, then copies it again into that copy."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if any(t.device.type != "cpu" for _, t in files._named_tensors(state_dict, "")):
            return super().stage(state_dict)
        return _mapped(state_dict, lambda t: t.detach().clone())


def consolidate(path: str, out: str) -> None:
    """Write the model weights of the sharded checkpoint at ``path`` to ``out`` as one
    ``state_dict`` file that ``torch.load(out, weights_only=True)`` loads."""
    files.atomic_save(read_weights(path), out)


def _main(args: list[str]) -> str:
    """``python -m trainer.sharded_checkpoint FOLDER OUT``: what it did, or raise SystemExit
    with what is wrong."""
    if len(args) != 2 or args[0].startswith("-"):
        raise SystemExit(
            "usage: python -m trainer.sharded_checkpoint CHECKPOINT_FOLDER OUT.pth\n"
            "Writes the model weights of a sharded checkpoint as one state_dict file."
        )
    folder, out = args
    if os.path.isfile(folder):
        raise SystemExit(
            f"{folder} is one checkpoint file already: "
            "torch.load(path, weights_only=True)['model'] holds its weights."
        )
    if not is_sharded_checkpoint(folder):
        raise SystemExit(f"{folder} is not a sharded checkpoint (a folder with {STATE_FILE}).")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))) or os.path.isdir(out):
        raise SystemExit(f"{out} cannot be written: its folder does not exist, or it is one.")
    try:
        consolidate(folder, out)
    except (RuntimeError, OSError) as e:
        raise SystemExit(str(e)) from None
    return f"Wrote the model weights of {folder} to {out}."


if __name__ == "__main__":
    print(_main(sys.argv[1:]))
