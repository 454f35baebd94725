"""Trains a tiny model in its own process, for the crash and preemption tests (test_resume.py).

Configured by environment variables:
    WORK_DIR, OUT         the work dir, and where to save the final weights
    MODE                  "epoch" (3 epochs of 10 iterations) or "iter" (25 iterations)
    NUM_WORKERS           the data loader's worker processes
Under torchrun it trains with DistributedDataParallel and a DistributedSampler.
    SHARD=1               under torchrun (1 rank too): shard the model with FSDP2's fully_shard
    FULL_CKPT=1           one full checkpoint file instead of a sharded checkpoint's folder
    SHARDED_CKPT=1        sharded checkpoints (folders) in one process too, the model not sharded
    CLIP=c                clip_grad_norm
    ACCUM=k               accumulation_steps
    BATCH=b               batch size per process (4)
    DIST_SAMPLER=1        a DistributedSampler in a single process too
    STREAM=1              a stream instead: torchdata's StatefulDataLoader over an
                          IterableDataset without a length, shuffled anew at every pass (MODE=iter
                          only). Under torchrun rank 1's shard is shorter: 4 batches to rank 0's 5.
    RECORD=path           append the indices of every batch the model sees to this file
    DROPOUT=p             the dropout probability (0.2)
    SLOW                  seconds to sleep in every iteration (gives signals time to land)
    CKPT_PERIOD           the checkpoint period, in iterations
    LOG_PERIOD            the log period (5)
    PREEMPT_CHECK         preempt_check_period (10)
    KILL_AT_ITER=n        SIGKILL this process after iteration n
    KILL_WHEN_SAVED=1     ... once the checkpoint write in flight, if any, is on disk
    KILL_RANK=r           only rank r kills itself (KILL_* act only in torchrun's first attempt)
    KILL_IN_SAVE=n        SIGKILL it halfway through writing its n-th checkpoint
    KILL_BEFORE_POINTER=n SIGKILL it after its n-th checkpoint file, before latest.txt moves
    SLOW_SAVE=s           sleep s seconds in every checkpoint write (after creating WORK_DIR/saving)
    HOLD_SAVE=n           the write of the checkpoint of iteration n ("every": of each), once
                          begun, creates WORK_DIR/holding and waits until WORK_DIR/release exists
    MARK_CTRL_C=1         each Ctrl-C, once the trainer's handler has run, creates WORK_DIR/ctrl_c_k
    PID_DIR               write this process's pid to PID_DIR/pid_{rank}
    DUMP_RESUMED=path     rank 0 saves the full model and optimizer state there as training starts
    RESTART_DELAY=s       in an attempt that torchrun restarted, rank 0 joins the group s late
"""

import os
import signal
import sys
import time


def env_int(name, default=0):
    return int(os.environ.get(name, default))


