"""BestCheckpointHook: best.pth at each new best, remembered across resume."""

import glob
import itertools
import logging
import os
import re
import time

import pytest
import torch

from trainer import HookBase, checkpoint
from trainer.hooks import BestCheckpointHook, CheckpointHook, EvalHook, best_checkpoint_hook

from conftest import evaluating, load


@pytest.mark.slow  # three runs in one work dir: ~2.7 s
def test_best_checkpoint_keeps_the_best_epoch_across_resume(make_trainer):
    values = [0.5, 0.7, 0.6, 0.65, 0.69, 0.71]
    trainer = evaluating(make_trainer(max_epochs=4), values, BestCheckpointHook("acc"))
    trainer.train()
    ckpt = trainer.ckpt_dir
    best = load(os.path.join(ckpt, "best.pth"))
    assert best["progress"]["epoch"] == 2 and best["hooks"]["BestCheckpointHook"]["best"] == 0.7
    assert all(
        torch.equal(v, load(os.path.join(ckpt, "epoch_2.pth"))["model"][k])
        for k, v in best["model"].items()
    )
    # resumed, 0.69 does not beat the 0.7 it remembers; 0.71 does
    resumed = evaluating(make_trainer(max_epochs=5), values, BestCheckpointHook("acc"))
    resumed.train()
    assert load(os.path.join(ckpt, "best.pth"))["progress"]["epoch"] == 2
    evaluating(make_trainer(max_epochs=6), values, BestCheckpointHook("acc")).train()
    assert load(os.path.join(ckpt, "best.pth"))["progress"]["epoch"] == 6


def test_best_checkpoint_in_iteration_based_training_resumes_exactly(make_trainer, tmp_path):
    # evaluated every 3 iterations; best.pth is saved after the LR update and resumes exactly
    def build(work_dir, max_iters):
        t = make_trainer(max_iters=max_iters, work_dir=work_dir, by_epoch=False)
        t.register_hook(EvalHook(3, lambda: {"loss_seen": float(t.cur_iter)}))
        t.register_hook(BestCheckpointHook("loss_seen", mode="min"))
        return t

    first = build(tmp_path / "a", 12)
    first.train()
    best = load(os.path.join(first.ckpt_dir, "best.pth"))
    assert best["progress"]["inner_iter"] == 3  # the first evaluation was the best (2)
    resumed = build(tmp_path / "b", 12)
    resumed.train(resume_from_checkpoint=os.path.join(first.ckpt_dir, "best.pth"))
    for a, b in zip(resumed.model.parameters(), first.model.parameters()):
        assert torch.equal(a, b)


def test_every_save_is_named_once_and_a_new_best_names_its_file(make_trainer, caplog):
    trainer = evaluating(make_trainer(max_epochs=3), [0.5, 0.7, 0.6], BestCheckpointHook("acc"))
    trainer.train()
    messages = [r.getMessage() for r in caplog.records]
    saves = [
        m.split(" (")[0].removeprefix("Writing checkpoint ")
        for m in messages
        if m.startswith("Writing checkpoint")
    ]
    names = ["epoch_1.pth", "best.pth", "epoch_2.pth", "best.pth", "epoch_3.pth"]
    assert saves == [os.path.join(trainer.ckpt_dir, name) for name in names]
    on_disk = [
        m.split(" (")[0].removeprefix("Saved checkpoint ")
        for m in messages
        if m.startswith("Saved checkpoint")
    ]
    assert on_disk == saves  # one write at a time, each done before the next starts
    assert "New best acc: 0.5: saving best.pth." in messages
    assert "New best acc: 0.7 (was 0.5): saving best.pth." in messages
    log = open(trainer.log_file).read()
    assert log.count("Writing checkpoint") == 5 and log.count(" (on disk).") == 5


def test_the_summary_names_a_best_checkpoint_still_being_written(make_trainer, caplog, monkeypatch):
    """The first best, found at the last evaluation, is the last save, written in the
    background while the summary is logged: the summary left out its 'best checkpoint' row."""
    real = torch.save

    def slow(obj, f, *args, **kwargs):
        time.sleep(0.3 if f.name.endswith(".best.pth.tmp") else 0)
        real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", slow)
    trainer = evaluating(make_trainer(max_epochs=1), [0.7], BestCheckpointHook("acc"))
    trainer.train()
    best = os.path.join(trainer.ckpt_dir, "best.pth")
    assert re.search(rf"\nbest checkpoint +{re.escape(best)}\n", caplog.text)


