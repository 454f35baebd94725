"""Progress, the resume-position mapping and the resumable data passes."""

import os

import pytest
import torch

from conftest import TinyModel, load, tiny_loader


def test_resume_with_a_different_epoch_length_is_refused(make_trainer):
    make_trainer(max_epochs=1).train()
    trainer = make_trainer(max_epochs=2, loader=tiny_loader(n=16))  # another dataset
    with pytest.raises(ValueError, match="saved with 8 iterations per epoch, this trainer has 4"):
        trainer.train()


class Recording(TinyModel):
    """Remembers the samples it was fed, in order."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, batch):
        self.seen.extend(map(tuple, batch[0].tolist()))
        return super().forward(batch)


def stop_after_6_of_8_iterations(make_trainer, model=None):
    """The path of a checkpoint saved in the middle of a one-epoch run."""
    trainer = make_trainer(
        max_epochs=1, model=model, checkpoint_by_epoch=False, checkpoint_period=6
    )
    trainer.train()
    return os.path.join(trainer.ckpt_dir, "iter_6.pth")


def test_a_changed_batch_size_maps_the_position_by_consumed_samples(make_trainer, caplog):
    # resumed after 6 of 8 iterations of 4 samples, with batches of 8
    first = Recording()
    mid_epoch = stop_after_6_of_8_iterations(make_trainer, first)
    resumed = Recording()
    loader = tiny_loader(batch_size=8, shuffle=True)
    make_trainer(max_epochs=1, model=resumed, loader=loader).train(resume_from_checkpoint=mid_epoch)
    assert (
        "epoch 0 stopped after 6 iterations = 24 samples, so this run goes on from iteration 3 "
        "of 4 of that epoch" in caplog.text
    )
    assert len(resumed.seen) == 8 and resumed.seen == first.seen[24:]  # what the epoch had left


def test_a_changed_batch_size_that_cannot_continue_at_the_sample_is_refused(make_trainer):
    mid_epoch = stop_after_6_of_8_iterations(make_trainer)
    trainer = make_trainer(max_epochs=1, loader=tiny_loader(batch_size=5))  # 24 % 5 != 0
    with pytest.raises(RuntimeError, match=r"\(6 of 8 iterations, 24 samples\).*cannot continue"):
        trainer.train(resume_from_checkpoint=mid_epoch)


def test_a_changed_batch_size_at_an_epoch_end_needs_no_mapping(make_trainer, caplog):
    make_trainer(max_epochs=1).train()
    trainer = make_trainer(max_epochs=2, loader=tiny_loader(batch_size=8))
    trainer.train()
    assert "1 processes x batches of 4 to 1 x 8, at the start of epoch 1" in caplog.text
    assert (trainer.start_iter, trainer.cur_iter) == (4, 7)


def test_a_list_of_batches_resumes_in_mid_epoch_without_a_saved_pass_state(make_trainer, tmp_path):
    batches = list(tiny_loader())  # 8 batches, already made: a pass draws no random numbers
    first = Recording()
    part = make_trainer(
        max_epochs=2, model=first, loader=batches, checkpoint_by_epoch=False, checkpoint_period=6,
        work_dir=tmp_path / "part",
    )  # fmt: skip
    part.train()
    mid_epoch = os.path.join(part.ckpt_dir, "iter_12.pth")  # 4 of the second epoch's 8
    assert [r["epoch_start"] for r in load(mid_epoch)["rng"]] == [None]
    resumed = Recording()
    again = make_trainer(max_epochs=2, model=resumed, loader=batches, work_dir=tmp_path / "again")
    again.train(resume_from_checkpoint=mid_epoch)
    assert resumed.seen == first.seen[12 * 4 :]  # the last 4 batches of epoch 2, once
    for a, b in zip(part.model.state_dict().values(), again.model.state_dict().values()):
        assert torch.equal(a, b)
