"""Checkpoint bytes on disk (trainer/checkpoint_io.py): atomic and background writes, the
latest.txt pointer, reads checked by the CRC-32s of a file's zip records."""

import io
import os
import pickle
import stat
import struct
import threading
import time
import traceback
import zipfile

import pytest
import torch

from trainer import checkpoint_io
from trainer.checkpoint import read_latest_pointer, update_latest_pointer
from trainer.checkpoint_io import Background, atomic_write, read_file
from trainer.hooks import CheckpointHook

from conftest import load, save_checkpoint_file


def atomic_save(obj, path):
    atomic_write(str(path), lambda f: torch.save(obj, f))


def test_atomic_write_round_trip_and_pointer(tmp_path):
    atomic_save({"w": torch.arange(3)}, tmp_path / "a.pth")
    update_latest_pointer(str(tmp_path), "a.pth")
    assert read_latest_pointer(str(tmp_path)) == str(tmp_path / "a.pth")
    assert torch.equal(read_file(str(tmp_path / "a.pth"))["w"], torch.arange(3))
    assert sorted(os.listdir(tmp_path)) == ["a.pth", "latest.txt"]


def test_a_failed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = str(tmp_path / "a.pth")
    atomic_save({"v": 1}, path)

    def broken_save(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="No space left"):
        atomic_save({"v": 2}, path)
    monkeypatch.undo()
    assert read_file(path) == {"v": 1}
    assert os.listdir(tmp_path) == ["a.pth"]  # the temporary file is gone


def test_no_pointer_means_no_checkpoint(tmp_path):
    assert read_latest_pointer(str(tmp_path)) is None


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        read_file(str(tmp_path / "nope.pth"))


STATE = {"model": {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(3)}, "step": 3}


def records(data):
    """Where the parts of a torch.save file are: {part: (start, end)}."""
    archive = zipfile.ZipFile(io.BytesIO(data))
    end = data.rfind(b"PK\x05\x06")
    parts = {"the end record": (end, end + 22)}
    for info in archive.infolist():
        start = info.header_offset
        name, extra = struct.unpack("<HH", data[start + 26 : start + 30])
        if info.filename.endswith("data/0"):  # the first tensor
            parts["a tensor's header"] = (start, start + 30 + name + extra)
            parts["a tensor's bytes"] = (start + 30 + name + extra, start + 30 + name + extra + 64)
    central = struct.unpack("<I", data[end + 16 : end + 20])[0]
    parts["the central directory"] = (central, end)
    return parts