def test_a_nan_is_never_a_new_best_nor_infinity_after_infinity(make_trainer, caplog):
    nan, inf = float("nan"), float("inf")
    trainer = make_trainer(max_epochs=5)
    evaluating(trainer, [nan, 0.5, nan, inf, inf], BestCheckpointHook("acc")).train()
    news = [r.getMessage() for r in caplog.records if r.getMessage().startswith("New best")]
    assert news == [
        "New best acc: 0.5: saving best.pth.",
        "New best acc: inf (was 0.5): saving best.pth.",
    ]
    assert load(os.path.join(trainer.ckpt_dir, "best.pth"))["progress"]["epoch"] == 4


@pytest.mark.parametrize(
    "name",
    [
        "latest.txt",  # the summary called the pointer the best checkpoint
        "epoch_1.pth",  # it held iteration 16, the epoch-1 checkpoint gone
        "epoch_3.pth",  # the final save overwrote the best
        "iter_8.pth",
        ".best.pth.tmp",  # deleted at the next start
        "best.pth.tmp.old",
        "epoch_2.pth/trainer.pth",  # in a sharded checkpoint's folder
        "best/latest.txt",  # a save in best/ points best/latest.txt at itself
        "previous/best.pth",  # where a fresh start moves the earlier run's checkpoints
    ],
)
def test_a_name_the_trainer_writes_itself_is_refused(name):
    with pytest.raises(ValueError, match=f"^file_name={re.escape(repr(name))} is a name the tr"):
        BestCheckpointHook("acc", file_name=name)


@pytest.mark.parametrize(
    "name", ["best.pth", "epoch_best.pth", "best_iter_8.pth", "iter_8.pt", "best/acc.pth"]
)
def test_other_names_hold_the_best_checkpoint(make_trainer, name):
    """In a sub-folder too: its save failed, blaming the disk, as the folder did not exist."""
    values = [0.5, 0.9, 0.7]
    trainer = make_trainer(max_epochs=3)
    evaluating(trainer, values, BestCheckpointHook("acc", file_name=name)).train()
    assert load(os.path.join(trainer.ckpt_dir, name))["progress"]["epoch"] == 2
    assert load(os.path.join(trainer.ckpt_dir, "epoch_3.pth"))["progress"]["epoch"] == 3


# top_k: the k best, each in its own file

ACCS = [0.5, 0.7, 0.6, 0.65, 0.69, 0.71]  # after epochs 1 to 6, of 8 iterations each


def kept_files(trainer):
    """The kept best checkpoints' names and values, and each file's iterations done."""
    (hook,) = [h for h in trainer.hooks if isinstance(h, BestCheckpointHook)]
    kept = {os.path.basename(path): value for path, value in hook.best_checkpoints.items()}
    done = {
        name: load(os.path.join(trainer.ckpt_dir, name))["progress"]["epoch"] * 8 for name in kept
    }
    return kept, done


def test_top_k_keeps_the_k_best_each_in_a_file_named_by_iteration_and_value(make_trainer):
    trainer = evaluating(make_trainer(max_epochs=6), ACCS, BestCheckpointHook("acc", top_k=3))
    trainer.train()
    kept, done = kept_files(trainer)
    assert list(kept.items()) == [  # best first
        ("best-iter=48-acc=0.71.pth", 0.71),
        ("best-iter=16-acc=0.7.pth", 0.7),
        ("best-iter=40-acc=0.69.pth", 0.69),
    ]
    assert list(done.values()) == [48, 16, 40]
    best_files = sorted(n for n in os.listdir(trainer.ckpt_dir) if n.startswith("best"))
    assert best_files == sorted(kept)  # 0.5, 0.6 and 0.65 were pushed out and deleted
    assert trainer.hooks[-2].best_checkpoint == os.path.join(trainer.ckpt_dir, next(iter(kept)))
    # the last checkpoint lists them, and the one it pushed out (deleted once it was on disk)
    last = load(trainer.checkpointer.last_path)["hooks"]["BestCheckpointHook"]
    assert last["kept"] == [[name, value] for name, value in kept.items()] + [
        ["best-iter=32-acc=0.65.pth", 0.65]
    ]


