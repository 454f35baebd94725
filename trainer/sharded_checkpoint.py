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
import shutil
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from . import checkpoint_files as files
from .distributed import CpuGroup, all_gather, gather, get_world_size, is_dtensor, is_main_process

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
    """:meth:`Checkpointer.save` of a sharded checkpoint at ``path``. Every rank calls it."""
    model_state = get_model_state_dict(ckpt._module)  # this rank's shards, as DTensors
    optimizer_state = get_optimizer_state_dict(ckpt._module, ckpt._optimizer)  # keyed by name
    refuse_shards_in_rest(state)
    rest = {key: value for key, value in state.items() if key not in _SHARDED_KEYS}
    rng = gather(own_rng, group=ckpt._cpu.group)
    folder, name = os.path.split(path)
    temp = os.path.join(folder, f".{name}{files.TEMP_SUFFIX}")
    ckpt.writer.wait()  # the last save's files are complete; raises if its write failed
    mode = 0o666 & ~files.current_umask()  # read here, in the training thread
    copied = files.copy_to_cpu({**rest, "rng": rng}) if is_main_process() else None
    group = _write_group(ckpt)
    # Training waits while DCP copies the shards (its staging); the write goes on in a thread.
    future = dcp.async_save(
        {"model": model_state, "optimizer": optimizer_state},
        storage_writer=dcp.FileSystemWriter(temp),
        process_group=group,
        no_dist=get_world_size() == 1,
    )

    def write() -> None:
        future.result()  # raises on every rank alike: DCP shares a rank's error
        try:  # DCP's metadata is written last, by rank 0: every rank's files are complete
            if copied is not None:
                files.atomic_save(copied, os.path.join(temp, STATE_FILE), mode)
                _replace_folder(temp, path)
                files.update_latest_pointer(folder, name, mode)
                logger.debug(f"Saved checkpoint {path}")  # the next log line names it
        finally:
            if group is not None:  # every rank's wait() returns once the checkpoint is in place
                dist.barrier(group=group)
        if copied is not None and then is not None:
            then()

    ckpt.writer.submit(write)


def refuse_shards_in_rest(state: dict[str, Any]) -> None:
    """Refuse DTensors outside the model and optimizer (an EMAHook's average of an FSDP2 model,
    say): rank 0 writes the hooks' and registered objects' state, and each rank's shard of them
    differs, so every rank would resume with rank 0's."""
    rest = {key: value for key, value in state.items() if key not in _SHARDED_KEYS}
    named = files._named_tensors(rest, "")
    parts = sorted({".".join(name.split(".")[:2]) for name, t in named if is_dtensor(t)})
    if parts:
        raise ValueError(
            f"{', '.join(parts)} holds DTensors (shards of the FSDP2 model), which a checkpoint "
            "cannot keep: rank 0 writes the state of the hooks and registered objects, and the "
            "ranks' shards differ. Keep full tensors there (DTensor.full_tensor())."
        )


def _write_group(ckpt: "Checkpointer") -> Any:
    """A gloo group for the writes alone (they talk from a thread while training talks too),
    released with its threads by the checkpointer's ``wait()`` (at the end of ``train()``)."""
    if get_world_size() == 1:
        return None
    if getattr(ckpt, "_write_group", None) is None:
        writes, stack = CpuGroup(), contextlib.ExitStack()
        stack.enter_context(writes.open())
        ckpt._write_group = writes.group

        def release() -> None:
            ckpt._write_group = None
            stack.close()

        ckpt._releases.append(release)
    return ckpt._write_group


def _replace_folder(temp: str, path: str) -> None:
    """Rename the complete folder ``temp`` to ``path`` (replacing a checkpoint of that name),
    durably."""
    old = None
    if os.path.isdir(path) and not os.path.islink(path):
        old = f"{temp}.old"
        os.replace(path, old)
    elif os.path.lexists(path):
        os.remove(path)
    os.replace(temp, path)
    folder = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(folder)  # makes the rename itself durable
    finally:
        os.close(folder)
    if old is not None:
        shutil.rmtree(old)


