"""The logs a rerun or a resumed run finds: it drops what it will write again, and its new
TensorBoard event file sorts after the others. Imported only when there are such logs."""

import json
import os
import time
from typing import Any, Callable

from .checkpoint_files import atomic_write
from .writers import _SUFFIX


def rewind_event_files(log_dir: str, step: int, new_writer: Callable[[], Any]) -> Any:
    """Drop the events of ``step`` and later from the trainer's event files in ``log_dir``, then
    return ``new_writer()``, a ``SummaryWriter`` whose event file sorts after the others."""
    _drop_events_from(log_dir, step)
    old = _event_files(log_dir)
    writer = new_writer()
    # TensorBoard reads a folder's event files in name order (and applies a purge_step only to
    # those before its own). A name is events.out.tfevents.<second>.<host>.<pid>.<n>, with n
    # counting the process's writers unpadded: a file could sort before one of the same second
    # (n=10 before n=9, or another pid), and its curves mix with the old ones. The next second's
    # name sorts after; one more than 2 s ahead means a clock set back: no use waiting.
    for _ in range(2):
        new = max(_event_files(log_dir) - old)
        if all(name < new for name in old) or max(map(_second, old)) > time.time() + 2:
            break
        writer.close()
        os.remove(os.path.join(log_dir, new))
        time.sleep(1 - time.time() % 1)
        writer = new_writer()
    return writer


def _second(name: str) -> int:
    """The second in an event file's name (``events.out.tfevents.<second>.<host>...``)."""
    field = name.split(".")[3]
    return int(field) if field.isdigit() else 0


def _event_files(log_dir: str) -> set[str]:
    return {name for name in os.listdir(log_dir) if "tfevents" in name}


def _drop_events_from(log_dir: str, step: int) -> None:
    """Remove the events of ``step`` and later from the trainer's event files in ``log_dir``
    (with TensorBoard's own reader and record writer); a file left with none is deleted."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    for name in sorted(os.listdir(log_dir)):
        path = os.path.join(log_dir, name)
        if not name.endswith(_SUFFIX) or not os.path.isfile(path) or os.path.islink(path):
            continue
        records = list(RawEventFileLoader(path).Load())  # a record cut short by a kill: dropped
        kept = [r for r in records if Event.FromString(r).step < step]
        # each record has a 16-byte header and footer: a size that differs means one cut short
        if len(kept) == len(records) and os.path.getsize(path) == sum(len(r) + 16 for r in records):
            continue
        if all(Event.FromString(r).HasField("file_version") for r in kept):  # no data left
            os.remove(path)
            continue

        def write(f: Any, kept: list[bytes] = kept) -> None:
            writer = RecordWriter(f)
            for record in kept:
                writer.write(record)

        atomic_write(path, write)


def keep_lines_before(path: str, start_iter: int) -> None:
    """Keep the lines of ``metrics.jsonl`` before iteration ``start_iter``."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["iter"] < start_iter:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            break  # a line cut short by a crash, and whatever follows it
    if len(kept) < len(lines):
        atomic_write(path, lambda f: f.write("".join(kept).encode("utf-8")))
