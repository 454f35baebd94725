"""Sharded checkpoints of FSDP2 models, with PyTorch's Distributed Checkpoint (DCP).

A sharded checkpoint is a folder named as a checkpoint file is (``iter_8.pth/``). Every rank
writes its own shards of the model and optimizer there (DCP's ``.distcp`` files; rank 0 adds
DCP's ``.metadata``), and rank 0 writes the rest of the training state as ``trainer.pth`` and
the size and CRC-32 of each of DCP's files as ``checksums.json`` (each rank sums a share of
them). Training waits only while the shards are copied off the live tensors; the writing goes
on in the background, on a gloo group of its own. Loading runs no code from the files:
``.metadata`` is read by an unpickler that builds DCP's own classes only, and every other entry
by ``torch.load(weights_only=True)``. A checkpoint loads on any number of processes, sharded or
not (DCP reshards)::

    python -m trainer.sharded_checkpoint work_dir/checkpoints/epoch_3.pth model.pth

writes its model weights as one ``state_dict`` file, for inference; it only reads the
checkpoint, and refuses an output inside its folder.
"""

import argparse
import contextlib
import errno
import io
import json
import os
import pickle
import stat
import sys
import warnings
import zlib
from collections.abc import Iterator
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.optim import Optimizer

from .checkpoint_io import (
    Background,
    atomic_write,
    bad_tensors,
    copy_to_cpu,
    load_model_state,
    named_tensors,
    parameters,
    read_file,
    refuse_non_finite,
    walk,
)
from .distributed import (
    CpuGroup,
    all_gather,
    get_rank,
    get_world_size,
    is_main_process,
    raise_on_every_rank,
)
from .misc import plain_state_dict

# DCP warns whenever one process saves or loads alone, even when asked to (no_dist=True).
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")

STATE_FILE = "trainer.pth"  # rank 0's part: everything but the model's and optimizer's shards
MANIFEST = "checksums.json"  # {DCP's file name: [size, CRC-32]}


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a sharded checkpoint's folder."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, STATE_FILE))


