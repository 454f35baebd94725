"""Sharded checkpoints of FSDP2 models, with PyTorch's Distributed Checkpoint (DCP).

A sharded checkpoint is a folder named as a checkpoint file is (``iter_8.pth/``). Every rank
writes its own shards of the model and optimizer there (DCP's ``.distcp`` files; rank 0 adds
DCP's ``.metadata``), and rank 0 writes the rest of the training state as ``trainer.pth`` and
the checksums of DCP's files as ``checksums.json`` (each rank sums a share of them). The folder
is written under a temporary name and renamed once every rank's files are complete, so a
checkpoint is whole or absent. Training waits only while the shards are copied off the live
tensors; the writing goes on in the background, on a gloo group of its own.

Loading runs no code from the files: ``.metadata`` is read by an unpickler that builds DCP's own
classes only, and every other entry by ``torch.load(weights_only=True)``. A folder holding a link,
a file its checksums do not list, or bytes that changed is refused as damaged. A checkpoint loads on
any number of processes, sharded or not (DCP reshards)::

    python -m trainer.sharded_checkpoint work_dir/checkpoints/epoch_3.pth model.pth

writes its model weights as one ``state_dict`` file, for inference; it only reads the
checkpoint, and refuses an output inside its folder.
"""

import argparse
import contextlib
import io
import os
import pickle
import sys
import warnings
from collections.abc import Collection, Iterator
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.optim import Optimizer

from . import checksum
from .checkpoint_io import (
    BackgroundWriter,
    atomic_save,
    bad_tensors,
    load_checkpoint_file,
    load_model_state,
    named_tensors,
    raise_write_failure,
    refuse_non_finite,
    write_checkpoint_file,
)
from .distributed import all_gather, get_rank, get_world_size, raise_on_every_rank
from .misc import plain_state_dict

# DCP warns whenever one process saves or loads alone, even when asked to (no_dist=True).
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")

STATE_FILE = "trainer.pth"  # rank 0's part: everything but the model's and optimizer's shards


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a sharded checkpoint's folder."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, STATE_FILE))


# Saving


def save(
    module: nn.Module,
    optimizer: Optimizer,
    rest: Optional[dict[str, Any]],
    folder: str,
    *,
    mode: int,
    group: Any,
    writer: BackgroundWriter,
    publish: Callable[[], None],
    then: Optional[Callable[[], None]] = None,
) -> None:
    """Save ``module``'s and ``optimizer``'s shards (every rank its own) and, on rank 0, ``rest``
    (the rest of the training state, copied; None on the other ranks) as ``folder``, then call
    ``publish()`` on rank 0 once every rank's files are complete, and ``then()`` once every
    rank knows it; ``rest``'s file gets permissions ``mode``. Every rank calls it. With
    ``group`` (the :func:`write_group` of a running ``train()``), or in one process, the shards
    are copied now and ``writer`` writes them in the background; otherwise they are written when
    this returns."""
    model_state = get_model_state_dict(module)  # this rank's shards, as DTensors
    optimizer_state = get_optimizer_state_dict(module, optimizer)  # keyed by name
    shards = {"model": model_state, "optimizer": optimizer_state}
    storage = dcp.FileSystemWriter(folder)
    if group is None and dist.is_initialized():  # outside train(): over the default group
        future: Any = None
        _as_write_error(lambda: dcp.save(shards, storage_writer=storage), folder)
    else:  # training waits while the shards are copied (staged); a thread writes them
        future = dcp.async_save(
            shards, storage_writer=storage, process_group=group, async_stager=_Stager(),
            no_dist=group is None,
        )  # fmt: skip

    def write() -> None:
        if future is not None:  # raises on every rank alike: DCP shares a rank's error
            _as_write_error(future.result, folder)
        try:  # DCP writes its metadata last, on rank 0: every rank's files are complete
            manifest = checksum.manifest_bytes(_checksums(folder, group))
            if rest is not None:
                atomic_save(rest, os.path.join(folder, STATE_FILE), mode)  # with its own
                path = os.path.join(folder, checksum.MANIFEST)
                write_checkpoint_file(path, lambda f: f.write(manifest), mode)
                publish()
        finally:
            if dist.is_initialized():  # every rank's wait() returns once the folder is in place
                dist.barrier(group=group)
        if rest is not None and then is not None:
            then()

    if future is None:
        write()
    else:
        writer.submit(write)


def _checksums(folder: str, group: Any) -> dict[str, list[int]]:
    """``{name: [size, CRC-32]}`` of DCP's files in ``folder``, on every rank; each rank reads a
    share of them, and the ranks must list the same files. A collective of ``group`` under
    torchrun."""
    rank, world = get_rank(), get_world_size()
    error, names, own = None, [], {}
    try:
        names = sorted(os.listdir(folder))
        own = checksum.sums(folder, names[rank::world])
    except OSError as e:
        error = e
    shares = raise_on_every_rank(error, (names, own), group=group)
    for other, (listed, _) in enumerate(shares):
        if listed != shares[0][0]:  # a file system that shows the ranks different files
            raise RuntimeError(
                f"Could not write the checkpoint folder {folder}: rank {other} lists the files "
                f"{listed} in it, rank 0 {shares[0][0]}."
            )
    return {name: value for _, share in shares for name, value in share.items()}