def test_top_k_keeps_the_earlier_of_a_tie_and_never_a_nan(make_trainer):
    values = [0.5, float("nan"), 0.5, 0.5, 0.4]
    trainer = evaluating(make_trainer(max_epochs=5), values, BestCheckpointHook("acc", top_k=2))
    trainer.train()
    kept, _ = kept_files(trainer)
    assert kept == {"best-iter=8-acc=0.5.pth": 0.5, "best-iter=24-acc=0.5.pth": 0.5}


def test_top_k_names_a_metric_with_a_slash_without_a_folder(make_trainer):
    trainer = make_trainer(max_epochs=1)
    trainer.register_hook(EvalHook(1, lambda: {"val/loss": 0.25}))
    trainer.register_hook(BestCheckpointHook("val/loss", top_k=2, file_name="top.pth"))
    trainer.train()
    assert os.path.isfile(os.path.join(trainer.ckpt_dir, "top-iter=8-val_loss=0.25.pth"))


def build_top_3(make_trainer, work_dir, max_epochs, crash_at=None):
    trainer = make_trainer(max_epochs=max_epochs, work_dir=work_dir)
    evaluating(trainer, ACCS, BestCheckpointHook("acc", top_k=3))
    if crash_at is not None:

        class Crash(HookBase):
            def after_iter(self):
                if self.trainer.cur_iter + 1 == crash_at:
                    raise RuntimeError("crash")

        trainer.register_hook(Crash())
    return trainer


def test_top_k_resumes_with_the_same_files_and_values(make_trainer, tmp_path):
    whole = build_top_3(make_trainer, tmp_path / "whole", 6)
    whole.train()
    # a crash in epoch 5: the last checkpoint is the best of epoch 4, which pushed out 0.5
    crashed = build_top_3(make_trainer, tmp_path / "resumed", 6, crash_at=35)
    with pytest.raises(RuntimeError, match="crash"):
        crashed.train()
    resumed = build_top_3(make_trainer, tmp_path / "resumed", 6)
    resumed.train()
    assert resumed.start_iter == 32
    assert kept_files(resumed) == kept_files(whole)
    assert sorted(os.listdir(resumed.ckpt_dir)) == sorted(os.listdir(whole.ckpt_dir))
    for name in kept_files(whole)[0]:
        a = load(os.path.join(whole.ckpt_dir, name))["model"]
        b = load(os.path.join(resumed.ckpt_dir, name))["model"]
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_best_pushed_out_but_not_deleted_is_deleted_on_resume(make_trainer, monkeypatch):
    """A run killed after a new best's write, before the worst's deletion: the checkpoint lists
    both, and the resumed run deletes the worst."""
    monkeypatch.setattr(best_checkpoint_hook, "delete_checkpoints", lambda paths: None)
    first = evaluating(make_trainer(max_epochs=4), ACCS, BestCheckpointHook("acc", top_k=3))
    first.train()
    ckpt_dir = first.ckpt_dir
    assert os.path.exists(os.path.join(ckpt_dir, "best-iter=8-acc=0.5.pth"))  # not deleted
    monkeypatch.undo()
    accs = [*ACCS[:4], 0.1]  # no new best after the resume
    resumed = evaluating(make_trainer(max_epochs=5), accs, BestCheckpointHook("acc", top_k=3))
    resumed.train()
    assert sorted(n for n in os.listdir(ckpt_dir) if n.startswith("best")) == [
        "best-iter=16-acc=0.7.pth",
        "best-iter=24-acc=0.6.pth",
        "best-iter=32-acc=0.65.pth",
    ]


@pytest.mark.parametrize("listed", ["epoch_3.pth", "../victim.pth", "/abs.pth", 3])
def test_a_crafted_list_of_best_checkpoints_never_deletes_another_file(
    make_trainer, caplog, listed
):
    hook = BestCheckpointHook("acc", top_k=2)
    kept = [["best-iter=8-acc=0.9.pth", 0.9], [listed, 0.8]]
    hook.load_state_dict({"best": 0.9, "kept": kept, "due": [listed, 0.95]})
    assert hook.state_dict()["kept"] == [["best-iter=8-acc=0.9.pth", 0.9]]
    assert "due" not in hook.state_dict()
    assert f"Ignoring {listed!r} among the best checkpoints" in caplog.text