def damaged(tmp_path, how: str) -> str:
    """A file named like a checkpoint that is none, or a damaged one, written ``how``."""
    torch.save(STATE, tmp_path / "good.pth")
    whole = (tmp_path / "good.pth").read_bytes()
    parts = records(whole)
    noise = torch.randint(0, 256, (1 << 20,), generator=torch.Generator().manual_seed(0))
    at = {name: start + 1 for name, (start, _) in parts.items()}
    flipped = {
        name: whole[:i] + bytes([whole[i] ^ 0xFF]) + whole[i + 1 :] for name, i in at.items()
    }
    content = {
        "zeros": bytes(4 << 20),  # as a 2 GiB file of them: torch takes it for its old tar format
        "random bytes": noise.to(torch.uint8).numpy().tobytes(),
        "text": b"epoch: 3\nloss: 0.25\n",
        "empty": b"",
        "cut in the middle": whole[: len(whole) // 2],
        "cut short": whole[:100],
        "cut by one byte": whole[:-1],
        "header": bytes([whole[0] ^ 0xFF]) + whole[1:],  # the first record's signature
        "a tensor's bytes": flipped["a tensor's bytes"],
        "the end record": flipped["the end record"],  # (its signature)
        # the bit of a record's attributes that torch's reader takes for a directory: it then
        # loads nothing into that tensor (uninitialised memory), and no CRC covers the bit
        "marked as a directory": bytearray(whole),
    }[how]
    if how == "marked as a directory":
        central = parts["the central directory"][0]
        content[central + 38] |= 0x10  # the first record's external attributes
    path = tmp_path / "iter_8.pth"
    path.write_bytes(bytes(content))
    return str(path)


DAMAGED = [
    "zeros",
    "random bytes",
    "text",
    "empty",
    "cut in the middle",
    "cut short",
    "cut by one byte",
    "header",
    "a tensor's bytes",
    "the end record",
    "marked as a directory",
]


@pytest.mark.parametrize("how", DAMAGED)
def test_a_file_that_is_no_checkpoint_or_a_damaged_one_is_named_as_such(tmp_path, how):
    """Not with torch's advice to load it with weights_only=False (which, for a file from
    elsewhere, would run whatever code it holds), not even in the traceback's causes."""
    path = damaged(tmp_path, how)
    with pytest.raises(RuntimeError, match=r"iter_8\.pth' is damaged or no torch.save file"):
        read_file(path)
    with pytest.raises(RuntimeError) as error:
        read_file(path)
    shown = "".join(traceback.format_exception(error.value))  # what the user sees, causes too
    assert "weights_only=False" not in shown and "set to `False`" not in shown


def test_torch_load_alone_loads_a_flipped_byte_that_the_records_crcs_refuse(tmp_path):
    path = damaged(tmp_path, "a tensor's bytes")
    loaded = torch.load(path, weights_only=True)  # torch reads the record as it is
    assert not torch.equal(loaded["model"]["w"], STATE["model"]["w"])
    with pytest.raises(RuntimeError, match="is damaged or no torch.save file .*Bad CRC-32"):
        read_file(path)


@pytest.mark.parametrize("how", ["a comment", "appended bytes"])
def test_bytes_outside_the_records_are_no_damage_to_what_loads(tmp_path, how):
    """What torch.load reads is the records: a zip comment or bytes after the archive change
    none of them (the trailer of earlier rounds refused these files)."""
    torch.save(STATE, tmp_path / "good.pth")
    whole = (tmp_path / "good.pth").read_bytes()
    if how == "a comment":
        whole = whole[:-2] + struct.pack("<H", 5) + b"hello"
    else:
        whole += b"appended"
    (tmp_path / "x.pth").write_bytes(whole)
    assert_same(read_file(str(tmp_path / "x.pth")), STATE)


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.dtype == b.dtype
    elif isinstance(a, dict):
        assert a.keys() == b.keys() and all(assert_same(a[k], b[k]) is None for k in a)
    else:
        assert a == b


@pytest.mark.slow
def test_every_byte_flipped_in_the_archives_structure_is_refused_or_loads_the_same(tmp_path):
    """Each bit pattern of each byte of a tensor's local header, the central directory and
    the end record: read_file refuses it, or loads exactly what was saved."""
    torch.save(STATE, tmp_path / "good.pth")
    whole = (tmp_path / "good.pth").read_bytes()
    path = tmp_path / "x.pth"
    parts = records(whole)
    positions = [
        i
        for name, (start, end) in parts.items()
        for i in range(start, end)
        if name != "a tensor's bytes"
    ]
    outcomes = {"refused": 0, "the same": 0}
    for i in positions:
        for mask in (0x01, 0x10, 0x80, 0xFF):
            path.write_bytes(whole[:i] + bytes([whole[i] ^ mask]) + whole[i + 1 :])
            try:
                loaded = read_file(str(path))
            except RuntimeError:
                outcomes["refused"] += 1
                continue
            assert_same(loaded, STATE)
            outcomes["the same"] += 1
    assert outcomes["refused"] > 0 and outcomes["the same"] > 0


class Payload:
    def __reduce__(self):
        return (open, ("/tmp/trainer-test-payload-ran", "w"))


def test_pickled_code_is_refused_and_never_runs(tmp_path):
    marker = "/tmp/trainer-test-payload-ran"
    if os.path.exists(marker):
        os.remove(marker)
    path = tmp_path / "evil.pth"
    with open(path, "wb") as f:
        torch.save({"model": Payload()}, f, pickle_module=pickle)
    with pytest.raises(RuntimeError, match="evil.pth"):
        read_file(str(path))
    assert not os.path.exists(marker)


class RunsACommand:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_a_command_is_refused_without_torchs_advice(tmp_path):
    marker = tmp_path / "command-ran"
    path = tmp_path / "evil.pth"
    save_checkpoint_file({"model": {"w": torch.ones(1)}, "extra": RunsACommand(marker)}, path)
    with pytest.raises(RuntimeError) as error:
        read_file(str(path))
    message = str(error.value)
    assert message.startswith(f"Checkpoint {str(path)!r} could not be loaded safely")
    assert f"it would call {os.system.__module__}.system" in message
    shown = "".join(traceback.format_exception(error.value))
    assert "weights_only=False" not in shown and "set to `False`" not in shown
    assert not marker.exists()


class Settings:
    """A class of the user's, pickled whole into a checkpoint (which keeps plain data only)."""

    def __init__(self):
        self.lr = 0.1


def test_a_checkpoint_holding_an_object_of_a_class_names_it_and_how_to_allow_it(tmp_path):
    path = tmp_path / "objects.pth"
    save_checkpoint_file({"model": {"w": torch.ones(1)}, "settings": Settings()}, path)
    with pytest.raises(RuntimeError) as error:
        read_file(str(path))
    message = str(error.value)
    assert message.startswith(f"Checkpoint {str(path)!r} could not be loaded safely")
    name = f"{Settings.__module__}.Settings"
    assert f"GLOBAL {name} was not an allowed global by default" in message
    assert f"torch.serialization.add_safe_globals([{name}])" in message
    assert "only if you trust the source of the checkpoint" in message


def test_a_write_error_without_errno_still_names_the_path(make_trainer, monkeypatch):
    trainer = make_trainer(max_iters=4, checkpoint_period=100)
    trainer.train()

    def broken_save(obj, f, *args, **kwargs):
        raise OSError("device went away")

    monkeypatch.setattr(torch, "save", broken_save)
    trainer.save_checkpoint("a.pth")
    with pytest.raises(OSError, match=r"^Could not write .*a.pth: device went away") as error:
        trainer.checkpointer.wait()
    assert error.value.errno is None
    assert sorted(os.listdir(trainer.ckpt_dir)) == ["iter_4.pth", "latest.txt"]  # no .a.pth.tmp


def test_a_checkpoint_replaced_while_it_loads_never_loads_damaged_weights(
    make_trainer, monkeypatch
):
    """A sync tool that copies a checkpoint in and renames it over the old one (cp, then mv)
    while a run loads it: the check and the load read the one file opened, never a mix."""
    trainer = make_trainer(max_epochs=1)
    trainer.train()
    path = os.path.join(trainer.ckpt_dir, "epoch_1.pth")
    good = load(path)["model"]
    data = open(path, "rb").read()
    at = data.index(good["linear.weight"].numpy().tobytes())  # a weight's bytes, flipped
    copy = path + ".copy"
    real_load = torch.load
    for resume in (True, False):

        def swapped_mid_load(f, *args, **kwargs):
            with open(copy, "wb") as out:
                out.write(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :])
            os.replace(copy, path)  # the damaged copy takes the name as the load begins
            return real_load(f, *args, **kwargs)

        with open(path, "wb") as f:
            f.write(data)
        monkeypatch.setattr(torch, "load", swapped_mid_load)
        fresh = make_trainer(max_epochs=1)
        fresh.load_checkpoint(path, resume=resume)  # the bytes opened, which are undamaged
        monkeypatch.setattr(torch, "load", real_load)
        assert all(torch.equal(v, good[k]) for k, v in fresh.model.state_dict().items())
        with pytest.raises(RuntimeError, match="is damaged"):  # the copy, loaded now
            fresh.load_checkpoint(path, resume=resume)


