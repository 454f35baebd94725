"""trainer/data.py: the data passes a mid-epoch resume continues exactly (sized loaders,
sequences, streams, persistent workers, samplers' generators) and the RNG states."""

import io
import itertools
import logging
import multiprocessing
import os
import random
import signal

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
)

from trainer import HookBase, Trainer, set_random_seed
from trainer.data import get_rng_state, set_rng_state

from conftest import Recording, TinyModel, build, load, tiny_dataset, tiny_loader


def draw():
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def test_rng_state_round_trips_through_weights_only_load():
    gen = torch.Generator().manual_seed(5)
    set_random_seed(1)
    buffer = io.BytesIO()
    torch.save(get_rng_state((gen,)), buffer)
    expected = draw() + (float(torch.rand((), generator=gen)),)
    draw()
    buffer.seek(0)
    set_rng_state(torch.load(buffer, weights_only=True), (gen,))
    assert draw() + (float(torch.rand((), generator=gen)),) == expected


def test_a_list_of_batches_resumes_in_mid_epoch_without_a_saved_pass_state(make_trainer, tmp_path):
    batches = list(tiny_loader())  # 8 batches, already made: a pass draws no random numbers
    first = Recording()
    part = make_trainer(
        max_epochs=2,
        model=first,
        loader=batches,
        checkpoint_by_epoch=False,
        checkpoint_period=6,
        work_dir=tmp_path / "part",
    )
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


def loaded_before_the_first_step(loads, workers):
    """The step's batch of 4, and with workers at most the rest of the epoch's 2 batches, which
    they may or may not have prefetched by then."""
    return loads == 4 if workers == 0 else 4 <= loads <= 8


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
        tmp_path / "part",
        loader=loaders(kind, CountingDataset(), workers),
        checkpoint_by_epoch=False,
        checkpoint_period=7,
    )
    part.register_hook(CrashAfter(13))
    with pytest.raises(SystemExit):
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
        assert loaded_before_the_first_step(first_step.loads, workers)
        saved = load(os.path.join(part.ckpt_dir, "iter_14.pth"))["rng"][0]["loader"]
        assert isinstance(saved, dict) and saved
    elif kind == "plain":
        assert "skipped the 6 batches already trained on by index" in caplog.text
        # the step's batch of 4, and with workers the rest of the epoch that they prefetch
        assert loaded_before_the_first_step(first_step.loads, workers)
    else:
        assert "its batch_sampler is a CustomBatches, not a BatchSampler, so the 6 batches" in (
            caplog.text
        )
        assert first_step.loads == 7 * 4  # the 6 consumed batches are loaded again


class CrashAtEpochEnd(HookBase):
    priority = 100  # after CheckpointHook's save

    def __init__(self, epoch):
        self.epoch = epoch

    def after_epoch(self):
        if self.trainer.cur_epoch == self.epoch:
            raise KeyboardInterrupt


def samplers_generator_loader(dataset, workers):
    """A batch sampler over a RandomSampler with a generator of its own, as a script builds it
    (seeded the same in every run)."""
    g = torch.Generator().manual_seed(1)
    batches = BatchSampler(RandomSampler(dataset, generator=g), batch_size=4, drop_last=False)
    return DataLoader(dataset, batch_sampler=batches, num_workers=workers)


def persistent_loader(dataset, workers):
    return DataLoader(
        dataset, batch_size=4, shuffle=True, num_workers=workers, persistent_workers=True
    )


@pytest.mark.parametrize(
    "make_loader, workers",
    [(persistent_loader, 2), (samplers_generator_loader, 0), (samplers_generator_loader, 2)],
)
@pytest.mark.parametrize("crash", ["mid-epoch", "epoch end"])
def test_resume_replays_the_data_order_of_an_uninterrupted_run(
    tmp_path, caplog, make_loader, workers, crash
):
    caplog.set_level(logging.INFO, logger="trainer")
    torch.manual_seed(0)  # the same initial weights in both runs
    seen = Recording()
    build(
        tmp_path / "whole", model=seen, loader=make_loader(tiny_dataset(), workers), max_epochs=3
    ).train()
    torch.manual_seed(0)
    first = Recording()
    at_end = crash == "epoch end"
    part = build(
        tmp_path / "part",
        model=first,
        loader=make_loader(tiny_dataset(), workers),
        max_epochs=3,
        checkpoint_by_epoch=at_end,
        checkpoint_period=1 if at_end else 7,
    )
    part.register_hook(CrashAtEpochEnd(1) if at_end else CrashAfter(13))
    with pytest.raises(SystemExit):
        part.train()
    resumed = Recording()
    rerun = build(
        tmp_path / "part", model=resumed, loader=make_loader(tiny_dataset(), workers), max_epochs=3
    )
    rerun.train()
    start = 16 if at_end else 14
    assert rerun.start_iter == start
    assert resumed.seen == seen.seen[start * 4 :]  # the samples, in the uninterrupted order
    for name, value in seen.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


