import os
import pickle

import pytest
import torch

from trainer.checkpoint import (
    atomic_save,
    load_checkpoint_file,
    read_latest_pointer,
    update_latest_pointer,
)


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


def test_garbage_and_truncated_files_name_the_path(tmp_path):
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="garbage.pth' could not be loaded safely"):
        load_checkpoint_file(str(garbage))
    good = tmp_path / "good.pth"
    torch.save({"w": torch.ones(100)}, good)
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(good.read_bytes()[:200])
    with pytest.raises(RuntimeError, match="truncated.pth"):
        load_checkpoint_file(str(truncated))


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


def test_a_write_error_without_errno_still_names_the_path(tmp_path, monkeypatch):
    def broken_save(obj, f):
        raise OSError("device went away")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match=r"^Could not write .*a.pth: device went away") as error:
        atomic_save({"v": 1}, str(tmp_path / "a.pth"))
    assert error.value.errno is None