# ---- background writes ---------------------------------------------------------------------


class HeldSave:
    """Replaces torch.save: each write waits until the test releases it."""

    def __init__(self, monkeypatch):
        self.release = threading.Event()
        self.started = threading.Event()
        real_save = torch.save

        def save(obj, f, *args, **kwargs):
            self.started.set()
            assert self.release.wait(timeout=30), "the test never released the write"
            return real_save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)


def test_save_returns_before_the_write_and_saves_the_state_of_the_call(make_trainer, monkeypatch):
    trainer = make_trainer(max_iters=4, checkpoint_period=100)
    trainer.train()
    held = HeldSave(monkeypatch)
    expected = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    path = trainer.save_checkpoint("probe.pth")
    assert held.started.wait(timeout=30)
    assert not os.path.exists(path)  # written in the background, still held
    with torch.no_grad():  # training goes on and changes the weights in place
        for p in trainer.model.parameters():
            p.add_(1.0)
    held.release.set()
    trainer.checkpointer.wait()
    saved = read_file(path)["model"]
    assert all(torch.equal(saved[k], v) for k, v in expected.items())
    assert read_latest_pointer(trainer.ckpt_dir) == path


def test_old_checkpoints_are_deleted_only_once_the_new_one_is_durable(make_trainer, monkeypatch):
    def trainer_keeping_one(max_epochs):
        trainer = make_trainer(max_epochs=max_epochs, checkpoint_period=0)  # no default hook
        trainer.register_hook(CheckpointHook(period=1, max_to_keep=1))
        return trainer

    trainer_keeping_one(1).train()
    trainer = trainer_keeping_one(2)  # resumes, then saves epoch_2.pth
    first = os.path.join(trainer.ckpt_dir, "epoch_1.pth")
    held, seen = HeldSave(monkeypatch), {}

    def while_held():
        if held.started.wait(timeout=30):
            seen["first"] = os.path.exists(first)
            seen["pointer"] = read_latest_pointer(trainer.ckpt_dir)
        held.release.set()

    watcher = threading.Thread(target=while_held)
    watcher.start()
    trainer.train()  # its end waits for the write
    watcher.join()
    assert seen == {"first": True, "pointer": first}
    assert sorted(os.listdir(trainer.ckpt_dir)) == ["epoch_2.pth", "latest.txt"]