class SeedsOfWorkers(torch.utils.data.Dataset):
    """Index i, with the base seed of the data loader's workers (their seed less their id)."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return torch.tensor(i), torch.tensor(info.seed - info.id)


class Indices(TinyModel):
    """Records the indices of SeedsOfWorkers' batches, in order, and their workers' base seeds."""

    def __init__(self):
        super().__init__()
        self.order, self.base_seeds = [], set()

    def forward(self, batch):
        index, base_seed = batch
        self.order.extend(index.tolist())
        self.base_seeds.add(int(base_seed[0]))
        return self.linear.weight.sum() * 0


def seeds_loader():
    return DataLoader(
        SeedsOfWorkers(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True
    )


def test_a_persistent_loader_seeds_its_workers_as_a_loop_does_and_apart_on_resume(make_trainer):
    """A run's persistent loader makes its iterator at its first pass as a for loop does: the
    workers' base seed, then the shuffle. A resumed run makes it with the RNG put back (the run
    it resumes had made it), its base seed drawn from a stream derived from the state: the
    state's own first number is the next pass's shuffle seed, and worker 0's torch RNG would
    then replay the stream that ordered the data."""
    loop = Indices()
    torch.manual_seed(0)  # as build() seeds it, after the model
    loader = seeds_loader()
    for _ in range(2):
        for batch in loader:
            loop(batch)
    first = Indices()
    part = make_trainer(model=first, loader=seeds_loader(), max_epochs=2)
    part.register_hook(CrashAtEpochEnd(0))
    with pytest.raises(SystemExit):
        part.train()
    assert first.order == loop.order[:32] and first.base_seeds == loop.base_seeds
    resumed = Indices()
    make_trainer(model=resumed, loader=seeds_loader(), max_epochs=2).train()
    assert resumed.order == loop.order[32:]
    (base_seed,) = resumed.base_seeds
    replayed = torch.randperm(32, generator=torch.Generator().manual_seed(base_seed)).tolist()
    assert resumed.order != replayed


class Batches(torch.nn.Module):
    """Records each batch a step takes; draws no random numbers, as the loop beside it draws
    none."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        torch.nn.init.constant_(self.linear.weight, 0.1)  # the same in every run
        torch.nn.init.zeros_(self.linear.bias)
        self.seen = []

    def forward(self, batch):
        self.seen.append(batch[0])
        return torch.nn.functional.mse_loss(self.linear(batch[0]), batch[1])


def order_loader(kind):
    """tiny_loader's 8 batches of 4, shuffled by a generator of the loader's own (as PyTorch's
    reproducibility notes advise), by torch's RNG, or in order."""
    options = {"shuffle": kind != "no shuffle"}
    if kind in ("generator", "workers", "persistent workers"):
        options["generator"] = torch.Generator().manual_seed(0)
    if kind in ("workers", "persistent workers"):
        options.update(num_workers=2, persistent_workers=kind == "persistent workers")
    return tiny_loader(**options)


