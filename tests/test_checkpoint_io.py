"""Checkpoint bytes on disk (trainer/checkpoint_io.py): atomic and background writes, the
latest.txt pointer, safe reads."""

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

from trainer import checksum
from trainer.checkpoint import read_latest_pointer, update_latest_pointer
from trainer.checkpoint_io import BackgroundWriter, atomic_save, load_checkpoint_file
from trainer.hooks import CheckpointHook

from conftest import save_checkpoint_file


def test_atomic_save_round_trip_and_pointer(tmp_path):
    atomic_save({"w": torch.arange(3)}, str(tmp_path / "a.pth"))
    update_latest_pointer(str(tmp_path), "a.pth")
    assert read_latest_pointer(str(tmp_path)) == str(tmp_path / "a.pth")
    assert torch.equal(load_checkpoint_file(str(tmp_path / "a.pth"))["w"], torch.arange(3))
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
    assert load_checkpoint_file(path) == {"v": 1}
    assert os.listdir(tmp_path) == ["a.pth"]  # the temporary file is gone


def test_no_pointer_means_no_checkpoint(tmp_path):
    assert read_latest_pointer(str(tmp_path)) is None


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        load_checkpoint_file(str(tmp_path / "nope.pth"))


def damaged(tmp_path, how: str) -> str:
    """A file named like a checkpoint that is none, or a damaged one, written ``how``."""
    torch.save({"model": {"w": torch.randn(64, 64)}}, tmp_path / "good.pth")
    whole = (tmp_path / "good.pth").read_bytes()
    noise = torch.randint(0, 256, (1 << 20,), generator=torch.Generator().manual_seed(0))
    content = {
        "zeros": bytes(4 << 20),  # as a 2 GiB file of them: torch takes it for its old tar format
        "random bytes": noise.to(torch.uint8).numpy().tobytes(),
        "text": b"epoch: 3\nloss: 0.25\n",
        "empty": b"",
        "cut in the middle": whole[: len(whole) // 2],
        "cut short": whole[:100],
    }[how]
    path = tmp_path / "iter_8.pth"
    path.write_bytes(content)
    return str(path)


DAMAGED = ["zeros", "random bytes", "text", "empty", "cut in the middle", "cut short"]


@pytest.mark.parametrize("how", DAMAGED)
def test_a_file_that_is_no_checkpoint_or_a_damaged_one_is_named_as_such(tmp_path, how):
    """Not with torch's advice to load it with weights_only=False (which, for a file from
    elsewhere, would run whatever code it holds), not even in the traceback's causes."""
    path = damaged(tmp_path, how)
    with pytest.raises(RuntimeError, match=r"iter_8\.pth' is damaged: it carries no checksum"):
        load_checkpoint_file(path)  # to resume from: a checkpoint must carry its checksum
    with pytest.raises(RuntimeError) as error:
        load_checkpoint_file(path, need_checksum=False)  # weights from elsewhere
    message = str(error.value)
    assert message.startswith(
        f"Checkpoint {path!r} is not a checkpoint torch can read, or is damaged (cut short or "
        "overwritten): torch.load failed with "
    )
    assert message.endswith(
        "Pass a file that torch.save wrote, whole (copy it again if it was cut short)."
    )
    shown = "".join(traceback.format_exception(error.value))  # what the user sees, causes too
    assert "weights_only=False" not in shown and "set to `False`" not in shown


def test_a_checkpoint_file_carries_the_checksum_of_its_bytes(tmp_path):
    path = tmp_path / "state.pth"
    state = {"w": torch.arange(1000.0), "note": "plain data"}
    atomic_save(state, str(path))
    loaded = torch.load(path, weights_only=True)  # still a file torch.load reads alone
    assert torch.equal(loaded["w"], state["w"]) and loaded["note"] == "plain data"
    assert zipfile.ZipFile(path).comment.startswith(b"trainer-crc32:")
    assert torch.equal(load_checkpoint_file(str(path))["w"], state["w"])
    data = path.read_bytes()
    at = data.index(struct.pack("<f", 500.0))  # a byte of a weight, flipped
    path.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    assert torch.load(path, weights_only=True)["w"][500] != 500.0  # torch alone reads it wrong
    for need_checksum in (True, False):  # checked wherever there is a checksum
        with pytest.raises(RuntimeError, match="state.pth' is damaged: its bytes changed"):
            load_checkpoint_file(str(path), need_checksum)
    # a file from elsewhere, without a checksum, loads as weights only
    torch.save(state, path)
    assert torch.equal(load_checkpoint_file(str(path), need_checksum=False)["w"], state["w"])
    with pytest.raises(RuntimeError, match="state.pth' is damaged: it carries no checksum"):
        load_checkpoint_file(str(path))


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
        load_checkpoint_file(str(path))
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
        load_checkpoint_file(str(path))
    assert str(error.value) == (
        f"Checkpoint {str(path)!r} could not be loaded safely (weights_only=True): it would call "
        f"{os.system.__module__}.system, code that no checkpoint holds. Do not load this file."
    )
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
        load_checkpoint_file(str(path))
    message = str(error.value)
    assert message.startswith(f"Checkpoint {str(path)!r} could not be loaded safely ")
    name = f"{Settings.__module__}.Settings"
    assert f"GLOBAL {name} was not an allowed global by default" in message
    assert f"torch.serialization.add_safe_globals([{name}])" in message
    assert "only if you trust the source of the checkpoint" in message


def test_a_write_error_without_errno_still_names_the_path(tmp_path, monkeypatch):
    def broken_save(obj, f):
        raise OSError("device went away")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match=r"^Could not write .*a.pth: device went away") as error:
        atomic_save({"v": 1}, str(tmp_path / "a.pth"))
    assert error.value.errno is None


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
    saved = load_checkpoint_file(path)["model"]
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
    writer, order = BackgroundWriter(), []
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


def test_a_garbled_checksum_is_damage_even_for_weights_from_elsewhere(tmp_path):
    path = tmp_path / "state.pth"
    atomic_save({"w": torch.arange(1000.0)}, str(path))
    data = path.read_bytes()
    at = data.index(struct.pack("<f", 500.0))
    garbled = data[:at] + bytes([data[at] ^ 1]) + data[at + 1 : -8] + b"zzzzzzzz"
    path.write_bytes(garbled)
    for need_checksum in (True, False):
        with pytest.raises(RuntimeError, match="state.pth' is damaged: it carries no checksum"):
            load_checkpoint_file(str(path), need_checksum)


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), MemoryError()])
def test_a_file_the_check_cannot_read_raises_what_reading_raised(tmp_path, monkeypatch, error):
    """Not "damaged" (the bytes may be fine), and never taken for a checksum that holds."""
    path = tmp_path / "state.pth"
    atomic_save({"w": torch.ones(3)}, str(path))

    def unreadable(f, size):
        raise error

    monkeypatch.setattr(checksum, "_crc", unreadable)
    with pytest.raises(type(error)) as raised:
        load_checkpoint_file(str(path))
    assert raised.value is error