def main():
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

    import trainer.checkpoint as checkpoint_module
    from trainer import CheckpointHook, HookBase, Trainer, set_random_seed
    from trainer.distributed import init_distributed

    work_dir = os.environ["WORK_DIR"]
    rank = env_int("RANK")
    # Faults are injected into the first attempt only: workers that torchrun restarts run clean.
    if env_int("TORCHELASTIC_RESTART_COUNT") > 0 or env_int("KILL_RANK", rank) != rank:
        for name in ("KILL_AT_ITER", "KILL_IN_SAVE", "KILL_BEFORE_POINTER"):
            os.environ.pop(name, None)
    saves = {"n": 0}
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        saves["n"] += 1
        if os.environ.get("SLOW_SAVE"):
            open(os.path.join(work_dir, "saving"), "w").close()
            time.sleep(float(os.environ["SLOW_SAVE"]))
        if saves["n"] == env_int("KILL_IN_SAVE", -1):
            f.write(b"half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        progress = obj.get("progress") if isinstance(obj, dict) else None  # a checkpoint's
        held = os.environ.get("HOLD_SAVE")
        if progress is not None and held in ("every", str(progress["iters_done"])):
            open(os.path.join(work_dir, "holding"), "w").close()
            while not os.path.exists(os.path.join(work_dir, "release")):  # the test's move
                time.sleep(0.01)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    pointer_moves = {"n": 0}
    real_pointer = checkpoint_module.update_latest_pointer

    def update_pointer(*args):
        pointer_moves["n"] += 1
        if pointer_moves["n"] == env_int("KILL_BEFORE_POINTER", -1):
            os.kill(os.getpid(), signal.SIGKILL)
        real_pointer(*args)

    checkpoint_module.update_latest_pointer = update_pointer

    class Crash(HookBase):
        def before_train(self):  # after the resume: the full state it loaded, saved by rank 0
            if os.environ.get("DUMP_RESUMED"):
                options = StateDictOptions(full_state_dict=True)
                state = get_state_dict(self.trainer.model, self.trainer.optimizer, options=options)
                if rank == 0:
                    real_save(state, os.environ["DUMP_RESUMED"])
            if env_int("MARK_CTRL_C"):
                handler, caught = signal.getsignal(signal.SIGINT), []

                def marked(signum, frame):  # the trainer's handler, then a mark that it ran
                    caught.append(signum)
                    try:
                        handler(signum, frame)
                    finally:
                        open(os.path.join(work_dir, f"ctrl_c_{len(caught)}"), "w").close()

                signal.signal(signal.SIGINT, marked)

        def after_iter(self):
            time.sleep(float(os.environ.get("SLOW", 0)))
            if self.trainer.cur_iter == env_int("KILL_AT_ITER", -1):
                if env_int("KILL_WHEN_SAVED"):
                    self.trainer.checkpointer.wait()
                os.kill(os.getpid(), signal.SIGKILL)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            dropout = nn.Dropout(float(os.environ.get("DROPOUT", 0.2)))
            self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), dropout, nn.Linear(16, 1))

        def forward(self, batch):
            x, y, index = batch
            if os.environ.get("RECORD"):
                with open(os.environ["RECORD"], "a") as f:
                    f.write(" ".join(map(str, index.tolist())) + "\n")
            return nn.functional.mse_loss(self.net(x), y)

    if env_int("TORCHELASTIC_RESTART_COUNT") > 0 and rank == 0:
        time.sleep(float(os.environ.get("RESTART_DELAY", 0)))
    rank, world_size = init_distributed()  # under torchrun: gloo, DDP and a DistributedSampler
    if os.environ.get("PID_DIR"):
        with open(os.path.join(os.environ["PID_DIR"], f"pid_{rank}"), "w") as f:
            f.write(str(os.getpid()))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 4, generator=g), torch.randn(40, 1, generator=g)
    data = TensorDataset(x, y, torch.arange(40))
    sampler = None
    if world_size > 1 or env_int("DIST_SAMPLER"):
        sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(
        data,
        batch_size=env_int("BATCH", 4),
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=env_int("NUM_WORKERS"),
    )
    if env_int("STREAM"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        class Stream(IterableDataset):
            """This rank's shard, in an order drawn from torch's RNG at every pass."""

            def __init__(self):
                self.indices = list(range(rank, 40, world_size))[: 16 if rank == 1 else 20]

            def __iter__(self):
                info = torch.utils.data.get_worker_info()
                g = None
                if info is not None:  # the workers share an order, from the loader's base seed
                    g = torch.Generator().manual_seed(info.seed - info.id)
                order = torch.randperm(len(self.indices), generator=g).tolist()
                if info is not None:  # and each yields its share of it
                    order = order[info.id :: info.num_workers]
                return iter(data[self.indices[i]] for i in order)

        loader = StatefulDataLoader(
            Stream(), batch_size=env_int("BATCH", 4), num_workers=env_int("NUM_WORKERS")
        )
    torch.manual_seed(0)  # the same initial weights on every rank, for fully_shard
    net = Model()
    set_random_seed(rank)
    if env_int("SHARD") and torch.distributed.is_initialized():  # torchrun, 1 rank or more
        for layer in net.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model = fully_shard(net)
    else:
        model = DistributedDataParallel(net) if world_size > 1 else net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    length = {"max_epochs": 3} if os.environ["MODE"] == "epoch" else {"max_iters": 25}
    trainer = Trainer(
        model,
        optimizer,
        scheduler,
        loader,
        **length,
        work_dir=work_dir,
        log_period=env_int("LOG_PERIOD", 5),
        preempt_check_period=env_int("PREEMPT_CHECK", 10),
        checkpoint_period=0,
        warmup_t=5,
        warmup_init_lr=0.005,
        clip_grad_norm=float(os.environ.get("CLIP", 0)),
        accumulation_steps=env_int("ACCUM", 1),
    )
    if env_int("FULL_CKPT"):
        trainer.checkpointer.sharded = False
    if env_int("SHARDED_CKPT"):
        trainer.checkpointer.sharded = True
    # checkpoints every CKPT_PERIOD iterations, the newest 3 kept
    trainer.register_hook(CheckpointHook(env_int("CKPT_PERIOD", 3), 3, by_epoch=False))
    trainer.register_hook(Crash())
    trainer.train()
    weights = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        real_save(weights, os.environ["OUT"])
    if world_size > 1:
        # Every rank done talking, then tear down, as torch asks.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        # Skip freeing the model and the interpreter's teardown: a gloo thread of the default
        # group may still hold a tensor made in Python, and dropping it deadlocks with the DDP
        # model freeing that group, or aborts while the interpreter exits (docs/internals.md:
        # gloo teardown).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
