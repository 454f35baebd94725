"""Checksums of checkpoint bytes, so that a checkpoint whose bytes changed after it was written
(bits flipped on a disk or a shared file system, a copy cut short, a shard of a sharded
checkpoint swapped for a link) is refused as damaged rather than loaded with wrong values.

- A checkpoint file (``torch.save``'s zip archive) ends with the CRC-32 of its bytes, as the
  archive's comment: the last field of a zip archive, which zip readers and ``torch.load`` skip.
  :func:`save` computes it while ``torch.save`` writes the file (on the background writer's
  thread); :func:`check_file` checks it.
- A sharded checkpoint's folder holds :data:`MANIFEST`: the size and CRC-32 of each of DCP's
  files (its ``trainer.pth`` carries its own, as every checkpoint file does).
  :func:`read_manifest` checks the folder's names, sizes and links; :func:`check_files`, the
  bytes.

CRC-32 finds any burst of flipped bits up to 32 long and misses other damage once in 4 billion;
zlib computes it at several GB/s without holding the GIL, so checks run beside the loading
(:func:`in_background`). Every check raises a ``RuntimeError`` naming the checkpoint as damaged;
a file that cannot be read raises its ``OSError``."""

import json
import os
import re
import stat
import struct
import threading
import zlib
from typing import Any, Callable, NoReturn

import torch

MANIFEST = "checksums.json"  # a sharded checkpoint's {DCP's file name: [size, CRC-32]}
_COMMENT = re.compile(rb"trainer-crc32:([0-9a-f]{8})")
_COMMENT_SIZE = 22  # "trainer-crc32:" and 8 hex digits
_END_RECORD = 22  # the size of a zip archive's end record without a comment
_CHUNK = 16 << 20


# Files


class _Summing:
    """A binary file's ``write`` that keeps the CRC-32 of what went through it, and the end."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.crc = 0
        self.tail = b""

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.tail = (self.tail + bytes(memoryview(data).cast("B")[-_END_RECORD:]))[-_END_RECORD:]
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def save(obj: Any, f: Any) -> None:
    """``torch.save(obj, f)`` into the binary file ``f`` (seekable, at its start), ending with
    the CRC-32 of the bytes torch.save wrote as the archive's comment."""
    summing = _Summing(f)
    torch.save(obj, summing)  # type: ignore[arg-type]  # a file-like object: its write()
    # the archive's end record, whose last field is the comment's length (0)
    if summing.tail[:4] != b"PK\x05\x06" or summing.tail[-2:] != b"\0\0":
        raise RuntimeError(f"torch.save wrote no zip archive's end as expected: {summing.tail!r}")
    comment = b"trainer-crc32:%08x" % summing.crc
    f.seek(-2, os.SEEK_END)
    f.write(struct.pack("<H", len(comment)) + comment)