@pytest.mark.parametrize("top_k, error", [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_a_bad_top_k_is_refused(top_k, error):
    with pytest.raises(error, match="top_k must be a positive int"):
        BestCheckpointHook("acc", top_k=top_k)


def best_files(trainer):
    return sorted(n for n in os.listdir(trainer.ckpt_dir) if n.startswith("best"))


def test_the_state_of_another_metric_is_ignored_and_its_files_are_kept(make_trainer, caplog):
    """Hook states are keyed by class name in registration order: resumed with a hook of
    another metric registered first, that hook gets the acc hook's state; it ignores it, and
    neither adopts nor deletes acc's files."""
    first = evaluating(make_trainer(max_epochs=4), ACCS, BestCheckpointHook("acc", top_k=3))
    first.train()
    acc_files = best_files(first)
    trainer = make_trainer(max_epochs=5)
    trainer.register_hook(EvalHook(1, lambda: {"acc": 0.1, "loss": 0.25}))
    loss = BestCheckpointHook("loss", top_k=2)
    trainer.register_hooks([loss, BestCheckpointHook("acc", top_k=3)])
    trainer.train()
    assert trainer.start_iter == 32
    assert [os.path.basename(path) for path in loss.best_checkpoints] == [
        "best-iter=40-loss=0.25.pth"
    ]
    assert set(acc_files) < set(best_files(trainer))  # none deleted
    (warning,) = [r.getMessage() for r in caplog.records if "'acc'" in r.getMessage()]
    assert "'loss'" in warning


def test_the_state_of_another_file_name_is_ignored(caplog):
    other = BestCheckpointHook("acc", top_k=2)
    other._kept = [("best-iter=8-acc=0.9.pth", 0.9)]
    hook = BestCheckpointHook("acc", file_name="top.pth", top_k=2)
    hook.load_state_dict(other.state_dict())
    assert hook.state_dict()["kept"] == []
    assert "'best.pth'" in caplog.text and "'top.pth'" in caplog.text


def test_a_lower_top_k_on_resume_names_each_file_it_deletes(make_trainer, caplog):
    first = evaluating(make_trainer(max_epochs=4), ACCS, BestCheckpointHook("acc", top_k=3))
    first.train()
    caplog.clear()
    accs = [*ACCS[:4], 0.1]  # no new best after the resume
    resumed = evaluating(make_trainer(max_epochs=5), accs, BestCheckpointHook("acc", top_k=2))
    resumed.train()
    assert best_files(resumed) == ["best-iter=16-acc=0.7.pth", "best-iter=32-acc=0.65.pth"]
    (deleted,) = [r for r in caplog.records if "best-iter=24-acc=0.6.pth" in r.getMessage()]
    assert deleted.levelno >= logging.INFO


# A best found and not yet written, held in the periodic checkpoint saved just before it

LOSSES = [0.5, 0.4, 0.45, 0.1, 0.35, 0.2, 0.25, 0.15]  # evaluated every 3 iterations of 24


def build_top_2_by_iteration(make_trainer, work_dir):
    """Iteration-based: evaluated and checkpointed every 3 iterations (epochs of 8)."""
    trainer = make_trainer(max_iters=24, work_dir=work_dir, checkpoint_period=0)
    trainer.register_hook(CheckpointHook(3, max_to_keep=2, by_epoch=False))
    trainer.register_hook(EvalHook(3, lambda: {"loss": LOSSES[trainer.cur_iter // 3]}))
    trainer.register_hook(BestCheckpointHook("loss", top_k=2))
    return trainer


def crash_at_best_save(trainer, n, monkeypatch, landed):
    """End the run at the n-th best's save, the periodic checkpoint saved just before it
    durable: before the best's write (a kill while it is written), or (``landed``) once its
    file is in place, before latest.txt names it."""
    count = itertools.count(1)
    save, point = trainer.save_checkpoint, checkpoint.update_latest_pointer

    def crashing_save(name, **kwargs):
        if name.startswith("best") and next(count) == n:
            trainer.checkpointer.wait()
            raise RuntimeError("crash")
        return save(name, **kwargs)

    def crashing_point(folder, name):
        if name.startswith("best") and next(count) == n:
            raise RuntimeError("crash")
        point(folder, name)

    if landed:
        monkeypatch.setattr(checkpoint, "update_latest_pointer", crashing_point)
    else:
        monkeypatch.setattr(trainer, "save_checkpoint", crashing_save)


def kept_weights(trainer):
    """The kept best checkpoints' names and values, best first, and each file's weights."""
    (hook,) = [h for h in trainer.hooks if isinstance(h, BestCheckpointHook)]
    kept = [(os.path.basename(path), value) for path, value in hook.best_checkpoints.items()]
    return kept, {name: load(os.path.join(trainer.ckpt_dir, name))["model"] for name, _ in kept}


@pytest.mark.parametrize("landed", [False, True])
@pytest.mark.parametrize(
    "build, n",
    [
        (lambda make, work: build_top_3(make, work, 6), 2),  # epoch 2: 0.7, kept to the end
        (lambda make, work: build_top_3(make, work, 6), 6),  # the last: the rerun is finished
        (build_top_2_by_iteration, 4),  # mid-epoch, at iteration 12: 0.1, kept to the end
        (build_top_2_by_iteration, 7),  # the last iteration, with the epoch's end
    ],
)
def test_a_best_not_yet_written_when_the_run_ends_is_written_on_resume(
    make_trainer, tmp_path, monkeypatch, build, n, landed
):
    """The periodic checkpoint of the best's iteration or epoch end, saved before it, left it
    out: the rerun resumed from there never evaluated it again and kept other files."""
    whole = build(make_trainer, tmp_path / "whole")
    whole.train()
    crashed = build(make_trainer, tmp_path / "resumed")
    crash_at_best_save(crashed, n, monkeypatch, landed)
    with pytest.raises(RuntimeError, match="crash"):
        crashed.train()
    monkeypatch.undo()
    resumed = build(make_trainer, tmp_path / "resumed")
    resumed.train()
    assert resumed.start_iter > 0
    (kept, weights), (whole_kept, whole_weights) = kept_weights(resumed), kept_weights(whole)
    assert kept == whole_kept
    assert sorted(os.listdir(resumed.ckpt_dir)) == sorted(os.listdir(whole.ckpt_dir))
    for name, model in whole_weights.items():
        assert all(torch.equal(model[k], weights[name][k]) for k in model)


# Two hooks, their files


def two_hooks(make_trainer, a, b):
    trainer = make_trainer(max_epochs=1)
    results = {"loss": 0.5, "acc": 0.5, "val/loss": 0.5, "val_loss": 0.5}
    trainer.register_hook(EvalHook(1, lambda: results))
    hooks = [BestCheckpointHook(**a), BestCheckpointHook(**b)]
    trainer.register_hooks(hooks)
    return trainer, hooks


@pytest.mark.parametrize(
    "a, b",
    [
        ({"metric": "loss"}, {"metric": "acc"}),  # both best.pth, which held the last saved
        ({"metric": "loss"}, {"metric": "acc", "top_k": 2}),  # best.pth, and its stem
        ({"metric": "val/loss", "top_k": 2}, {"metric": "val_loss", "top_k": 3}),  # each
        # deleted the other's best-iter=N-val_loss=V.pth
    ],
)
def test_two_hooks_that_would_write_the_same_files_are_refused(make_trainer, a, b):
    trainer, _ = two_hooks(make_trainer, a, b)
    with pytest.raises(ValueError, match="file_name='best.pth'") as error:
        trainer.train()
    assert repr(a["metric"]) in str(error.value) and repr(b["metric"]) in str(error.value)
    assert not glob.glob(os.path.join(trainer.ckpt_dir, "best*"))


@pytest.mark.parametrize(
    "a, b",
    [
        ({"metric": "loss", "top_k": 2}, {"metric": "acc", "top_k": 2}),
        ({"metric": "loss"}, {"metric": "acc", "file_name": "best_acc.pth"}),
    ],
)
def test_two_hooks_with_files_of_their_own_are_accepted(make_trainer, a, b):
    trainer, hooks = two_hooks(make_trainer, a, b)
    trainer.train()
    a_files, b_files = (set(hook.best_checkpoints) for hook in hooks)
    assert len(a_files) == len(b_files) == 1 and not a_files & b_files
    assert all(os.path.isfile(path) for path in a_files | b_files)