def _as_write_error(step: Callable[[], Any], folder: str) -> None:
    """Run ``step``; a failure of DCP's (a ``CheckpointException``, a ``BaseException`` that
    ``except Exception`` misses) is raised as this rank's error, or the first failed rank's:
    an ``OSError`` naming the folder where it is one (a full disk, say)."""
    try:
        step()
    except dcp.CheckpointException as e:
        failures = e.failures
        error = (failures.get(get_rank()) or next(iter(failures.values())))[0]
        try:
            raise_write_failure(folder, error)
        except OSError:
            raise
        except BaseException:
            raise RuntimeError(f"Could not write the checkpoint folder {folder}: {error!r}") from e


@contextlib.contextmanager
def write_group() -> Iterator[Any]:
    """While ``train()`` runs: a gloo group of every rank for the background writes of sharded
    saves (they talk from a thread while training talks too, and async_save needs a CPU
    backend beside NCCL), released with its threads when training ends; None in one process."""
    if not dist.is_initialized():
        yield None
        return
    group = dist.new_group(backend="gloo")
    try:
        yield group
    finally:
        dist.destroy_process_group(group)
        del group  # the last reference: its threads are joined


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
    files = _read_manifest(path, need_checksum=False)  # weights may come from older folders
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
    _load_checked(template, path, files, alone=True)
    return {key[len("model.") :]: value for key, value in template.items()}


def read_resumable(
    path: str, module: nn.Module, optimizer: Optimizer, group: Any, parameters: Collection[str]
) -> dict[str, Any]:
    """The sharded checkpoint at ``path`` as a checkpoint file is read to resume a run: rank 0's
    ``trainer.pth``, and this process's part of ``module``'s and ``optimizer``'s state (its shards
    for a sharded model, the whole for another) read into fresh tensors and checked finite
    (``parameters``: the model's parameter names). A collective of ``group`` under torchrun
    (None: the default group): the ranks agree on every refusal, so they skip the same
    checkpoints."""
    problem: Optional[Exception] = None
    try:
        if not is_sharded_checkpoint(path):
            raise IsADirectoryError(
                f"Checkpoint {path!r} is a directory, not a file (nor a sharded checkpoint: it "
                f"holds no {STATE_FILE})."
            )
        files = _read_manifest(path, need_checksum=True)
        data = load_checkpoint_file(os.path.join(path, STATE_FILE))
        if any(key in data for key in ("model", "optimizer")):
            raise RuntimeError(f"Checkpoint {path!r} is damaged: {STATE_FILE} holds model state.")
        metadata = read_metadata(path)
    except (RuntimeError, OSError) as e:
        problem = e
    raise_on_every_rank(problem, group=group)
    saved = _saved_keys(metadata, "model.")
    shapes = {key: tuple(getattr(entry, "size", ())) for key, entry in saved.items()}
    if {k: tuple(v.shape) for k, v in plain_state_dict(module).items()} != shapes:
        # raises, naming the keys and shapes that differ (the weights are not read)
        meta = {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}
        load_model_state(module, meta, path, strict=True, sharded=False)
    model = _mapped(get_model_state_dict(module), torch.empty_like)  # DTensor shards
    optimizer_state = _mapped(get_optimizer_state_dict(module, optimizer), torch.empty_like)
    # the state of parameters that had none when saved (no gradient yet) stays out
    in_file = _saved_keys(metadata, "optimizer.state.")
    optimizer_state["state"] = {
        name: kept
        for name, entry in optimizer_state["state"].items()
        if (kept := {key: v for key, v in entry.items() if f"{name}.{key}" in in_file})
    }
    _load_checked({"model": model, "optimizer": optimizer_state}, path, files, group)
    bad = bad_tensors({"model": model, "optimizer": optimizer_state}, parameters)
    if get_world_size() > 1:  # each rank checked its own shards: the ranks agree
        bad = sorted({name for names in all_gather(bad, group=group) for name in names})
    refuse_non_finite(bad, path, weights_only=False)
    return {**data, "model": model, "optimizer": optimizer_state}


def _read_manifest(path: str, need_checksum: bool) -> dict[str, list[int]]:
    """The checksums of the sharded checkpoint at ``path`` (see :func:`checksum.read_manifest`),
    its ``.metadata`` checked already (it is unpickled before anything else is read)."""
    files = checksum.read_manifest(path, STATE_FILE, need_checksum)
    if files:
        checksum.check_files(path, files, [".metadata"])
    return files