class ShardedFormat:
    """A checkpoint as a folder of every rank's shards (see the module's docstring)."""

    def __init__(self, module: nn.Module, optimizer: Optimizer, cpu: CpuGroup) -> None:
        self._module = module
        self._optimizer = optimizer
        self._cpu = cpu  # the trainer's gloo group, over which the ranks agree on a load
        self.write_group: Any = None  # the gloo group of the background writes, while training

    @property
    def in_background(self) -> bool:
        """Whether writes run on the writer's thread: in one process, or on [`write_group`][]
        (outside ``train()`` under torchrun they are done when ``write`` returns)."""
        return self.write_group is not None or not dist.is_initialized()

    def write(self, state: dict[str, Any], temp: str) -> Callable[[Callable], None]:
        """Copy this rank's shards of ``state``'s model and optimizer (rank 0 the rest of it)
        for the function returned, which writes the folder ``temp`` (every rank its shards) and
        calls ``publish()`` on rank 0 once every rank's files are complete. Every rank calls
        both."""
        shards = {
            "model": get_model_state_dict(self._module),  # this rank's shards, as DTensors
            "optimizer": get_optimizer_state_dict(self._module, self._optimizer),  # by name
        }
        rest = None
        if is_main_process():
            rest = copy_to_cpu({k: v for k, v in state.items() if k not in shards})
        group = self.write_group
        storage = dcp.FileSystemWriter(temp)
        future: Any = None
        if not self.in_background:  # outside train(): now, over the default group
            _first_failure(lambda: dcp.save(shards, storage_writer=storage))
        else:  # training waits while the shards are copied (staged); a thread writes them
            future = dcp.async_save(
                shards,
                storage_writer=storage,
                process_group=group,
                async_stager=_Stager(),
                no_dist=group is None,
            )

        def write(publish: Callable[[], None]) -> None:
            if future is not None:  # raises on every rank alike: DCP shares a rank's error
                _first_failure(future.result)
            try:  # DCP writes its metadata last, on rank 0: every rank's files are complete
                manifest = json.dumps(dict(sorted(_checksums(temp, group).items())), indent=0)
                if rest is not None:
                    atomic_write(os.path.join(temp, STATE_FILE), lambda f: torch.save(rest, f))
                    atomic_write(os.path.join(temp, MANIFEST), lambda f: f.write(manifest.encode()))
                    publish()
            finally:
                if dist.is_initialized():  # every rank's wait() returns once the folder is there
                    dist.barrier(group=group)

        return write

    def read(self, path: str, check: Callable[[dict], None]) -> dict[str, Any]:
        """The sharded checkpoint at ``path`` as a checkpoint file is read to resume a run:
        ``trainer.pth`` and this process's part of the model's and optimizer's state (its shards
        for a sharded model, the whole for another) read into fresh tensors, checked finite,
        once ``check(data)`` holds. A collective: the ranks agree on every refusal."""
        with contextlib.ExitStack() as opened:
            return self._read(path, check, opened)

    def _read(
        self, path: str, check: Callable[[dict], None], opened: contextlib.ExitStack
    ) -> dict[str, Any]:
        group = self._cpu.group
        problem: Optional[Exception] = None
        try:
            if not is_sharded_checkpoint(path):
                raise IsADirectoryError(f"Checkpoint {path!r} is a directory, not a checkpoint.")
            files = opened.enter_context(contextlib.closing(_Folder(path, need_checksums=True)))
            data = read_file(os.path.join(path, STATE_FILE))
            if "model" in data or "optimizer" in data:
                _refuse(path, f"its {STATE_FILE} holds model state")
            metadata = read_metadata(path, files)
        except (RuntimeError, OSError) as e:
            problem = e
        raise_on_every_rank(problem, group=group)
        module = self._module
        saved = _saved_keys(metadata, "model.")
        shapes = {key: tuple(getattr(entry, "size", ())) for key, entry in saved.items()}
        if {k: tuple(v.shape) for k, v in plain_state_dict(module).items()} != shapes:
            # raises, naming the keys and shapes that differ (the weights are not read)
            meta = {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}
            load_model_state(module, meta, path, strict=True, sharded=False)
        model = _empty_like(get_model_state_dict(module))  # DTensor shards
        optimizer = _empty_like(get_optimizer_state_dict(module, self._optimizer))
        # the state of parameters that had none when saved (no gradient yet) stays out
        in_file = _saved_keys(metadata, "optimizer.state.")
        optimizer["state"] = {
            name: kept
            for name, entry in optimizer["state"].items()
            if (kept := {key: v for key, v in entry.items() if f"{name}.{key}" in in_file})
        }
        _load_checked({"model": model, "optimizer": optimizer}, files, group)
        bad = bad_tensors({"model": model, "optimizer": optimizer["state"]}, parameters(module))
        if get_world_size() > 1:  # each rank checked its own shards: the ranks agree
            bad = sorted({name for names in all_gather(bad, group=group) for name in names})
        refuse_non_finite(bad, path)
        data = {**data, "model": model, "optimizer": optimizer}
        check(data)  # (every rank read the same trainer.pth: they agree)
        return data


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


def _first_failure(step: Callable[[], Any]) -> None:
    """Run ``step``; DCP's ``CheckpointException`` (which ``except Exception`` misses) is
    raised as this rank's error, or the first failed rank's."""
    try:
        step()
    except dcp.CheckpointException as e:
        failures = e.failures
        raise (failures.get(get_rank()) or next(iter(failures.values())))[0] from e


def _empty_like(state: Any) -> Any:
    return walk(state, lambda path, t: torch.empty_like(t))


# Checksums: the manifest


def _checksums(folder: str, group: Any) -> dict[str, list[int]]:
    """``{name: [size, CRC-32]}`` of DCP's files in ``folder``, each rank summing a share of
    them (the ranks must list the same files). A collective of ``group`` under torchrun."""
    error = None
    names: list[str] = []
    own = {}
    try:
        names = sorted(os.listdir(folder))
        share = names[get_rank() :: get_world_size()]
        own = {name: _sum(os.path.join(folder, name)) for name in share}
    except OSError as e:
        error = e
    shares = raise_on_every_rank(error, (names, own), group=group)
    return {name: value for _, share in shares for name, value in share.items()}


