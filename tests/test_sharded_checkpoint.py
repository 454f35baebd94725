"""Sharded checkpoints of FSDP2 models (torch.distributed.checkpoint): every rank writes its own
shards in the background, a checkpoint is whole or absent, it loads on another number of
processes, and loading it runs no code from its files."""

import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import Trainer
from trainer.sharded_checkpoint import MANIFEST, STATE_FILE, read_metadata, read_weights
from trainer.sharded_checkpoint import _main as sharded_main

from conftest import (
    communicate,
    cpu_env,
    failure_output,
    popen,
    save_checkpoint_file,
    torchrun_command,
)
from test_resume import (
    assert_bit_equal,
    load,
    run,
    start_torchrun,
    torchrun,
    wait_for_training,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two uninterrupted runs of tests/resume_worker.py on 2 ranks, the model sharded by FSDP2:
    one saving sharded checkpoints (the default), one full files; they train alike."""
    root = tmp_path_factory.mktemp("runs")
    for name, env in (("sharded", {}), ("full", {"FULL_CKPT": 1})):
        code, err = torchrun(root / name, root / f"{name}.pth", SHARD=1, CLIP=0.05, **env)
        assert code == 0, failure_output(err)
    assert_bit_equal(load(root / "sharded.pth"), load(root / "full.pth"))
    return root


def latest(work):
    ckpt_dir = work / "checkpoints"
    return ckpt_dir / (ckpt_dir / "latest.txt").read_text().strip()


@pytest.mark.slow
def test_every_rank_writes_its_own_shards_and_rank_0_the_rest(runs):
    folder = runs / "sharded" / "checkpoints" / "iter_12.pth"
    assert sorted(os.listdir(folder)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        MANIFEST,
        STATE_FILE,
    ]
    manifest = json.loads((folder / MANIFEST).read_text())
    assert sorted(manifest) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # DCP's files
    for name in manifest:
        data = (folder / name).read_bytes()
        assert manifest[name] == [len(data), zlib.crc32(data)], name
    metadata = read_metadata(str(folder))
    for name in (
        "model.net.0.weight",
        "model.net.0.bias",
        "optimizer.state.net.0.weight.momentum_buffer",
    ):
        chunks = metadata.state_dict_metadata[name].chunks
        assert [tuple(c.offsets) for c in chunks] in ([(0,), (8,)], [(0, 0), (8, 0)])
        files = {
            info.relative_path for index, info in metadata.storage_data.items() if index.fqn == name
        }
        assert files == {"__0_0.distcp", "__1_0.distcp"}  # half the rows each
    rest = load(folder / STATE_FILE)
    assert "model" not in rest and "optimizer" not in rest and len(rest["rng"]) == 2
    assert rest["progress"]["iters_done"] == 12 and rest["progress"]["world_size"] == 2
    # the newest 3 kept, each a folder; no temporary folder left
    assert sorted(os.listdir(runs / "sharded" / "checkpoints")) == [
        "epoch_3.pth",
        "iter_12.pth",
        "iter_9.pth",
        "latest.txt",
    ]
    assert latest(runs / "sharded").name == "epoch_3.pth"


class Net(nn.Module):
    """tests/resume_worker.py's model, in this process and unsharded."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def forward(self, batch):
        x, y, _ = batch
        return nn.functional.mse_loss(self.net(x), y)


def plain_trainer(work_dir):
    """A single-process trainer that can resume resume_worker.py's checkpoints."""
    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1), torch.arange(40))
    return Trainer(
        net,
        optimizer,
        scheduler,
        DataLoader(data, batch_size=4),
        max_epochs=3,
        work_dir=str(work_dir),
        checkpoint_period=0,
        warmup_t=5,
        warmup_init_lr=0.005,
    )


def named_optimizer_state(trainer):
    names = [name for name, _ in trainer.model.named_parameters()]
    state = trainer.optimizer.state_dict()["state"]
    return {names[i]: s["momentum_buffer"] for i, s in state.items()}


@pytest.mark.slow
def test_two_ranks_checkpoint_resumes_exactly_in_one_unsharded_process(tmp_path, runs, caplog):
    trainer = plain_trainer(tmp_path)
    trainer.load_checkpoint(str(runs / "sharded" / "checkpoints" / "iter_12.pth"))
    full = load(runs / "full" / "checkpoints" / "iter_12.pth")  # the same state, in one file
    assert_bit_equal(trainer.model.state_dict(), full["model"])
    assert_bit_equal(
        named_optimizer_state(trainer),
        {name: s["momentum_buffer"] for name, s in full["optimizer"]["state"].items()},
    )
    assert trainer.lr == full["optimizer"]["param_groups"][0]["lr"]
    assert trainer.lr_scheduler.state_dict() == full["lr_scheduler"]
    # 2 processes x 4 samples: epoch 2 (of 5 iterations) stopped after 2 = 16 samples
    assert trainer.progress.position == (2, 4) and trainer.start_iter == 24
    assert "with 2 processes x batches of 4 to 1 x 4" in caplog.text