def a_loops_batches(kind, accumulation, epochs=3):
    """``for x, y in loader`` over each epoch, but for the left-over batches of accumulation."""
    torch.manual_seed(0)  # as build() seeds it
    loader = order_loader(kind)
    seen = []
    for _ in range(epochs):
        batches = [x for x, _ in loader]
        seen += batches[: len(batches) // accumulation * accumulation]
    return seen


def same_batches(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "kind, accumulation",
    [
        ("generator", 1),
        ("generator", 3),  # 2 iterations of 3 batches an epoch, 2 batches left over
        ("global seed", 1),
        ("no shuffle", 1),
        ("workers", 1),
        ("persistent workers", 3),
    ],
)
def test_the_data_order_is_a_for_loops_in_every_epoch(tmp_path, kind, accumulation):
    """Issue 48: a RandomSampler draws once more from its generator at the end of a pass, which
    a pass ended after its last batch skipped: from the second epoch on, the order differed."""
    model = Batches()
    trainer = build(
        tmp_path,
        model=model,
        loader=order_loader(kind),
        max_epochs=3,
        accumulation_steps=accumulation,
    )
    trainer.train()
    assert same_batches(model.seen, a_loops_batches(kind, accumulation))


class SigtermAfter(HookBase):
    def __init__(self, iteration):
        self.iteration = iteration

    def after_iter(self):
        if self.trainer.cur_iter == self.iteration:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("where, iteration", [("mid-epoch", 2), ("an epoch's last iteration", 3)])
def test_a_preempted_run_resumes_the_loops_data_order(tmp_path, where, iteration):
    """A checkpoint at an epoch's last iteration resumes by taking the pass to its end, as the
    uninterrupted run did: its left-over batches and the sampler's last draw."""

    def run(work_dir, model, *hooks):
        loader = order_loader("generator")  # 3 epochs of 2 iterations of 3 batches
        trainer = build(work_dir, model=model, loader=loader, max_epochs=3, accumulation_steps=3)
        trainer.register_hooks(hooks)
        trainer.train()
        return trainer

    seen = Batches()
    with pytest.raises(SystemExit):
        run(tmp_path / "part", seen, SigtermAfter(iteration))
    resumed = Batches()
    assert run(tmp_path / "part", resumed).start_iter == iteration + 1
    assert same_batches(seen.seen + resumed.seen, a_loops_batches("generator", 3))
    whole = Batches()
    run(tmp_path / "whole", whole)
    for name, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


class NumpyShuffled(Sampler):
    """Batches of 4 in an order drawn from a NumPy generator of the sampler's own."""

    def __init__(self, n):
        self.n, self.rng = n, np.random.default_rng(0)

    def __iter__(self):
        order = self.rng.permutation(self.n).tolist()
        return iter([order[i : i + 4] for i in range(0, self.n, 4)])

    def __len__(self):
        return self.n // 4


def test_a_sampler_generator_that_checkpoints_cannot_save_is_named_on_resume(make_trainer, caplog):
    dataset = tiny_dataset()
    make_trainer(max_epochs=1, loader=DataLoader(dataset, batch_sampler=NumpyShuffled(32))).train()
    make_trainer(max_epochs=2, loader=DataLoader(dataset, batch_sampler=NumpyShuffled(32))).train()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "NumpyShuffled.rng (a Generator)" in warning and "checkpoints do not save" in warning


# Streams: data loaders without a length


class Stream(IterableDataset):
    """``n`` samples ``(x, y)`` whose x is their index, in a fresh random order at every pass
    (drawn from torch's RNG) or in order; ``n=None`` never ends."""

    def __init__(self, n=14, shuffle=True):
        self.n, self.shuffle = n, shuffle

    def __iter__(self):
        if self.n is None:
            order = itertools.count()
        else:
            order = torch.randperm(self.n).tolist() if self.shuffle else range(self.n)
        for i in order:
            yield torch.full((4,), i / 20), torch.tensor([float(i % 3)])


class Seen(TinyModel):
    """Records the first x of every batch it trains on: the index of its first sample."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, batch):
        self.seen.append(round(float(batch[0][0, 0]) * 20))
        return super().forward(batch)


class Epochs(HookBase):
    def __init__(self):
        self.events = []

    def before_epoch(self):
        self.events.append(("before", self.trainer.cur_epoch, self.trainer.cur_iter + 1))

    def after_epoch(self):
        self.events.append(("after", self.trainer.cur_epoch, self.trainer.cur_iter + 1))


def stream_trainer(work_dir, stream, max_iters, **overrides):
    loader = overrides.pop("loader", None)
    if loader is None:  # (a stream has no len(), so no truth value either)
        loader = DataLoader(stream, batch_size=2)
    trainer = build(work_dir, model=Seen(), loader=loader, max_iters=max_iters, **overrides)
    epochs = Epochs()
    trainer.register_hook(epochs)
    return trainer, epochs


def test_a_stream_trains_for_max_iters_in_epochs_that_end_with_its_passes(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainer")
    # 14 samples in batches of 2: passes of 7 iterations; 20 iterations cross two of them
    trainer, epochs = stream_trainer(tmp_path, Stream(14), 20, log_period=5)
    trainer.train()
    assert trainer.cur_iter == 19 and trainer.max_epochs is None
    assert epochs.events == [
        ("before", 0, 0),
        ("after", 0, 7),
        ("before", 1, 7),
        ("after", 1, 14),
        ("before", 2, 14),
        ("after", 2, 20),
    ]
    # every pass is the whole stream again, each in its own order
    firsts = trainer.model.seen
    assert len(firsts) == 20 and firsts[:7] != firsts[7:14]
    # the log line counts iterations against max_iters (whose ETA it gives), epochs without a total
    assert "epoch 2 [3]  iter 10/20  ETA " in caplog.text
    # the by-epoch LR step (StepLR, halving) came at the two pass ends and the end of training;
    # the checkpoints at the end of training, counted in passes (with a warning that says so)
    assert trainer.lr == pytest.approx(0.1 / 8)
    assert (
        "data_loader has no length, so by_epoch=True steps lr_scheduler and the CheckpointHook "
        "saves checkpoints only when its stream ends" in caplog.text
    )
    assert sorted(os.listdir(trainer.ckpt_dir)) == [
        "iter_14.pth",
        "iter_20.pth",
        "iter_7.pth",
        "latest.txt",
    ]


def test_an_endless_stream_counts_iterations_when_told_and_warns_of_nothing(tmp_path, caplog):
    trainer, epochs = stream_trainer(
        tmp_path, Stream(None), 10, by_epoch=False, checkpoint_by_epoch=False, checkpoint_period=4
    )
    trainer.train()
    assert epochs.events == [("before", 0, 0), ("after", 0, 10)]  # one epoch, ended by max_iters
    assert trainer.model.seen[-1] == 18  # samples 0, 2, ..., 18: one stream, never restarted
    assert sorted(os.listdir(trainer.ckpt_dir)) == [
        "iter_10.pth",
        "iter_4.pth",
        "iter_8.pth",
        "latest.txt",
    ]
    assert "has no length" not in caplog.text


def test_a_stream_drops_a_last_iteration_that_its_pass_cannot_fill(tmp_path):
    # passes of 7 batches, 2 per iteration: 3 iterations each, the 7th batch dropped
    trainer, epochs = stream_trainer(tmp_path, Stream(14), 7, accumulation_steps=2)
    trainer.train()
    assert [e[2] for e in epochs.events] == [0, 3, 3, 6, 6, 7]
    seen = trainer.model.seen
    assert len(seen) == 14 and len(set(seen[:6])) == 6  # 6 distinct batches in the first pass


def test_a_stream_that_yields_once_only_is_refused_at_its_second_pass(tmp_path):
    once = (batch for batch in DataLoader(Stream(6), batch_size=2))  # a generator: one pass
    trainer, _ = stream_trainer(tmp_path, None, 5, loader=once)
    with pytest.raises(
        RuntimeError, match="^data_loader yielded 0 batches in a pass: is it a generator"
    ):
        trainer.train()
    assert trainer.cur_iter == 2  # the first pass trained


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_resumes_exactly_through_the_state_of_a_stateful_loader(tmp_path, workers):
    from torchdata.stateful_dataloader import StatefulDataLoader

    def run(work_dir, crash=None):
        torch.manual_seed(0)  # the loader's base seed for its workers comes from torch's RNG
        loader = StatefulDataLoader(Stream(14), batch_size=2, num_workers=workers)
        trainer, _ = stream_trainer(
            work_dir, None, 20, loader=loader, checkpoint_by_epoch=False, checkpoint_period=10
        )
        if crash is not None:
            trainer.register_hook(CrashAfter(crash))
        trainer.train()
        return trainer

    whole = run(tmp_path / "whole")
    with pytest.raises(SystemExit):  # after the checkpoint at iteration 10 (3 of pass 2)
        run(tmp_path / "part", crash=10)
    resumed = run(tmp_path / "part")
    assert resumed.start_iter == 10
    assert resumed.model.seen == whole.model.seen[10:]
    for name, value in whole.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


def test_a_pass_cut_short_shuts_its_workers_down_when_training_ends(tmp_path):
    """A StatefulDataLoader keeps its last iterator: the workers of the pass that max_iters cut
    lived on until the loader was collected, whose shutdown then took 5 s a worker."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    before = set(multiprocessing.active_children())  # another test's, not yet collected
    loader = StatefulDataLoader(Stream(14), batch_size=2, num_workers=2)
    trainer, _ = stream_trainer(tmp_path, None, 10, loader=loader)  # 3 of the second pass's 7
    trainer.train()
    assert set(multiprocessing.active_children()) <= before


class LongerThanItsLength(Stream):
    """A stream that says it has fewer samples than it yields (each worker yields them all)."""

    def __len__(self):
        return self.n // 2


@pytest.mark.filterwarnings("ignore:Length of IterableDataset")
def test_a_pass_of_a_loader_longer_than_its_length_shuts_its_workers_down(tmp_path):
    """Ended at its length, the pass stopped short of its end, and the workers lived on."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    before = set(multiprocessing.active_children())  # another test's, not yet collected
    loader = StatefulDataLoader(LongerThanItsLength(8), batch_size=2, num_workers=2)
    trainer = build(tmp_path, model=Seen(), loader=loader, max_epochs=1)
    trainer.train()
    assert trainer.cur_iter + 1 == len(loader) == 2
    assert set(multiprocessing.active_children()) <= before


def test_a_stream_without_state_starts_again_on_resume_with_one_warning(tmp_path, caplog):
    def run(crash=None):
        trainer, epochs = stream_trainer(
            tmp_path,
            Stream(14, shuffle=False),
            20,
            checkpoint_by_epoch=False,
            checkpoint_period=10,
        )
        if crash is not None:
            trainer.register_hook(CrashAfter(crash))
        trainer.train()
        return trainer, epochs

    with pytest.raises(SystemExit):
        run(crash=10)
    caplog.clear()
    resumed, epochs = run()
    assert resumed.start_iter == 10
    warnings = [r.getMessage() for r in caplog.records if "stream starts again" in r.getMessage()]
    assert len(warnings) == 1 and "the 3 batches already trained on come again" in warnings[0]
    # epoch 2 goes on at its 4th iteration, with the whole stream again (7 batches), then a pass
    # of 3 more to reach 20
    assert epochs.events == [
        ("before", 1, 10),
        ("after", 1, 17),
        ("before", 2, 17),
        ("after", 2, 20),
    ]
    assert resumed.model.seen == [0, 2, 4, 6, 8, 10, 12, 0, 2, 4]


def test_resume_from_a_stream_with_a_loader_of_a_length_is_refused(tmp_path):
    stream_trainer(tmp_path, Stream(14), 4)[0].train()
    trainer = build(tmp_path, max_iters=8)  # the same work_dir, over a map-style dataset
    with pytest.raises(ValueError) as error:
        trainer.train()
    assert os.path.join(trainer.ckpt_dir, "iter_4.pth") in str(error.value)
    assert "saved with None iterations per epoch, now 8" in str(error.value)


class ShortOfItsLength(list):
    """Batches that yield fewer than their len() says."""

    def __len__(self):
        return super().__len__() + 3


def test_a_loader_shorter_than_its_len_is_refused_naming_its_length_and_the_fix(make_trainer):
    batches = ShortOfItsLength(list(tiny_loader()))  # 8 batches, len() 11
    trainer = make_trainer(loader=batches, max_epochs=1)
    with pytest.raises(RuntimeError, match=r"fewer batches than its len\(\), 11: make .*__len__"):
        trainer.train()


def test_a_step_taking_more_batches_than_a_stream_fetched_is_refused_naming_the_argument(
    make_trainer,
):
    class TwoBatches(Trainer):
        def train_one_iter(self):
            self.next_batch()
            super().train_one_iter()

    # no length: an iteration's batches are fetched ahead; the 4th iteration's second is missing
    stream = (batch for batch in tiny_loader(n=28))  # 7 batches
    trainer = make_trainer(loader=stream, max_iters=4, cls=TwoBatches)
    with pytest.raises(RuntimeError, match="more batches than accumulation_steps.*raise"):
        trainer.train()