def test_a_failed_background_write_raises_at_the_next_wait(make_trainer, monkeypatch):
    trainer = make_trainer(max_iters=4, checkpoint_period=100)
    trainer.train()

    def full_disk(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    trainer.save_checkpoint("probe.pth")  # returns: the failure happens in the background
    with pytest.raises(OSError, match=r"Could not write .*probe.pth: No space left on device"):
        trainer.checkpointer.wait()
    trainer.checkpointer.wait()  # reported once
    assert read_latest_pointer(trainer.ckpt_dir).endswith("iter_4.pth")


def test_background_writer_runs_writes_one_at_a_time_in_order():
    writer, order = Background("test"), []
    for i in range(3):
        writer.submit(lambda i=i: (time.sleep(0.05), order.append(i)))
        assert order == list(range(i))  # submit waited for the previous write only
    writer.wait()
    assert order == [0, 1, 2]


@pytest.mark.parametrize("umask, mode", [(0o027, 0o640), (0o002, 0o664)])
def test_checkpoints_get_the_permissions_the_umask_gives_every_other_file(
    make_trainer, umask, mode
):
    previous = os.umask(umask)
    try:
        trainer = make_trainer(max_epochs=1)
        trainer.train()
    finally:
        os.umask(previous)
    files = [
        os.path.join(trainer.ckpt_dir, "epoch_1.pth"),
        os.path.join(trainer.ckpt_dir, "latest.txt"),
        os.path.join(trainer.work_dir, "log.txt"),
        os.path.join(trainer.work_dir, "metrics.jsonl"),
    ]
    assert {path: oct(stat.S_IMODE(os.stat(path).st_mode)) for path in files} == {
        path: oct(mode) for path in files
    }


def test_a_checkpoint_in_a_sub_folder_has_its_own_latest_pointer(make_trainer):
    trainer = make_trainer(max_epochs=1)
    trainer.train()
    os.makedirs(os.path.join(trainer.ckpt_dir, "best"))
    trainer.save_checkpoint("best/model.pth")
    trainer.checkpointer.wait()
    # the run's pointer still names its newest periodic checkpoint, which auto-resume lists
    with open(os.path.join(trainer.ckpt_dir, "latest.txt")) as f:
        assert f.read() == "epoch_1.pth"
    with open(os.path.join(trainer.ckpt_dir, "best", "latest.txt")) as f:
        assert f.read() == "model.pth"


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), MemoryError()])
def test_a_file_the_check_cannot_read_raises_what_reading_raised(tmp_path, monkeypatch, error):
    """Not "damaged" (the bytes may be fine), and never taken for CRCs that hold."""
    path = tmp_path / "state.pth"
    atomic_save({"w": torch.ones(3)}, path)

    def unreadable(self, n=-1):
        raise error

    monkeypatch.setattr(checkpoint_io._At, "read", unreadable)
    with pytest.raises(type(error)) as raised:
        read_file(str(path))
    assert raised.value is error


def test_background_work_lets_a_signal_in_while_it_is_waited_for():
    """wait() joins in short steps: a signal handler runs within them, not when the work ends
    (a bare join could hold a Ctrl-C until a write finished)."""
    import signal

    handled = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: handled.append(time.time()))
    try:
        work = Background("slow")
        work.submit(lambda: time.sleep(1.0))
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        start = time.time()
        work.wait()
        assert handled and handled[0] - start < 0.6  # handled while the work went on
    finally:
        signal.signal(signal.SIGUSR1, previous)