@pytest.mark.slow
def test_weights_alone_load_into_a_plain_model_and_into_one_file(tmp_path, runs):
    folder = runs / "sharded" / "checkpoints" / "epoch_3.pth"
    final = {k.removeprefix("net."): v for k, v in load(runs / "sharded.pth").items()}
    assert_bit_equal(read_weights(str(folder)), {f"net.{k}": v for k, v in final.items()})
    trainer = plain_trainer(tmp_path)
    trainer.load_checkpoint(str(folder), resume=False)
    assert_bit_equal(trainer.model.net.state_dict(), final)
    assert trainer.cur_iter == -1  # the weights alone
    # what docs/checkpoints.md gives for inference
    command = [
        sys.executable,
        "-m",
        "trainer.sharded_checkpoint",
        str(folder),
        str(tmp_path / "w.pth"),
    ]
    proc = subprocess.run(command, env=cpu_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    plain = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    plain.load_state_dict({k.removeprefix("net."): v for k, v in load(tmp_path / "w.pth").items()})
    assert_bit_equal(plain.state_dict(), final)
    # asked to write into the checkpoint, it exits 1 with one line, the checkpoint as it was
    copy = tmp_path / "copy.pth"
    shutil.copytree(folder, copy)
    before = hashes(copy)
    command[-2:] = [str(copy), str(copy / STATE_FILE)]
    proc = subprocess.run(command, env=cpu_env(), capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"OUT {copy / STATE_FILE} is CHECKPOINT_FOLDER {copy} or in")
    assert proc.stderr.count("\n") == 1 and hashes(copy) == before


# The export command, on checkpoints saved in this process


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """plain_trainer's checkpoints saved in this process, a sharded one (epoch_3.pth) and a
    full file (full.pth), with the weights they hold."""
    work = tmp_path_factory.mktemp("saved")
    trainer = plain_trainer(work)
    for name, sharded in (("epoch_3.pth", True), ("full.pth", False)):
        trainer.checkpointer.sharded = sharded
        trainer.save_checkpoint(name)
        trainer.checkpointer.wait()
    return work / "checkpoints", trainer.model.state_dict()


@pytest.fixture
def exporting(tmp_path, saved, monkeypatch):
    """A copy of the saved checkpoints in ``tmp_path/checkpoints``, with links to them, and
    ``tmp_path`` the current directory; the sharded checkpoint's path."""
    shutil.copytree(saved[0], tmp_path / "checkpoints")
    monkeypatch.chdir(tmp_path)
    os.symlink("checkpoints/epoch_3.pth", "linked")  # the folder by another name
    os.symlink("checkpoints", "parent")  # the folder it is in
    os.symlink(f"checkpoints/epoch_3.pth/{STATE_FILE}", "state.pth")  # a file of the folder
    return tmp_path / "checkpoints" / "epoch_3.pth"


def hashes(root):
    """What is under ``root``: each file's SHA-256, each link's target, each folder, by path."""
    found = {}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                found[path] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                found[path] = ("folder",)
            else:
                with open(path, "rb") as f:
                    found[path] = ("file", hashlib.sha256(f.read()).hexdigest())
    return found


INSIDE = [  # (CHECKPOINT_FOLDER, OUT): OUT is the folder or inside it, however spelled
    ("checkpoints/epoch_3.pth", f"checkpoints/epoch_3.pth/{STATE_FILE}"),
    ("checkpoints/epoch_3.pth", "checkpoints/epoch_3.pth/.metadata"),
    ("checkpoints/epoch_3.pth", "checkpoints/epoch_3.pth/model.pth"),  # a new file
    ("checkpoints/epoch_3.pth", "checkpoints/../checkpoints/./epoch_3.pth/.metadata"),
    ("checkpoints/epoch_3.pth", "{cwd}/checkpoints/epoch_3.pth/__0_0.distcp"),
    ("checkpoints/epoch_3.pth", "checkpoints/epoch_3.pth"),  # the folder itself
    ("checkpoints/epoch_3.pth", "checkpoints/epoch_3.pth/"),
    ("checkpoints/epoch_3.pth", "checkpoints//epoch_3.pth/."),
    ("checkpoints/epoch_3.pth", f"linked/{STATE_FILE}"),  # through links
    ("checkpoints/epoch_3.pth", "linked"),
    ("checkpoints/epoch_3.pth", "parent/epoch_3.pth/model.pth"),
    ("checkpoints/epoch_3.pth", "linked/../epoch_3.pth/model.pth"),  # as the kernel resolves it
    ("checkpoints/epoch_3.pth", "state.pth"),
    ("linked/", f"checkpoints/epoch_3.pth/{STATE_FILE}"),  # the folder spelled otherwise
    ("{cwd}/parent/../checkpoints/epoch_3.pth/", "linked/.metadata"),
]


@pytest.mark.parametrize("folder, out", INSIDE)
def test_the_export_refuses_to_write_into_the_checkpoint_and_leaves_it_byte_identical(
    exporting, folder, out
):
    folder, out = (arg.format(cwd=os.getcwd()) for arg in (folder, out))
    before = hashes(os.getcwd())  # the checkpoints, the links, the current directory
    with pytest.raises(SystemExit) as refused:
        sharded_main([folder, out])
    said = refused.value.code  # a message: exit status 1
    inside = f"OUT {out} is CHECKPOINT_FOLDER {folder} or inside it (as "
    assert said.startswith(inside + os.path.realpath(exporting)), said
    assert said.endswith("write elsewhere.") and "\n" not in said
    assert hashes(os.getcwd()) == before


@pytest.mark.parametrize(
    "out, message",
    [
        ("-", "OUT is '-': give a file to write (not stdout)"),
        ("", "OUT is '': give a file to write (not stdout)"),
        ("checkpoints", "OUT checkpoints exists: the export writes a new file"),
        ("checkpoints/latest.txt", "OUT checkpoints/latest.txt exists: the export writes a new"),
        ("checkpoints/other.pth/w.pth", "OUT checkpoints/other.pth/w.pth is inside the sharded "),
        ("no/such/model.pth", "[Errno 2] No such file or directory: 'no/such/.model.pth.tmp'"),
    ],
)
def test_the_export_refuses_an_output_it_cannot_write(exporting, out, message):
    shutil.copytree(exporting, exporting.parent / "other.pth")  # a sibling checkpoint
    (exporting.parent / "latest.txt").write_text(exporting.name)
    before = hashes(os.getcwd())  # no file named "-" either
    with pytest.raises(SystemExit) as refused:
        sharded_main([str(exporting), out])
    said = refused.value.code
    assert said.startswith(message.format(cwd=os.getcwd())) and "\n" not in said, said
    assert hashes(os.getcwd()) == before


def test_the_export_writes_the_weights_and_the_checkpoint_still_resumes(exporting, saved):
    before = hashes(exporting)
    said = sharded_main([str(exporting), "model.pth"])
    assert said == f"Wrote the model weights of {exporting} to model.pth."
    assert_bit_equal(torch.load("model.pth", weights_only=True), saved[1])
    os.link(exporting / STATE_FILE, "same_file.pth")  # one file, two names
    with pytest.raises(SystemExit, match="OUT same_file.pth exists: the export writes a new"):
        sharded_main([str(exporting), "same_file.pth"])
    assert hashes(exporting) == before
    resumed = plain_trainer("resumed")
    resumed.load_checkpoint(str(exporting))
    assert_bit_equal(resumed.model.state_dict(), saved[1])


def test_a_shard_replaced_while_it_loads_never_loads_damaged_weights(exporting, saved, monkeypatch):
    """A damaged copy of a shard renamed over it as DCP begins to read: the checksums and DCP
    read the files opened before, never a mix."""
    shard = exporting / "__0_0.distcp"
    data = shard.read_bytes()
    damaged = data[: len(data) // 2] + bytes(b ^ 0xFF for b in data[len(data) // 2 :])
    real_load = torch.load
    for resume in (True, False):

        def swapped_mid_load(f, *args, **kwargs):
            copy = exporting / "copy"
            copy.write_bytes(damaged)
            os.replace(copy, shard)  # a sync tool's cp, then mv
            return real_load(f, *args, **kwargs)

        shard.write_bytes(data)
        monkeypatch.setattr(torch, "load", swapped_mid_load)
        trainer = plain_trainer("loaded")
        trainer.load_checkpoint(str(exporting), resume=resume)
        monkeypatch.setattr(torch, "load", real_load)
        assert_bit_equal(trainer.model.state_dict(), saved[1])
        with pytest.raises(RuntimeError, match=r"the bytes of __0_0\.distcp changed"):
            plain_trainer("again").load_checkpoint(str(exporting), resume=resume)


def test_the_export_command_says_what_is_wrong(exporting, capsys):
    with pytest.raises(SystemExit) as e:
        sharded_main(["--help"])
    assert e.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps its lines
    usage = "usage: python -m trainer.sharded_checkpoint [-h] CHECKPOINT_FOLDER OUT"
    assert shown.startswith(usage)
    assert "and '-' (the file is binary: it is not written to stdout)" in shown
    with pytest.raises(SystemExit) as e:
        sharded_main([])
    assert e.value.code == 2
    assert "the following arguments are required: CHECKPOINT_FOLDER, OUT" in capsys.readouterr().err
    for args, message in [
        (["nope", "x.pth"], "CHECKPOINT_FOLDER nope is not a sharded checkpoint (a folder with"),
        (["checkpoints/full.pth", "x.pth"], "checkpoints/full.pth is not a sharded checkpoint"),
    ]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            sharded_main(args)


@pytest.mark.slow
def test_a_mismatched_model_is_refused_with_the_keys(tmp_path, runs):
    trainer = plain_trainer(tmp_path)
    trainer.model.net[3] = nn.Linear(16, 2)
    with pytest.raises(RuntimeError, match=r"shapes differ: net\.3\.weight \(1, 16\) vs \(2, 16\)"):
        trainer.load_checkpoint(str(runs / "sharded" / "checkpoints" / "iter_12.pth"))


@pytest.mark.slow
@pytest.mark.parametrize("rank, nth_save", [(0, 19), (1, 34)])
def test_a_rank_killed_while_writing_leaves_the_last_checkpoint_and_reruns_bit_exact(
    tmp_path, runs, rank, nth_save
):
    # each rank torch.save-s every shard: rank 0 writes 13 a checkpoint, rank 1 23 (DCP
    # leaves the replicated entries to it): this kills one of them in the second checkpoint
    work, out = tmp_path / "work", tmp_path / "out.pth"
    code, _ = torchrun(work, out, SHARD=1, CLIP=0.05, KILL_IN_SAVE=nth_save, KILL_RANK=rank)
    assert code != 0 and not out.exists()
    ckpt_dir = work / "checkpoints"
    assert (ckpt_dir / "latest.txt").read_text() == "iter_3.pth"
    assert ".iter_6.pth.tmp" in os.listdir(ckpt_dir) and "iter_6.pth" not in os.listdir(ckpt_dir)
    code, err = torchrun(work, out, SHARD=1, CLIP=0.05)
    assert code == 0, failure_output(err)
    assert "Resumed from checkpoint" in err and "after iteration 3" in err
    assert "left by an interrupted checkpoint write" in err  # the partial folder
    assert_bit_equal(load(out), load(runs / "sharded.pth"))
    assert not [name for name in os.listdir(ckpt_dir) if name.endswith(".tmp")]


@pytest.mark.slow
def test_a_checkpoint_moved_aside_to_be_replaced_is_put_back_after_a_crash(tmp_path, runs):
    ckpt_dir = tmp_path / "work" / "checkpoints"
    shutil.copytree(runs / "sharded" / "checkpoints", ckpt_dir)
    # killed between the renames of a save of iter_12.pth again: the old one moved aside
    # (.old), the new one complete beside it, neither under the name latest.txt may give
    os.rename(ckpt_dir / "iter_12.pth", ckpt_dir / ".iter_12.pth.tmp.old")
    shutil.copytree(ckpt_dir / "iter_9.pth", ckpt_dir / ".iter_12.pth.tmp")
    plain_trainer(tmp_path / "work").checkpointer.remove_temp_files()
    assert sorted(os.listdir(ckpt_dir)) == [
        "epoch_3.pth",
        "iter_12.pth",
        "iter_9.pth",
        "latest.txt",
    ]
    saved = runs / "sharded" / "checkpoints" / "iter_12.pth"
    assert_bit_equal(read_weights(str(ckpt_dir / "iter_12.pth")), read_weights(str(saved)))


def test_either_kind_replaces_a_checkpoint_of_the_other_kind_and_name(tmp_path):
    trainer = plain_trainer(tmp_path)  # (sharded checkpoints of an unsharded model too)
    for sharded in (True, False, True):
        trainer.checkpointer.sharded = sharded
        trainer.save_checkpoint("best.pth")
        trainer.checkpointer.wait()
        assert os.path.isdir(tmp_path / "checkpoints" / "best.pth") == sharded
        assert sorted(os.listdir(tmp_path / "checkpoints")) == ["best.pth", "latest.txt"]
        resumed = plain_trainer(tmp_path)
        resumed.load_checkpoint(str(tmp_path / "checkpoints" / "best.pth"))
        assert_bit_equal(resumed.model.state_dict(), trainer.model.state_dict())


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_one_sharded_checkpoint_and_reruns_bit_exact(tmp_path, runs):
    work, out = tmp_path / "work", tmp_path / "out.pth"
    proc = start_torchrun(
        work,
        out,
        SHARD=1,
        CLIP=0.05,
        SLOW=0.2,
        CKPT_PERIOD=1000,
        LOG_PERIOD=1000,
        PREEMPT_CHECK=2,
        PID_DIR=tmp_path,
    )
    wait_for_training(work, proc)
    time.sleep(0.3)
    os.kill(int((tmp_path / "pid_1").read_text()), signal.SIGTERM)
    _, err = communicate(proc, timeout=90)
    assert proc.returncode != 0 and not out.exists()
    stop = re.search(r"Preempted by SIGTERM after iteration (\d+)", (work / "log.txt").read_text())
    assert stop, failure_output(err)
    n = int(stop.group(1))
    assert sorted(os.listdir(work / "checkpoints")) == [f"iter_{n}.pth", "latest.txt"]
    assert STATE_FILE in os.listdir(work / "checkpoints" / f"iter_{n}.pth")  # whole, waited for
    code, err = torchrun(work, out, SHARD=1, CLIP=0.05)
    assert code == 0, failure_output(err)
    assert f"after iteration {n}." in err  # "Resumed from checkpoint ... after iteration n."
    assert_bit_equal(load(out), load(runs / "sharded.pth"))
    # the preemption's folder counts among the newest 3 the rerun keeps: no pile-up
    assert len([name for name in os.listdir(work / "checkpoints") if name != "latest.txt"]) == 3


@pytest.mark.slow
def test_killed_after_the_rename_before_the_pointer_resumes_as_latest_txt_says(tmp_path, runs):
    work, out = tmp_path / "work", tmp_path / "out.pth"
    code, _ = torchrun(work, out, SHARD=1, CLIP=0.05, KILL_BEFORE_POINTER=2, KILL_RANK=0)
    assert code != 0
    assert (work / "checkpoints" / "latest.txt").read_text() == "iter_3.pth"
    code, err = torchrun(work, out, SHARD=1, CLIP=0.05)
    assert code == 0, failure_output(err)
    assert "Resumed from checkpoint" in err and "after iteration 3" in err  # latest.txt's
    assert_bit_equal(load(out), load(runs / "sharded.pth"))


@pytest.mark.slow
def test_two_ranks_killed_resume_on_one_process_and_one_rank_on_two(tmp_path):
    work = tmp_path / "two"
    code, _ = torchrun(work, tmp_path / "x", SHARD=1, KILL_AT_ITER=7, KILL_WHEN_SAVED=1)
    assert code != 0
    code, err = run(work, tmp_path / "one.pth")  # one process, the model not sharded
    assert code == 0, failure_output(err)
    assert "Resumed from checkpoint" in err and "with 2 processes x batches of 4 to 1 x 4" in err
    work = tmp_path / "one"
    one_rank = ("--nproc_per_node", "1")
    code, _ = torchrun(
        work, tmp_path / "x", args=one_rank, SHARD=1, KILL_AT_ITER=7, KILL_WHEN_SAVED=1
    )
    assert code != 0 and os.path.isdir(work / "checkpoints" / "iter_6.pth")
    shutil.copytree(work / "checkpoints" / "iter_6.pth", tmp_path / "saved_by_one")
    dump = tmp_path / "resumed.pth"
    code, err = torchrun(work, tmp_path / "two.pth", SHARD=1, DUMP_RESUMED=dump)
    assert code == 0, failure_output(err)
    assert "Resumed from checkpoint" in err and "with 1 processes x batches of 4 to 2 x 4" in err
    # the two ranks resumed with the model and optimizer state that one process saved
    saved = plain_trainer(tmp_path / "plain")
    saved.load_checkpoint(str(tmp_path / "saved_by_one"))
    model, optimizer = load(dump)
    assert_bit_equal(model, saved.model.state_dict())
    momentum = {name: s["momentum_buffer"] for name, s in optimizer["state"].items()}
    assert_bit_equal(momentum, named_optimizer_state(saved))


class RunsCode:
    """Unpickling it touches a file: what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def craft(folder, part, marker):
    """Put code in ``part`` of a sharded checkpoint: its metadata, one of DCP's byte entries,
    or rank 0's trainer.pth."""
    if part == "metadata":
        with open(folder / ".metadata", "wb") as f:
            pickle.dump(RunsCode(marker), f)
    elif part == "entry":  # the optimizer's LR, re-pointed at a torch.save of code
        with open(folder / ".metadata", "rb") as f:
            metadata = pickle.load(f)  # (the test trusts its own file)
        index = next(i for i in metadata.storage_data if i.fqn == "optimizer.param_groups.0.lr")
        info = metadata.storage_data[index]
        path = folder / info.relative_path
        offset = path.stat().st_size
        with open(path, "ab") as f:
            torch.save(RunsCode(marker), f)
        info.offset, info.length = offset, path.stat().st_size - offset
        with open(folder / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
    elif part == "a path outside":  # an entry read from outside the folder
        with open(folder / ".metadata", "rb") as f:
            metadata = pickle.load(f)
        next(iter(metadata.storage_data.values())).relative_path = "../../x.distcp"
        with open(folder / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
    elif part == "damaged metadata":  # an unknown pickle protocol
        data = bytearray((folder / ".metadata").read_bytes())
        data[1] = 9
        (folder / ".metadata").write_bytes(bytes(data))
    else:
        state = load(folder / STATE_FILE)
        state["config"]["amp"] = RunsCode(marker)
        save_checkpoint_file(state, folder / STATE_FILE)
    reseal(folder)  # as whoever crafts it can: what gets past the checksums is still refused


def reseal(folder):
    """Write the checksums of a sharded checkpoint's folder anew, for the files it holds now."""
    names = [name for name in os.listdir(folder) if name not in (MANIFEST, STATE_FILE)]
    sums = {
        name: [len(data), zlib.crc32(data)]
        for name in names
        for data in [(folder / name).read_bytes()]
    }
    (folder / MANIFEST).write_text(json.dumps(sums))


@pytest.mark.parametrize(
    "part", ["metadata", "entry", "trainer.pth", "a path outside", "damaged metadata"]
)
@pytest.mark.slow
def test_a_sharded_checkpoint_carrying_code_is_skipped_and_never_runs(tmp_path, runs, part, caplog):
    work = tmp_path / "work"
    shutil.copytree(runs / "sharded", work)
    marker = tmp_path / "code_ran"
    craft(latest(work), part, marker)
    trainer = plain_trainer(work)
    with pytest.raises(RuntimeError, match="could not be loaded safely"):
        trainer.load_checkpoint(str(latest(work)))
    # auto-resume skips it, with a warning, for the newest checkpoint that loads
    assert trainer.load_checkpoint(auto_resume=True)
    assert "Skipping a checkpoint that does not load" in caplog.text
    assert trainer.checkpointer.last_path.endswith("iter_12.pth")
    assert not marker.exists()


def flip(path, at):
    data = path.read_bytes()
    path.write_bytes(data[:at] + bytes(b ^ 0xFF for b in data[at : at + 100]) + data[at + 100 :])


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage, reason",
    [
        ("flipped", r"the bytes of __1_0\.distcp changed"),
        ("link to an older shard", r"__1_0\.distcp is a link"),
        ("link outside", r"__1_0\.distcp is a link"),
        ("no checksums", r"it has no checksums\.json"),
        ("cut short", r"__1_0\.distcp has 100 bytes, not \d+"),
        ("extra file", r"x\.distcp is not in its checksums\.json"),
    ],
)
def test_a_damaged_sharded_checkpoint_is_refused_and_auto_resume_falls_back(
    tmp_path, runs, caplog, damage, reason
):
    work = tmp_path / "work"
    shutil.copytree(runs / "sharded", work)
    newest, older = latest(work), work / "checkpoints" / "iter_12.pth"
    shard = newest / "__1_0.distcp"
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(b"")  # opening it would read nothing: an EOFError, before
    if damage == "flipped":
        flip(shard, shard.stat().st_size // 2)
    elif damage.startswith("link"):
        shard.unlink()
        shard.symlink_to(older / "__1_0.distcp" if damage == "link to an older shard" else outside)
    elif damage == "no checksums":
        (newest / MANIFEST).unlink()
    elif damage == "cut short":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        (newest / "x.distcp").write_bytes(b"x")
    trainer = plain_trainer(tmp_path / "other")
    with pytest.raises(RuntimeError, match=rf"epoch_3\.pth' is damaged: {reason}"):
        trainer.load_checkpoint(str(newest))
    if damage == "no checksums":  # written before checksums: its weights still load
        trainer.load_checkpoint(str(newest), resume=False)
        sharded_main([str(newest), str(tmp_path / "w.pth")])
        final = {k.removeprefix("net."): v for k, v in load(runs / "sharded.pth").items()}
        assert_bit_equal(trainer.model.net.state_dict(), final)
    else:
        with pytest.raises(RuntimeError, match=rf"epoch_3\.pth' is damaged: {reason}"):
            trainer.load_checkpoint(str(newest), resume=False)  # nor as weights
        with pytest.raises(SystemExit, match=rf"epoch_3\.pth' is damaged: {reason}"):
            sharded_main([str(newest), str(tmp_path / "w.pth")])
    trainer = plain_trainer(work)
    assert trainer.load_checkpoint(auto_resume=True)  # the newest that loads
    assert "Skipping a checkpoint that does not load" in caplog.text
    assert trainer.checkpointer.last_path.endswith("iter_12.pth")
    full = load(runs / "full" / "checkpoints" / "iter_12.pth")
    assert_bit_equal(trainer.model.state_dict(), full["model"])


def test_a_manifest_too_large_for_its_folder_is_refused_unparsed(tmp_path):
    trainer = plain_trainer(tmp_path)
    trainer.checkpointer.sharded = True
    trainer.save_checkpoint("epoch_1.pth")
    trainer.checkpointer.wait()
    folder = tmp_path / "checkpoints" / "epoch_1.pth"
    manifest = folder / MANIFEST
    manifest.write_text(manifest.read_text() + " " * (1 << 20))  # still valid JSON
    with pytest.raises(RuntimeError, match=rf"epoch_1\.pth' is damaged: its {MANIFEST} has \d+"):
        plain_trainer(tmp_path).load_checkpoint(str(folder))
    with pytest.raises(RuntimeError, match=rf"its {MANIFEST} has \d+ bytes, more than"):
        read_weights(str(folder))


# The scripts below run on 2 gloo ranks (run_script), between these two parts.
PREAMBLE = """
import errno, os, sys, threading, time
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import fully_shard
from trainer import HookBase, Trainer
from trainer.distributed import init_distributed
from trainer.hooks import EMAHook
from trainer.sharded_checkpoint import read_weights

rank, world_size = init_distributed()
torch.manual_seed(0)
"""
ENDING = """
torch.distributed.barrier()
torch.distributed.destroy_process_group()
os._exit(0)
"""


def run_script(tmp_path, body, *args):
    """``body`` between PREAMBLE and ENDING, run by 2 gloo ranks with ``args``; what they
    printed."""
    script = tmp_path / "script.py"
    script.write_text(PREAMBLE + body + ENDING)
    proc = popen(
        torchrun_command("--nproc_per_node", "2", str(script), *map(str, args)),
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = communicate(proc, timeout=90)
    assert proc.returncode == 0, failure_output(err)
    return out


ASYNC_SCRIPT = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = fully_shard(nn.Linear(4, 4))
    def forward(self, batch):
        return self.inner(batch).square().mean()
model = Model()
trainer = Trainer(model, torch.optim.AdamW(model.parameters()), None, [torch.randn(2, 4)] * 2,
                  max_epochs=1, work_dir=sys.argv[1])
ckpt_dir = trainer.ckpt_dir
held, released = threading.Event(), []
real_save = torch.save
def save(*args, **kwargs):
    if threading.current_thread() is not threading.main_thread():
        held.wait()  # the writes wait until a release() lets them go
    return real_save(*args, **kwargs)
torch.save = save
def release():
    time.sleep(0.5)
    released.append(True)
    held.set()
before = {}
class Probe(HookBase):
    def after_iter(self):
        if self.trainer.cur_iter != 0:
            return
        trainer.save_checkpoint("a.pth")  # returns once staged: its write is held
        there = os.path.isdir(os.path.join(ckpt_dir, "a.pth"))
        print(f"{rank} save returned, a.pth there {there}", flush=True)
        before.update((k, v.full_tensor()) for k, v in model.state_dict().items())
        with torch.no_grad():  # after the staging: a.pth keeps the weights before this
            for p in model.parameters():
                p.add_(100.0)
        threading.Thread(target=release).start()
        trainer.save_checkpoint("b.pth")  # waits for a.pth's write first
        print(f"{rank} second save returned after release {bool(released)}", flush=True)
        trainer.checkpointer.wait()
        held.clear()  # the last save's write is held again
        released.clear()
        threading.Thread(target=release).start()
trainer.register_hook(Probe())
trainer.train()  # saves epoch_1.pth at its end, and waits for the write
print(f"{rank} train() returned after release {bool(released)}", flush=True)
written = sorted(name for name in os.listdir(ckpt_dir) if name.endswith(".pth"))
print(f"{rank} written {written}", flush=True)
saved = read_weights(os.path.join(ckpt_dir, "a.pth"))
same = all(torch.equal(saved[k], v) for k, v in before.items())
print(f"{rank} a.pth holds the weights before the change {same}", flush=True)
"""


@pytest.mark.slow
def test_a_save_blocks_only_while_staging_and_the_next_save_and_train_end_wait(tmp_path):
    out = run_script(tmp_path, ASYNC_SCRIPT, tmp_path / "work")
    for rank in (0, 1):  # on every rank, wait() returns once the checkpoint is in place
        assert f"{rank} save returned, a.pth there False" in out
        assert f"{rank} second save returned after release True" in out
        assert f"{rank} train() returned after release True" in out
        assert f"{rank} written ['a.pth', 'b.pth', 'epoch_1.pth']" in out
        assert f"{rank} a.pth holds the weights before the change True" in out


EMA_SCRIPT = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
    def forward(self, batch):
        return self.linear(batch).square().mean()
model = fully_shard(Model())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = Trainer(model, optimizer, None, [torch.randn(2, 4)] * 2, max_epochs=1,
                  work_dir=sys.argv[1])
trainer.checkpointer.sharded = sys.argv[2] == "sharded"
trainer.register_hook(EMAHook(0.9))  # its average: DTensors, each rank's shard
try:
    trainer.train()
except ValueError as e:
    print(f"{rank} refused: {e}", flush=True)  # one write: the ranks share stdout
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_shards_in_a_hooks_state_are_refused_not_saved_as_rank_0s(tmp_path, kind):
    out = run_script(tmp_path, EMA_SCRIPT, tmp_path / "work", kind)
    for rank in (0, 1):
        assert f"{rank} refused: hooks.EMAHook holds DTensors: keep their full_tensor()" in out
    assert os.listdir(tmp_path / "work" / "checkpoints") == []


SCENARIO_SCRIPT = """
work_dir, scenario, kind, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)  # no gradient, so no optimizer state
        self.norm = nn.BatchNorm1d(4)  # its running statistics: each rank's own
    def forward(self, batch):
        return self.norm(self.linear(batch)).square().mean()
model = fully_shard(Model())
momentum = 0.0 if scenario == "plain sgd" else 0.9
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
data = [torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))] * 2
trainer = Trainer(model, optimizer, None, data, max_epochs=epochs, work_dir=work_dir,
                  preempt_check_period=1)
trainer.checkpointer.sharded = kind == "sharded"
class FullDisk(dcp.FileSystemWriter):  # rank 1 cannot write the second checkpoint's shards
    def write_data(self, plan, planner):
        if scenario == "disk full" and rank == 1 and ".epoch_2." in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write_data(plan, planner)
dcp.FileSystemWriter = FullDisk
class WaitOnRank0(HookBase):  # waiting is this rank's own business: the next save still works
    def after_iter(self):
        if self.trainer.cur_iter == 0:
            self.trainer.save_checkpoint("a.pth")
            if rank == 0:
                self.trainer.checkpointer.wait()
            self.trainer.save_checkpoint("b.pth")
if scenario == "wait on rank 0":
    trainer.register_hook(WaitOnRank0())
try:
    trainer.train()
    files = sorted(os.listdir(trainer.ckpt_dir))
    print(f"{rank} trained from {trainer.start_iter} to {trainer.cur_iter + 1}: {files}",
          flush=True)
    unused = [p in optimizer.state for p in model.unused.parameters()]
    print(f"{rank} unused parameters with optimizer state: {sum(unused)}", flush=True)
except Exception as e:
    print(f"{rank} failed: {type(e).__name__}: {e}", flush=True)
"""


def scenario(tmp_path, name, kind, epochs):
    return run_script(tmp_path, SCENARIO_SCRIPT, tmp_path / "work", name, kind, epochs)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sharded", "full"])
@pytest.mark.parametrize("name", ["unused parameter", "plain sgd"])
def test_state_missing_for_some_parameters_or_all_resumes(tmp_path, name, kind):
    # a parameter without a gradient has no optimizer state; plain SGD keeps none at all
    out = scenario(tmp_path, name, kind, epochs=1)
    assert "0 trained from 0 to 2" in out
    out = scenario(tmp_path, name, kind, epochs=2)
    for rank in (0, 1):
        assert f"{rank} trained from 2 to 4" in out, out
        # none made up on loading (torch's helper steps once to make every state)
        assert f"{rank} unused parameters with optimizer state: 0" in out


@pytest.mark.slow
def test_buffers_that_differ_by_rank_are_named_in_a_warning(tmp_path):
    scenario(tmp_path, "batchnorm", "sharded", epochs=1)
    log = (tmp_path / "work" / "log.txt").read_text()
    assert log.count("The model's buffers norm.running_mean, norm.running_var differ by") == 1


@pytest.mark.slow
def test_after_a_crash_every_rank_resumes_the_checkpoint_put_back(tmp_path):
    # killed between the renames of a save of epoch_1.pth again, its only checkpoint: rank 0
    # puts it back before any rank lists the checkpoints
    scenario(tmp_path, "put back", "sharded", epochs=1)
    ckpt_dir = tmp_path / "work" / "checkpoints"
    os.rename(ckpt_dir / "epoch_1.pth", ckpt_dir / ".epoch_1.pth.tmp.old")
    shutil.copytree(ckpt_dir / ".epoch_1.pth.tmp.old", ckpt_dir / ".epoch_1.pth.tmp")
    out = scenario(tmp_path, "put back", "sharded", epochs=2)
    for rank in (0, 1):
        assert f"{rank} trained from 2 to 4" in out, out


@pytest.mark.slow
def test_damage_that_one_rank_finds_makes_every_rank_fall_back(tmp_path):
    scenario(tmp_path, "unused parameter", "sharded", epochs=2)
    newest = tmp_path / "work" / "checkpoints" / "epoch_2.pth"
    flip(newest / "__1_0.distcp", 0)  # rank 1 checks this shard's bytes, rank 0 the other's
    out = scenario(tmp_path, "unused parameter", "sharded", epochs=3)
    for rank in (0, 1):
        assert f"{rank} trained from 2 to 6" in out, out  # from epoch_1.pth, both
    log = (tmp_path / "work" / "log.txt").read_text()
    assert "Rank 1: Checkpoint" in log and "the bytes of __1_0.distcp changed" in log, log


@pytest.mark.slow
def test_a_rank_that_cannot_write_stops_every_rank_with_the_os_error(tmp_path):
    out = scenario(tmp_path, "disk full", "sharded", epochs=4)
    for rank in (0, 1):
        assert f"{rank} failed: OSError: [Errno 28] Could not write " in out, out
        assert "No space left on device. The previous checkpoint and latest.txt are" in out
    ckpt_dir = tmp_path / "work" / "checkpoints"
    assert (ckpt_dir / "latest.txt").read_text() == "epoch_1.pth"
    assert "Training failed" in (tmp_path / "work" / "log_rank1.txt").read_text()


@pytest.mark.slow
def test_waiting_on_one_rank_leaves_the_next_save_to_every_rank(tmp_path):
    out = scenario(tmp_path, "wait on rank 0", "sharded", epochs=1)
    for rank in (0, 1):
        assert f"{rank} trained from 0 to 2: ['a.pth', 'b.pth', 'epoch_1.pth', 'latest.txt']" in out
