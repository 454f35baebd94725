"""Checksums of checkpoint bytes, so that a checkpoint whose bytes changed after it was written
(bits flipped on a disk or a shared file system, a copy cut short, a file swapped for a link) is
refused as damaged rather than loaded with wrong values.

- A checkpoint file (``torch.save``'s zip archive) ends with the CRC-32 of its bytes, as the
  archive's comment: the last field of a zip archive, which zip readers and ``torch.load`` skip.
  :func:`save` writes it while ``torch.save`` writes the file (on the background writer's
  thread); :func:`file_damage` checks it.
- A sharded checkpoint's folder holds :data:`MANIFEST`: every other file's size and CRC-32.
  :func:`folder_damage` checks the names, sizes and links; :func:`changed_files`, the bytes.

CRC-32 finds any burst of flipped bits up to 32 long and misses other damage once in 4 billion;
zlib computes it at several GB/s, without the GIL, so checks run beside the loading."""

import json
import os
import stat
import struct
import threading
import zlib
from typing import Any, Callable, Optional, Sequence

import torch

MANIFEST = "checksums.json"  # a sharded checkpoint's {file name: [size, CRC-32]}
_LABEL = b"trainer-crc32:"
_COMMENT = len(_LABEL) + 8  # the label and 8 hex digits
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
    torch.save(obj, summing)
    # the archive's end record, whose last field is the comment's length (0)
    assert summing.tail[:4] == b"PK\x05\x06" and summing.tail[-2:] == b"\0\0", summing.tail
    comment = _LABEL + b"%08x" % summing.crc
    f.seek(-2, os.SEEK_END)
    f.write(struct.pack("<H", len(comment)) + comment)


def file_damage(path: str, need_checksum: bool = True) -> Optional[str]:
    """Why the checkpoint file at ``path`` is damaged, or None: its bytes are those written (or,
    without ``need_checksum``, it carries no checksum to check: weights from elsewhere)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - _COMMENT - 2, 0))
        end = f.read()
        if end[:2] != struct.pack("<H", _COMMENT) or not end[2:].startswith(_LABEL):
            if not need_checksum:
                return None
            return (
                "it carries no checksum: it was written before trainer checked checkpoints, "
                "by other means, or its end was cut off"
            )
        f.seek(0)
        crc = _crc(f, size - len(end))
    written = int(end[2 + len(_LABEL) :], 16)
    if zlib.crc32(b"\0\0", crc) != written:  # with the comment's length as written: none
        return "its bytes changed after it was written (its CRC-32 does not match)"
    return None


def checking(check: Callable[[], Optional[str]]) -> Callable[[], Optional[str]]:
    """Start ``check()`` on a thread (to read beside the loading); the function returned waits
    for it and returns its result, or the reason of the ``OSError`` it raised."""
    result: list[Optional[str]] = [None]

    def run() -> None:
        try:
            result[0] = check()
        except OSError as e:
            result[0] = f"{e.strerror or e} while its checksum was checked"

    thread = threading.Thread(target=run, name="checkpoint-checksum", daemon=True)
    thread.start()

    def wait() -> Optional[str]:
        thread.join()
        return result[0]

    return wait


def _crc(f: Any, size: int, crc: int = 0) -> int:
    """The CRC-32 of the next ``size`` bytes of the binary file ``f``."""
    buffer = bytearray(min(_CHUNK, max(size, 1)))
    view = memoryview(buffer)
    while size > 0:
        n = f.readinto(view[: min(size, len(buffer))])
        if not n:
            raise OSError(f"the file ended {size} bytes early")
        crc = zlib.crc32(view[:n], crc)
        size -= n
    return crc


# Folders (sharded checkpoints)


def sums(folder: str, names: Sequence[str]) -> dict[str, list[int]]:
    """``{name: [size, CRC-32]}`` of the files ``names`` in ``folder``."""
    result = {}
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            result[name] = [size, _crc(f, size)]
    return result


def write_manifest(folder: str, files: dict[str, list[int]], write: Callable) -> None:
    """Write :data:`MANIFEST` into ``folder`` through ``write(path, write_bytes)`` (an atomic
    write of the caller's)."""
    text = json.dumps(dict(sorted(files.items())), indent=0)
    write(os.path.join(folder, MANIFEST), lambda f: f.write(text.encode()))


def folder_damage(folder: str) -> tuple[Optional[str], dict[str, list[int]]]:
    """``(why the sharded checkpoint's folder is damaged or None, its manifest)`` from its names,
    sizes and file types alone (no file is opened but the manifest): a link or a folder in it,
    a file missing, unlisted or of another size."""
    entries = {entry.name: entry.stat(follow_symlinks=False) for entry in os.scandir(folder)}
    for name, info in sorted(entries.items()):
        if stat.S_ISLNK(info.st_mode):
            return f"it holds a link, {name} (a checkpoint's folder holds its own files)", {}
        if not stat.S_ISREG(info.st_mode):
            return f"it holds {name}, which is not a file", {}
    if MANIFEST not in entries:
        return (
            f"it carries no checksums ({MANIFEST} is missing): it was written before trainer "
            "checked checkpoints, or by other means",
            {},
        )
    try:
        with open(os.path.join(folder, MANIFEST), "rb") as f:
            files = json.loads(f.read())
        files = {str(k): [int(size), int(crc)] for k, (size, crc) in files.items()}
    except (ValueError, TypeError, AttributeError) as e:
        return f"its {MANIFEST} is damaged ({type(e).__name__}: {e})", {}
    for name in sorted(files.keys() | entries.keys() - {MANIFEST}):
        if name not in entries:
            return f"{name} is missing", {}
        if name not in files:
            return f"it holds {name}, which its {MANIFEST} does not list", {}
        if entries[name].st_size != files[name][0]:
            return f"{name} has {entries[name].st_size} bytes, not the {files[name][0]} written", {}
    return None, files


def changed_files(folder: str, files: dict[str, list[int]], share: slice) -> Optional[str]:
    """Why the files of ``folder`` that ``share`` picks of ``files`` (a manifest, by name) are
    damaged, or None: their bytes match their CRC-32s."""
    names = sorted(files)[share]
    for name, (_, crc) in sums(folder, names).items():
        if crc != files[name][1]:
            return f"the bytes of {name} changed after it was written (its CRC-32 does not match)"
    return None