def _load_checked(
    state: dict[str, Any], path: str, files: dict[str, list[int]], group: Any = None,
    alone: bool = False,
) -> None:  # fmt: skip
    """:func:`_dcp_load`, while a thread checks the bytes of the shards against ``files``
    (the manifest), each rank a share of them unless it reads ``alone``. Damage that any rank
    finds is what every rank raises, rather than the error DCP made of it."""
    shards = sorted(name for name in files if name != ".metadata")
    share = shards if alone else shards[get_rank() :: get_world_size()]
    checked = checksum.in_background(lambda: checksum.check_files(path, files, share))
    problem: Optional[Exception] = None
    try:
        _dcp_load(state, path, group, alone)
    except RuntimeError as e:
        problem = e
    damage: Optional[Exception] = None
    try:
        checked()
    except (RuntimeError, OSError) as e:
        damage = e
    for error in (damage, problem):  # damage first: every rank names it, rather than DCP's
        if not alone:
            raise_on_every_rank(error, group=group)
        elif error is not None:
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
        if any(t.device.type != "cpu" for _, t in named_tensors(state_dict, "")):
            return super().stage(state_dict)
        return _mapped(state_dict, lambda t: t.detach().clone())


def consolidate(path: str, out: str) -> None:
    """Write the model weights of the sharded checkpoint at ``path`` to ``out`` as one
    ``state_dict`` file that ``torch.load(out, weights_only=True)`` loads."""
    atomic_save(read_weights(path), out)


def _main(args: list[str]) -> str:
    """``python -m trainer.sharded_checkpoint FOLDER OUT``: what it did, or raise SystemExit
    with what is wrong (argparse's own, with its usage, for a malformed command line)."""
    parser = argparse.ArgumentParser(
        prog="python -m trainer.sharded_checkpoint",
        description="Write the model weights of a sharded checkpoint as one state_dict file, "
        "which torch.load(OUT, weights_only=True) loads. The checkpoint is only read.",
    )
    parser.add_argument(
        "folder",
        metavar="CHECKPOINT_FOLDER",
        help=f"a sharded checkpoint (a folder with {STATE_FILE}), "
        "e.g. work_dir/checkpoints/epoch_3.pth",
    )
    parser.add_argument(
        "out",
        metavar="OUT",
        help="the new file to write, e.g. model.pth. Refused: a path inside CHECKPOINT_FOLDER "
        "or another checkpoint (however spelled), a file or directory that exists, and '-' "
        "(the file is binary: it is not written to stdout)",
    )
    parsed = parser.parse_args(args)
    folder, out = parsed.folder, parsed.out
    if os.path.isfile(folder):
        raise SystemExit(
            f"CHECKPOINT_FOLDER {folder} is one checkpoint file already: "
            "torch.load(path, weights_only=True)['model'] holds its weights."
        )
    if not is_sharded_checkpoint(folder):
        raise SystemExit(
            f"CHECKPOINT_FOLDER {folder} is not a sharded checkpoint (a folder with {STATE_FILE})."
        )
    _check_out(out, folder)
    try:
        consolidate(folder, out)
    except (RuntimeError, OSError) as e:
        raise SystemExit(str(e)) from None
    return f"Wrote the model weights of {folder} to {out}."


def _check_out(out: str, folder: str) -> None:
    """Refuse an ``out`` that the export cannot write, or cannot write without touching the
    checkpoint ``folder`` it reads, whose every byte must stay as it was."""
    if out in ("-", ""):
        raise SystemExit(
            f"OUT is {out!r}: the weights are not written to stdout (a state_dict file is "
            "binary). Give the path of a file to write, e.g. model.pth."
        )
    real = os.path.realpath(out)
    if _within(out, folder):
        raise SystemExit(
            f"OUT {out} is CHECKPOINT_FOLDER {folder} or a path inside it (it resolves to "
            f"{real}): writing there would damage the checkpoint. Give a path outside that "
            "folder, e.g. model.pth."
        )
    inside = next((p for p in _ancestors(real) if is_sharded_checkpoint(p)), None)
    if inside is not None:
        raise SystemExit(
            f"OUT {out} is inside the sharded checkpoint {inside}: writing there would damage "
            "it. Give a path outside every checkpoint, e.g. model.pth."
        )
    if os.path.isdir(out):
        raise SystemExit(
            f"OUT {out} is a directory: give the path of a file, e.g. "
            f"{os.path.join(out, 'model.pth')}."
        )
    if os.path.lexists(out):  # another checkpoint, latest.txt, the weights of another export...
        raise SystemExit(
            f"OUT {out} exists: the export writes a new file and never replaces one. Remove it "
            "first, or give another path."
        )
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise SystemExit(
            f"OUT {out} cannot be written: its folder {parent} does not exist. Create it, or "
            "give a path in a folder that exists."
        )


def _ancestors(path: str) -> Iterator[str]:
    """``path``'s folders, nearest first, up to the root."""
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        yield path


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or inside it, however either is spelled: relative, with
    ``..`` or a trailing slash, through symlinks (resolved), or another mount of the folder (the
    same device and inode)."""
    target = os.stat(folder)
    real = os.path.realpath(path)
    return any(
        os.path.exists(p) and os.path.samestat(os.stat(p), target)
        for p in (real, *_ancestors(real))
    )


if __name__ == "__main__":
    print(_main(sys.argv[1:]))