def check_file(path: str, need_checksum: bool = True) -> None:
    """Raise a RuntimeError naming ``path`` as damaged unless the checkpoint file's bytes are
    those written; one without a checksum is refused too, unless not ``need_checksum``
    (weights from elsewhere, which carry none)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - _COMMENT_SIZE - 2, 0))
        end = f.read()
        found = _COMMENT.fullmatch(end[2:])
        if end[:2] != struct.pack("<H", _COMMENT_SIZE) or found is None:
            if not need_checksum and b"trainer-crc32:" not in end:  # none: from elsewhere
                return
            _refuse(
                path,
                "it carries no checksum (it was written before trainer checked checkpoints, by "
                "other means, or its end was cut off). Resume from another checkpoint; its "
                "weights may still load with load_checkpoint(path, resume=False)",
            )
        f.seek(0)
        crc = _crc(f, size - len(end))
    if zlib.crc32(b"\0\0", crc) != int(found[1], 16):  # the comment's length as written: none
        _refuse(
            path,
            "its bytes changed after it was written (its CRC-32 does not match). Use an older "
            "checkpoint, or another copy of this one",
        )


def in_background(check: Callable[[], None]) -> Callable[[], None]:
    """Start ``check()`` on a thread, to read beside the loading; the function returned waits
    for it and raises what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            check()
        except BaseException as e:  # handed to the waiting thread
            raised.append(e)

    thread = threading.Thread(target=run, name="checkpoint-checksum", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if raised:
            raise raised[0]

    return wait


def _crc(f: Any, size: int) -> int:
    """The CRC-32 of the next ``size`` bytes of the binary file ``f``."""
    crc, buffer = 0, bytearray(min(_CHUNK, max(size, 1)))
    view = memoryview(buffer)
    while size > 0:
        n = f.readinto(view[: min(size, len(buffer))])
        if not n:
            raise OSError(f"{getattr(f, 'name', 'a file')} ended {size} bytes early")
        crc = zlib.crc32(view[:n], crc)
        size -= n
    return crc


# Sharded checkpoints' folders


def sums(folder: str, names: list[str]) -> dict[str, list[int]]:
    """``{name: [size, CRC-32]}`` of the files ``names`` in ``folder``."""
    result = {}
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            result[name] = [size, _crc(f, size)]
    return result


def manifest_bytes(files: dict[str, list[int]]) -> bytes:
    """What :data:`MANIFEST` holds for ``files`` (``{name: [size, CRC-32]}``)."""
    return json.dumps(dict(sorted(files.items())), indent=0).encode()


def read_manifest(folder: str, own_checksum: str, need_checksum: bool) -> dict[str, list[int]]:
    """The sharded checkpoint's :data:`MANIFEST` (``{}`` if it has none and not
    ``need_checksum``), once the folder's names, sizes and file types match it: no file but the
    manifest is opened, no link followed. ``own_checksum``: the file that carries its own."""
    entries = {entry.name: entry.stat(follow_symlinks=False) for entry in os.scandir(folder)}
    for name, info in sorted(entries.items()):
        if stat.S_ISLNK(info.st_mode):
            _refuse(folder, f"it holds a link, {name} (a checkpoint's folder holds its own files)")
        if not stat.S_ISREG(info.st_mode):
            _refuse(folder, f"it holds {name}, which is not a file")
    if MANIFEST not in entries:
        if not need_checksum:
            return {}
        _refuse(
            folder,
            f"it carries no checksums ({MANIFEST} is missing: it was written before trainer "
            "checked checkpoints, or by other means). Resume from another checkpoint; its "
            "weights may still load with load_checkpoint(path, resume=False)",
        )
    try:
        with open(os.path.join(folder, MANIFEST), "rb") as f:
            files = {str(k): [int(size), int(crc)] for k, (size, crc) in json.load(f).items()}
    except (ValueError, TypeError, AttributeError) as e:
        _refuse(folder, f"its {MANIFEST} is damaged ({type(e).__name__}: {e})")
    for name in sorted(files.keys() | entries.keys() - {MANIFEST, own_checksum}):
        if name not in entries:
            _refuse(folder, f"{name} is missing")
        if name not in files:
            _refuse(folder, f"it holds {name}, which its {MANIFEST} does not list")
        if entries[name].st_size != files[name][0]:
            _refuse(folder, f"{name} has {entries[name].st_size} bytes, not {files[name][0]}")
    return files


def check_files(folder: str, files: dict[str, list[int]], names: list[str]) -> None:
    """Raise a RuntimeError naming ``folder`` as damaged unless the bytes of its files ``names``
    match their CRC-32s in ``files`` (its manifest)."""
    for name, (_, crc) in sums(folder, names).items():
        if crc != files[name][1]:
            why = f"the bytes of {name} changed after it was written (its CRC-32 does not match)"
            _refuse(folder, f"{why}. Use an older checkpoint, or another copy of this one")


def _refuse(path: str, why: str) -> NoReturn:
    """Raise the RuntimeError that names the checkpoint at ``path`` as damaged, and why."""
    raise RuntimeError(f"Checkpoint {path!r} is damaged: {why}.")