def remove(path: str) -> None:
    """Delete a checkpoint: a file, a link, or a sharded checkpoint's folder."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


# Loading, without running code from the files


class _MetadataUnpickler(pickle.Unpickler):
    """Builds what DCP's ``.metadata`` holds and nothing else: a crafted file cannot call a
    function."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and not name.startswith("__"):
            found = getattr(dcp_metadata, name, None)
            if isinstance(found, type):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self) -> Any:
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not Metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
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
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
        raise RuntimeError(
            f"Checkpoint {path!r} could not be loaded safely: its DCP metadata does not load "
            f"({type(e).__name__}: {e})."
        ) from e


def _dcp_load(state: dict[str, Any], path: str, group: Any = None, alone: bool = False) -> None:
    """Fill ``state``'s tensors in place from the checkpoint at ``path``: a collective of
    ``group`` (None: the default one) under torchrun, unless this process reads ``alone``."""
    alone = alone or get_world_size() == 1
    try:
        dcp.load(
            state,
            storage_reader=_SafeReader(path),
            planner=_SafePlanner(),
            process_group=group,
            no_dist=alone,
        )
    except (Exception, dcp.CheckpointException) as e:  # the latter, a BaseException
        raise RuntimeError(f"Checkpoint {path!r} could not be loaded safely: {e}") from e


def _model_shapes(path: str) -> dict[str, tuple[int, ...]]:
    entries = read_metadata(path).state_dict_metadata.items()
    return {
        key[len("model.") :]: tuple(entry.size)
        for key, entry in entries
        if key.startswith("model.") and isinstance(entry, dcp_metadata.TensorStorageMetadata)
    }


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The model's full weights in the sharded checkpoint at ``path``, as CPU tensors; each
    process reads them alone (no collective)."""
    metadata = read_metadata(path)
    template = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(entry, dcp_metadata.TensorStorageMetadata)
    }
    if not template:
        raise RuntimeError(f"Checkpoint {path!r} holds no model weights.")
    _dcp_load(template, path, alone=True)
    return {key[len("model.") :]: value for key, value in template.items()}


def read_resumable(path: str, ckpt: "Checkpointer") -> dict[str, Any]:
    """The sharded checkpoint at ``path`` as :func:`~trainer.checkpoint_load.load_resumable`
    sees a file: rank 0's ``trainer.pth``, and this process's part of the model and optimizer
    (its shards for a sharded model, the whole for another) read into fresh tensors. A
    collective under torchrun."""
    from .checkpoint_load import load_checkpoint_file, load_model_state

    if not is_sharded_checkpoint(path):
        raise IsADirectoryError(
            f"Checkpoint {path!r} is a directory, not a file (nor a sharded checkpoint: it "
            f"holds no {STATE_FILE})."
        )
    data = load_checkpoint_file(os.path.join(path, STATE_FILE))
    if any(key in data for key in _SHARDED_KEYS):
        raise RuntimeError(f"Checkpoint {path!r} is damaged: {STATE_FILE} holds model state.")
    shapes = _model_shapes(path)
    if {k: tuple(v.shape) for k, v in ckpt._module.state_dict().items()} != shapes:
        # raises, naming the keys and shapes that differ (the weights are not read)
        meta = {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}
        load_model_state(ckpt._module, meta, path, strict=True, sharded=False)
    model = _fresh(get_model_state_dict(ckpt._module))  # this process's part: DTensor shards
    optimizer = _fresh(get_optimizer_state_dict(ckpt._module, ckpt._optimizer))
    group = ckpt._cpu.group  # None outside train(): the default group, under torchrun
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


def _fresh(state: Any) -> Any:
    """``state`` with every tensor replaced by an empty one like it (a DTensor by a DTensor)."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {key: _fresh(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_fresh(value) for value in state]
    return state


def consolidate(path: str, out: str) -> None:
    """Write the model weights of the sharded checkpoint at ``path`` to ``out`` as one
    ``state_dict`` file that ``torch.load(out, weights_only=True)`` loads."""
    files.atomic_save(read_weights(path), out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m trainer.sharded_checkpoint CHECKPOINT_FOLDER OUT.pth")
    consolidate(sys.argv[1], sys.argv[2])
    print(f"Wrote the model weights of {sys.argv[1]} to {sys.argv[2]}.")