def _sum(path: str) -> list[int]:
    """``[size, CRC-32]`` of the file at ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return [os.fstat(fd).st_size, _crc(fd)]
    finally:
        os.close(fd)


def _crc(fd: int) -> int:
    """The CRC-32 of the file open as ``fd`` (read with ``os.pread``: its offset stays)."""
    crc = 0
    at = 0
    buffer = memoryview(bytearray(16 << 20))
    while n := os.preadv(fd, [buffer], at):
        crc = zlib.crc32(buffer[:n], crc)
        at += n
    return crc


class _Folder(FileSystem):
    """A sharded checkpoint's files, each opened once (no link followed) and checked against
    its manifest. DCP reads them as its file system, through the descriptors that the
    checksums read, so a file replaced meanwhile is never mixed in."""

    def __init__(self, folder: str, need_checksums: bool) -> None:
        self.folder = folder
        self.sums: dict[str, list[int]] = {}  # the manifest: {name: [size, CRC-32]}
        self._fds: dict[str, int] = {}
        try:
            self._open(need_checksums)
        except BaseException:
            self.close()
            raise

    def _open(self, need_checksums: bool) -> None:
        """Open every file; read the manifest (none: refused if ``need_checksums``), once the
        folder's names, sizes and file types match it and its ``.metadata``'s bytes do (it is
        unpickled before anything else is read)."""
        folder = self.folder
        sizes = {}
        for entry in os.scandir(folder):
            try:  # (O_NONBLOCK: a FIFO would block the open)
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                _refuse(folder, f"{entry.name} is a link")
            self._fds[entry.name] = fd
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                _refuse(folder, f"{entry.name} is no regular file")
            sizes[entry.name] = info.st_size
        if MANIFEST not in sizes:
            if need_checksums:
                _refuse(folder, f"it has no {MANIFEST} (weights may load with resume=False)")
            return
        # An entry per file of the folder at most, each a name and two numbers: far below 4 KiB
        # (a damaged manifest's size, not parsed, cannot cost minutes and gigabytes)
        limit = 4096 * len(sizes)
        if sizes[MANIFEST] > limit:
            _refuse(
                folder,
                f"its {MANIFEST} has {sizes[MANIFEST]} bytes, more than the manifest of "
                f"{len(sizes)} files can (at most {limit})",
            )
        try:
            manifest = json.loads(os.pread(self._fds[MANIFEST], sizes[MANIFEST], 0))
            files = {str(k): [int(size), int(crc)] for k, (size, crc) in manifest.items()}
        except (ValueError, TypeError, AttributeError) as e:
            _refuse(folder, f"its {MANIFEST} does not parse ({e})")
        for name in sorted(files.keys() | sizes.keys() - {MANIFEST, STATE_FILE}):
            if name not in files:
                _refuse(folder, f"{name} is not in its {MANIFEST}")
            if name not in sizes:
                _refuse(folder, f"{name} is missing")
            if sizes[name] != files[name][0]:
                _refuse(folder, f"{name} has {sizes[name]} bytes, not {files[name][0]}")
        self.sums = files
        self.check([".metadata"])

    def check(self, names: list[str]) -> None:
        """Refuse the folder as damaged unless its files ``names`` have their CRC-32s."""
        for name in names:
            if name in self.sums and _crc(self._fds[name]) != self.sums[name][1]:
                _refuse(self.folder, f"the bytes of {name} changed (its CRC-32 differs)")

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        """DCP's way to open a file of the folder: the one opened (read one at a time)."""
        fd = self._fds.get(os.path.basename(path))
        if fd is None or mode != "rb":
            raise FileNotFoundError(f"{path} is not a file of the checkpoint, to read")
        with os.fdopen(os.dup(fd), "rb") as f:  # (a duplicate shares the offset)
            f.seek(0)
            yield f

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _refuse(path: str, why: str) -> NoReturn:
    raise RuntimeError(f"Checkpoint {path!r} is damaged: {why}. Use an older checkpoint.")


# Loading, without running code from the files


_METADATA_CLASSES = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (*dcp_metadata.__all__, "_MEM_FORMAT_ENCODING")
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
}
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
    """DCP's reader of a folder (through ``files``, its files opened once, if given), whose
    ``.metadata`` is read by [`_MetadataUnpickler`][] (DCP's own uses ``pickle.load``) and
    may name files of the folder only."""

    def __init__(self, path: str, files: Optional[_Folder] = None) -> None:
        super().__init__(path)
        if files is not None:
            self.fs = files

    def read_metadata(self) -> Any:
        with self.fs.create_stream(os.path.join(self.path, ".metadata"), "rb") as f:
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


