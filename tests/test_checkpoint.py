"""What checkpoints may hold, and how loading them fails or falls back (trainer/checkpoint.py)."""

import os

import pytest
import torch

from trainer import Trainer
from trainer.checkpoint_files import read_latest_pointer

from conftest import TinyModel, build, load, tiny_loader


class NaNGradientAt(TinyModel):
    """A finite loss whose gradient is NaN at forward call ``at`` (counted from 0)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, batch):
        loss = super().forward(batch)
        self.calls += 1
        if self.calls - 1 == self.at:
            loss = loss + torch.sqrt(self.linear.weight.sum() * 0)  # 0, with a NaN gradient
        return loss


def test_non_finite_weights_are_never_saved_and_the_rerun_resumes_the_last_good_one(make_trainer):
    # the NaN gradient comes at the last iteration of epoch 2, whose loss is finite
    trainer = make_trainer(max_epochs=3, model=NaNGradientAt(15))
    expected = (
        r"Not saving epoch_2\.pth: after iteration 16, 2 tensors hold NaN or infinite values "
        r"\(model\.linear\.weight, optimizer\.0\.momentum_buffer\)"
    )
    with pytest.raises(FloatingPointError, match=expected):
        trainer.train()
    assert sorted(os.listdir(trainer.ckpt_dir)) == ["epoch_1.pth", "latest.txt"]
    assert read_latest_pointer(trainer.ckpt_dir) == os.path.join(trainer.ckpt_dir, "epoch_1.pth")

    rerun = make_trainer(max_epochs=3, model=NaNGradientAt(-1))  # the cause fixed
    rerun.train()
    assert rerun.start_iter == 8  # from epoch_1.pth
    weights = load(os.path.join(rerun.ckpt_dir, "epoch_3.pth"))["model"]
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_a_non_finite_gradient_norm_fails_like_a_non_finite_loss(make_trainer):
    trainer = make_trainer(max_epochs=2, model=NaNGradientAt(5), clip_grad_norm=1.0)
    expected = r"The gradient norm \(the loss was not\) became NaN or infinite at iteration 5 "
    with pytest.raises(FloatingPointError, match=expected):
        trainer.train()
    assert not os.path.exists(trainer.ckpt_dir) or os.listdir(trainer.ckpt_dir) == []


def test_auto_resume_skips_a_checkpoint_with_non_finite_weights(make_trainer, caplog, tmp_path):
    trainer = make_trainer(max_epochs=2)
    trainer.train()
    newest = os.path.join(trainer.ckpt_dir, "epoch_2.pth")
    data = load(newest)
    data["model"]["linear.bias"][0] = float("nan")
    torch.save(data, newest)  # as a run from before saves refused NaN weights could leave it
    torch.save(data, tmp_path / "bad.pth")
    rerun = make_trainer(max_epochs=2)
    rerun.train()
    assert rerun.start_iter == 8  # from epoch_1.pth
    assert (
        "epoch_2.pth' holds NaN or infinite values in 1 tensors (model.linear.bias)" in caplog.text
    )
    with pytest.raises(RuntimeError, match="holds NaN or infinite values"):
        make_trainer(max_epochs=2).load_checkpoint(str(tmp_path / "bad.pth"))


def test_resuming_with_another_optimizer_class_names_the_checkpoint_and_both_classes(tmp_path):
    first = build(tmp_path, max_epochs=1)  # SGD
    first.train()
    model = TinyModel()
    adam = Trainer(model, torch.optim.Adam(model.parameters()), None, tiny_loader(), max_epochs=2,
                   work_dir=tmp_path)  # fmt: skip
    expected = r"epoch_1\.pth' holds the state of a SGD for optimizer, and this trainer's optimizer"
    with pytest.raises(ValueError, match=expected + r" is a Adam: that state does not fit it"):
        adam.train()


def damage(ckpt_dir, how):
    """Damage the newest of two epoch checkpoints (epoch_2.pth) or the pointer, as ``how`` says."""
    newest = ckpt_dir / "epoch_2.pth"
    if how == "wrong types":
        torch.save({key: 5 for key in load(newest)}, newest)
    elif how == "a weight that is not a tensor":
        data = load(newest)
        data["model"]["linear.weight"] = 5
        torch.save(data, newest)
    elif how == "progress without epoch":
        data = load(newest)
        del data["progress"]["epoch"]
        torch.save(data, newest)
    elif how == "non-UTF-8 pointer":
        (ckpt_dir / "latest.txt").write_bytes(b"\xff\xfe\x00epoch")
    elif how == "pointer is a directory":
        (ckpt_dir / "latest.txt").unlink()
        (ckpt_dir / "latest.txt").mkdir()
    elif how == "dangling symlink":
        (ckpt_dir / "epoch_9.pth").symlink_to(ckpt_dir / "gone.pth")
        (ckpt_dir / "latest.txt").write_text("epoch_9.pth")
    elif how == "directory named .pth":
        (ckpt_dir / "epoch_9.pth").mkdir()
        (ckpt_dir / "latest.txt").write_text("epoch_9.pth")


@pytest.mark.parametrize(
    "how, start_iter, warning",
    [
        ("wrong types", 8, "epoch_2.pth' is damaged: 'progress' is of type int, expected dict"),
        ("a weight that is not a tensor", 8, "'model' holds 1 entries that are not tensors"),
        ("progress without epoch", 8, "epoch_2.pth' is damaged: 'progress' lacks 'epoch'"),
        ("non-UTF-8 pointer", 16, "latest.txt is damaged (not UTF-8 text)"),
        ("pointer is a directory", 16, "latest.txt is damaged (a directory, not a file)"),
        ("dangling symlink", 16, "epoch_9.pth' does not exist"),
        ("directory named .pth", 16, "epoch_9.pth' is a directory, not a file"),
    ],
)
def test_a_damaged_newest_checkpoint_or_pointer_falls_back_with_a_warning(
    make_trainer, tmp_path, caplog, how, start_iter, warning
):
    make_trainer(max_epochs=2).train()
    damage(tmp_path / "work" / "checkpoints", how)
    rerun = make_trainer(max_epochs=3)
    rerun.train()  # falls back; and the next save replaces a damaged pointer
    assert rerun.start_iter == start_iter
    assert warning in caplog.text
    assert read_latest_pointer(rerun.ckpt_dir) == os.path.join(rerun.ckpt_dir, "epoch_3.pth")
