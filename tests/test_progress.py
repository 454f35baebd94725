"""Progress, and the mapping of a resume position to another world or batch size."""

import os
import signal

import pytest

from trainer import HookBase

from conftest import Recording, tiny_loader


def test_resume_with_a_different_epoch_length_is_refused(make_trainer):
    make_trainer(max_epochs=1).train()
    trainer = make_trainer(max_epochs=2, loader=tiny_loader(n=16))  # another dataset
    with pytest.raises(ValueError, match="saved with 8 iterations per epoch, now 4"):
        trainer.train()


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
        "epoch 1 stopped after 6 iterations = 24 samples, so this run goes on with iteration 4 "
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
    assert "1 processes x batches of 4 to 1 x 8, at the start of epoch 2" in caplog.text
    assert (trainer.start_iter, trainer.cur_iter) == (4, 7)


def test_outcome_says_how_each_train_ended(make_trainer):
    """What the hooks' after_train read (the trackers mark their runs with it)."""

    class Outcomes(HookBase):
        def __init__(self):
            self.ends = iter(["error", "SIGTERM", None])
            self.end, self.outcomes = None, []

        def before_train(self):
            self.end = next(self.ends)

        def after_iter(self):
            if self.trainer.cur_iter + 1 == 10 and self.end == "error":
                raise RuntimeError("a bug")
            if self.trainer.cur_iter + 1 == 12 and self.end == "SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)

        def after_train(self):
            self.outcomes.append(self.trainer.progress.outcome)

    trainer = make_trainer(max_epochs=2)  # a checkpoint after each epoch of 8 iterations
    hook = Outcomes()
    trainer.register_hook(hook)
    with pytest.raises(RuntimeError, match="a bug"):
        trainer.train()
    with pytest.raises(SystemExit):  # each train() of this trainer resumes the last checkpoint
        trainer.train()
    trainer.train()
    assert hook.outcomes == ["failed", "killed", "finished"]
    assert trainer.progress.outcome == "finished"