def read_metadata(path: str, files: Optional[_Folder] = None) -> Any:
    """The DCP metadata of the sharded checkpoint at ``path`` (its ``files``, if opened
    already), read safely."""
    try:
        return _SafeReader(path, files).read_metadata()
    except Exception as e:
        how = "" if isinstance(e, OSError) else " safely"  # a missing file is not a threat
        raise RuntimeError(f"Checkpoint {path!r} could not be loaded{how}: .metadata: {e!r}") from e


def _dcp_load(state: dict[str, Any], files: _Folder, group: Any, alone: bool) -> None:
    """Fill ``state``'s tensors in place from the checkpoint's ``files``: a collective of
    ``group`` (None: the default one) under torchrun, unless this process reads ``alone``."""
    path = files.folder
    try:
        dcp.load(
            state,
            storage_reader=_SafeReader(path, files),
            planner=_SafePlanner(),
            process_group=group,
            no_dist=alone or not dist.is_initialized(),
        )
    except (Exception, dcp.CheckpointException) as e:  # the latter, a BaseException
        failures = getattr(e, "failures", {})
        cause = (failures.get(get_rank()) or next(iter(failures.values()), (e,)))[0]
        how = " safely" if isinstance(cause, pickle.UnpicklingError) else ""  # code in it
        raise RuntimeError(f"Checkpoint {path!r} could not be loaded{how}: {cause!r}") from e


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
    with contextlib.closing(_Folder(path, need_checksums=False)) as files:  # (older folders too)
        return _read_weights(files)


def _read_weights(files: _Folder) -> dict[str, torch.Tensor]:
    path = files.folder
    entries = _saved_keys(read_metadata(path, files), "model.")
    try:
        template = {
            f"model.{key}": torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in entries.items()
            if isinstance(entry, dcp_metadata.TensorStorageMetadata)
        }
    except Exception as e:  # a size or dtype that is no such thing
        _refuse(path, f"its metadata says {e}")
    if not template:
        raise RuntimeError(f"Checkpoint {path!r} holds no model weights.")
    _load_checked(template, files, alone=True)
    return {key[len("model.") :]: value for key, value in template.items()}


def _load_checked(
    state: dict[str, Any], files: _Folder, group: Any = None, alone: bool = False
) -> None:
    """[`_dcp_load`][], while a thread checks the shards' bytes against the manifest, each
    rank a share of them unless it reads ``alone``. Damage that any rank finds is what every
    rank raises, rather than the error DCP made of it."""
    shards = sorted(name for name in files.sums if name != ".metadata")
    share = shards if alone else shards[get_rank() :: get_world_size()]
    checking = Background("checkpoint-check")
    checking.submit(lambda: files.check(share))
    problem: Optional[Exception] = None
    try:
        _dcp_load(state, files, group, alone)
    except RuntimeError as e:
        problem = e
    damage: Optional[Exception] = None
    try:
        checking.wait()
    except (RuntimeError, OSError) as e:
        damage = e
    for error in (damage, problem):  # damage first: every rank names it, rather than DCP's
        if not alone:
            raise_on_every_rank(error, group=group)
        elif error is not None:
            raise error


class _Stager(BlockingAsyncStager):
    """DCP's blocking staging, except that a state on the CPU (FSDP2 on CPU) is cloned once:
    DCP's own deep-copies every tensor, then copies it again into that copy."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if any(t.device.type != "cpu" for _, t in named_tensors(state_dict)):
            return super().stage(state_dict)
        return walk(state_dict, lambda path, t: t.detach().clone())


def consolidate(path: str, out: str) -> None:
    """Write the model weights of the sharded checkpoint at ``path`` to ``out`` as one
    ``state_dict`` file that ``torch.load(out, weights_only=True)`` loads."""
    weights = read_weights(path)
    atomic_write(out, lambda f: torch.save(weights, f))


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
    folder = parsed.folder
    out = parsed.out
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
        raise SystemExit(f"OUT is {out!r}: give a file to write (not stdout), e.g. model.pth.")
    real = os.path.realpath(out)
    if _within(out, folder):
        raise SystemExit(
            f"OUT {out} is CHECKPOINT_FOLDER {folder} or inside it (as {real}): write elsewhere."
        )
    inside = next((p for p in _ancestors(real) if is_sharded_checkpoint(p)), None)
    if inside is not None:
        raise SystemExit(f"OUT {out} is inside the sharded checkpoint {inside}: write elsewhere.")
    if os.path.lexists(out):  # another checkpoint, latest.txt, the weights of another export...
        raise SystemExit(f"OUT {out} exists: the export writes a new file. Give another path.")


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
