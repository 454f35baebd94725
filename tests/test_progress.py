"""Progress, the resume-position mapping and the resumable data passes."""

import logging
import multiprocessing
import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainer import HookBase

from conftest import TinyModel, build, load, tiny_dataset, tiny_loader


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


class CountingDataset(Dataset):
    """tiny_dataset, counting the samples loaded (in worker processes too)."""

    def __init__(self, n=32):
        self.data = tiny_dataset(n)
        self.loads = multiprocessing.Value("i", 0)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        with self.loads.get_lock():
            self.loads.value += 1
        return self.data[i]


class LoadsAtFirstStep(HookBase):
    def __init__(self, dataset):
        self.dataset, self.loads = dataset, None

    def after_iter(self):
        if self.loads is None:
            self.loads = self.dataset.loads.value


class CrashAfter(HookBase):
    priority = 100  # after CheckpointHook's save

    def __init__(self, iteration):
        self.iteration = iteration

    def after_iter(self):
        if self.trainer.cur_iter == self.iteration:
            raise KeyboardInterrupt


class CustomBatches(Sampler):
    """A batch sampler of a kind the trainer does not know: batches of 4 in a shuffled order."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        return iter([order[i : i + 4] for i in range(0, self.n, 4)])

    def __len__(self):
        return self.n // 4


def loaders(kind, dataset, workers):
    # shuffled with torch's default RNG: the worker seed and the shuffle seed both come from it
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        torch.manual_seed(0)  # its sampler draws its seed when it is made

        return StatefulDataLoader(dataset, batch_size=4, shuffle=True, num_workers=workers)
    if kind == "batch_sampler":
        return DataLoader(dataset, batch_sampler=CustomBatches(len(dataset)), num_workers=workers)
    return DataLoader(dataset, batch_size=4, shuffle=True, num_workers=workers)


@pytest.mark.parametrize(
    "kind, workers",
    [("plain", 0), ("plain", 2), ("batch_sampler", 0), ("stateful", 0), ("stateful", 2)],
)
def test_a_mid_epoch_resume_skips_the_consumed_batches_without_loading_them(
    tmp_path, caplog, kind, workers
):
    caplog.set_level(logging.INFO, logger="trainer")
    whole = build(tmp_path / "whole", loader=loaders(kind, CountingDataset(), workers))
    whole.train()
    # 2 epochs of 8 iterations; a checkpoint after iteration 6 of the second, then a crash
    part = build(
        tmp_path / "part", loader=loaders(kind, CountingDataset(), workers),
        checkpoint_by_epoch=False, checkpoint_period=7,
    )  # fmt: skip
    part.register_hook(CrashAfter(13))
    with pytest.raises(KeyboardInterrupt):
        part.train()
    dataset = CountingDataset()
    resumed = build(tmp_path / "part", loader=loaders(kind, dataset, workers))
    first_step = LoadsAtFirstStep(dataset)
    resumed.register_hook(first_step)
    resumed.train()
    assert resumed.start_iter == 14
    for name, value in whole.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    if kind == "stateful":  # restored from the loader's own state, saved in the checkpoint
        assert "from the state of the StatefulDataLoader, after the 6 batches" in caplog.text
        assert first_step.loads == (4 if workers == 0 else 8)
        saved = load(os.path.join(part.ckpt_dir, "iter_14.pth"))["rng"][0]["loader"]
        assert isinstance(saved, dict) and saved
    elif kind == "plain":
        assert "skipped the 6 batches already trained on by index" in caplog.text
        # the step's batch of 4, and with workers the rest of the epoch that they prefetch
        assert first_step.loads == (4 if workers == 0 else 8)
    else:
        assert "its batch_sampler is a CustomBatches, not a BatchSampler, so the 6 batches" in (
            caplog.text
        )
        assert first_step.loads == 7 * 4  # the 6 consumed batches are loaded again
