"""A tiny model, a tiny in-memory dataset and a ``make_trainer(**overrides)`` factory."""

import contextlib
import glob
import json
import logging
import os
import platform
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer import HookBase, Trainer
from trainer.hooks import CheckpointHook, EvalHook, LoggerHook, LRUpdateHook

import forkserver


class TinyModel(nn.Module):
    """Linear regression with dropout; returns the MSE loss of a ``(x, y)`` batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.dropout = nn.Dropout(0.1)

    def forward(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.linear(self.dropout(x)), y)


class Recording(TinyModel):
    """Remembers the samples it was fed, in order."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, batch):
        self.seen.extend(map(tuple, batch[0].tolist()))
        return super().forward(batch)


def tiny_dataset(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def tiny_loader(n: int = 32, batch_size: int = 4, **kwargs) -> DataLoader:
    return DataLoader(tiny_dataset(n), batch_size=batch_size, **kwargs)


def count_host_reads(monkeypatch) -> list:
    """From now on, the names of the tensor methods that read a value to the host (on a GPU, a
    sync), as they are called; ``monkeypatch.undo()`` stops counting."""
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            reads.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def save_checkpoint_file(obj, path) -> None:
    """Write ``obj`` to ``path`` as the trainer writes a checkpoint file (its records' CRCs
    right): a crafted checkpoint that gets past the CRCs to what a test checks."""
    torch.save(obj, path)


def build(
    work_dir,
    model=None,
    loader=None,
    lr=0.1,
    scheduler="step",
    fused=None,
    cls=Trainer,
    **overrides,
) -> Trainer:
    """A trainer (``cls``) of TinyModel on tiny_loader(): SGD with momentum, a StepLR, 2
    epochs."""
    torch.manual_seed(0)
    model = TinyModel() if model is None else model
    if overrides.get("compile"):  # torch.compile's arguments: the user compiles the model
        model = torch.compile(model, **overrides.pop("compile"))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, fused=fused)
    if scheduler == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    elif callable(scheduler):
        scheduler = scheduler(optimizer)
    hooks = replaced_default_hooks(overrides)
    kwargs = {"log_period": 4, "work_dir": str(work_dir)}
    if "max_iters" not in overrides:
        kwargs["max_epochs"] = 2
    kwargs.update(overrides)
    trainer = cls(
        model,
        optimizer,
        scheduler,
        tiny_loader(shuffle=True) if loader is None else loader,
        **kwargs,
    )
    return with_hooks(trainer, hooks)


def with_hooks(trainer: Trainer, hooks: list[HookBase]) -> Trainer:
    """``trainer`` with each of ``hooks`` in place of the default hook of its class, as a user
    replaces one."""
    for hook in hooks:
        trainer.unregister_hook(type(hook))
        trainer.register_hook(hook)
    return trainer


def replaced_default_hooks(options: dict) -> list[HookBase]:
    """The default hooks that the options of theirs in ``options`` (taken out of it) configure:
    ``plateau_metric`` (LRUpdateHook), ``checkpoint_by_epoch`` (CheckpointHook),
    ``tensorboard``, ``metrics_jsonl`` and ``metric_writers`` (LoggerHook). An ``amp_dtype``
    becomes ``enable_amp``'s value, where AMP is on."""
    amp_dtype = options.pop("amp_dtype", None)
    if amp_dtype is not None and options.get("enable_amp"):
        options["enable_amp"] = amp_dtype
    hooks: list[HookBase] = []
    if "plateau_metric" in options:
        hooks.append(LRUpdateHook(plateau_metric=options.pop("plateau_metric")))
    if "checkpoint_by_epoch" in options:
        by_epoch = options.pop("checkpoint_by_epoch")
        period = options.get("checkpoint_period", 1)
        if period:
            keep = options.get("max_num_checkpoints", 3)
            hooks.append(CheckpointHook(period, keep, by_epoch=by_epoch))
    logger_options = {
        name: options.pop(name)
        for name in ("tensorboard", "metrics_jsonl", "metric_writers")
        if name in options
    }
    if logger_options:
        writers = logger_options.pop("metric_writers", None)
        hooks.append(LoggerHook(options.get("log_period", 4), writers, **logger_options))
    return hooks


def read_scalars(log_dir) -> dict:
    """TensorBoard's scalars in ``log_dir``, by its own reader: ``{tag: [(step, value)]}``."""
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class FakeClock:
    """Stands in for the ``time`` module where a test patches it: time moves only when told."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    monotonic = time = perf_counter


class Tick(HookBase):
    """Every iteration takes ``seconds`` on ``clock``."""

    def __init__(self, clock, seconds):
        self.clock, self.seconds = clock, seconds

    def after_iter(self):
        self.clock.now += self.seconds


class Recorder(HookBase):
    """Records every loop event it gets, with the epoch and iteration."""

    def __init__(self):
        self.events = []

    def _record(self, name):
        self.events.append((name, self.trainer.cur_epoch, self.trainer.cur_iter))

    def before_train(self):
        self._record("before_train")

    def after_train(self):
        self._record("after_train")

    def before_epoch(self):
        self._record("before_epoch")

    def after_epoch(self):
        self._record("after_epoch")

    def before_iter(self):
        self._record("before_iter")

    def after_iter(self):
        self._record("after_iter")


class RecordLR(HookBase):
    """Records the LR each iteration starts with."""

    def __init__(self):
        self.lrs = []

    def before_iter(self):
        self.lrs.append(self.trainer.lr)


def load(path):
    """A checkpoint, loaded as users load them."""
    return torch.load(path, weights_only=True)


def evaluating(trainer, values, *hooks):
    """Registers an EvalHook returning values[epoch] as "acc" after every epoch, then hooks."""
    trainer.register_hook(EvalHook(1, lambda: {"acc": values[trainer.cur_epoch]}))
    trainer.register_hooks(list(hooks))
    return trainer


@pytest.fixture
def make_trainer(tmp_path):
    """``make_trainer(**overrides)``: a fresh tiny trainer in a temporary work dir."""

    def make(**overrides) -> Trainer:
        overrides.setdefault("work_dir", tmp_path / "work")
        return build(**overrides)

    return make


@pytest.fixture(autouse=True)
def _quiet_trainer_logs():
    # Keep test output short; records still reach caplog and each trainer's log file.
    logging.getLogger("trainer").setLevel(logging.INFO)
    yield


# Importing MLflow (MLflowWriter) calls platform.platform(), which runs `uname -p` once a process
# and caches it: run here, so that the in-process tests using MLflow start no process.
platform.platform()

# A shell without job control starts a background job (`pytest &` in a script) with SIGINT
# ignored: Python then installs no KeyboardInterrupt handler, the trainer rightly leaves Ctrl-C
# alone, and every process the tests start inherits the ignoring. The tests press Ctrl-C as at a
# terminal, so they get Python's handler back, as CPython's own test runner does (gh-154167);
# the processes started from here on then begin with the default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that starts a process (a script, torchrun) must be marked slow, so that
    ``pytest -m "not slow"`` stays quick: in any other, starting one fails the test. The whole
    protocol, setup and teardown included: a module-scoped fixture that starts one counts."""
    global _records_start
    if item.get_closest_marker("slow") is not None:
        _records_start = _records_size()
        with _noting_signals_and_torchrun(item.nodeid):
            yield
        return

    def refuse(self, args, *_, **__):
        pytest.fail(
            f"{item.nodeid} starts a process ({args!r}): mark it @pytest.mark.slow",
            pytrace=False,
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        yield


@contextlib.contextmanager
def _noting_signals_and_torchrun(nodeid: str):
    """Where ``$TRAINER_TEST_SIGNALS_AND_TORCHRUN`` names a file, append ``nodeid`` to it if the
    test sends a signal to another process or starts torchrun: .ci/run runs those tests again,
    each process a fresh interpreter (torchrun's own launcher, no fork server)."""
    path = os.environ.get("TRAINER_TEST_SIGNALS_AND_TORCHRUN")
    if not path:
        yield
        return
    noted = []
    kill, killpg, start = os.kill, os.killpg, subprocess.Popen.__init__

    def noting_kill(pid, signum):
        if pid != os.getpid():
            noted.append(signum)
        kill(pid, signum)

    def noting_killpg(group, signum):
        noted.append(signum)
        killpg(group, signum)

    def noting_start(self, args, *rest, **kwargs):
        if "torch.distributed.run" in (args if isinstance(args, (list, tuple)) else [args]):
            noted.append("torchrun")
        start(self, args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "kill", noting_kill)
        patch.setattr(os, "killpg", noting_killpg)
        patch.setattr(subprocess.Popen, "__init__", noting_start)
        yield
    if noted:
        with open(path, "a") as f:  # one write a line: the pytest-xdist workers share the file
            f.write(nodeid + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report lists the processes the fork servers started for it, each with
    its hash seed, and how to rerun the test with the same seeds."""
    report = (yield).get_result()
    forked = forked_processes(item.nodeid) if report.failed else ""
    if forked:
        report.sections.append(("processes forked, with their hash seeds", forked))


def forked_processes(nodeid: str) -> str:
    """The processes that the fork servers started since the test ``nodeid`` began, a line
    each with its hash seed, then a command that reruns the test with the same seeds in the
    same order; "" if none."""
    if not _servers:
        return ""
    lines, first = [], None
    with open(forkserver.records_file(_servers_folder)) as f:
        f.seek(_records_start)
        for line in f:
            pid, _, server, argv = line.split(" ", 3)
            seed = _seeds[int(server)]
            lines.append(f"pid {pid}, hash seed {seed}: python {' '.join(json.loads(argv))}")
            first = int(server) if first is None else first
    if first is None:
        return ""
    order = _seeds[first:] + _seeds[:first]  # a new session's turns start at the first server
    seeds = ",".join(map(str, order))
    rerun = f"TRAINER_TEST_HASHSEEDS={seeds} pytest -n 0 '{nodeid}'"
    lines.append(f"The same seeds in the same order: {rerun}")
    return "\n".join(lines)


def failure_output(stderr: str, tail: int = 3000) -> str:
    """What a failed run printed, for an assertion message: the lines of a rank that aborted
    (a C++ terminate, faulthandler's stacks), which torchrun's summary pushes out of the tail,
    then the tail."""
    aborted = [
        line
        for line in stderr.splitlines()
        if "terminate called" in line
        or "Fatal Python error" in line
        or line.startswith(("Thread 0x", "Current thread 0x", '  File "'))
    ][:80]
    return ("\n".join(aborted) + "\n...\n" if aborted else "") + stderr[-tail:]


def communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout=...)``. On a timeout the test fails with where every process
    under ``proc`` hung: each gets SIGABRT, on which Python's faulthandler (``cpu_env`` turns it
    on) prints every thread's stack, and what is still alive after that is killed (torchrun
    starts its workers in sessions of their own)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The workers one at a time (stacks printed at once interleave), while torchrun is
        # stopped: it would end the others as soon as one dies.
        _signal(proc.pid, signal.SIGSTOP)
        for pid in _process_tree(proc.pid)[1:]:
            _signal(pid, signal.SIGABRT)
            time.sleep(0.5)
        _signal(proc.pid, signal.SIGABRT)
        _signal(proc.pid, signal.SIGCONT)
        try:
            _, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            _signal_tree(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
        _signal_tree(proc.pid, signal.SIGKILL)  # workers torchrun left behind, if any
        # faulthandler's list of each process's extension modules (a forked one has torch's
        # and scikit-learn's) would push stacks out of the tail
        err = "\n".join(s for s in err.splitlines() if not s.startswith("Extension modules:"))
        pytest.fail(
            f"{proc.args} did not end within {timeout} s. Its processes' stacks at that moment "
            f"(faulthandler, on SIGABRT), from the end of its stderr:\n{err[-12000:]}"
        )


def _signal_tree(root: int, signum: int) -> None:
    for pid in _process_tree(root):
        _signal(pid, signum)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _process_tree(root: int) -> list[int]:
    """``root`` and the processes under it, those that the fork servers started for a process
    (see ``popen``) counted as that process's children."""
    parents: dict[int, int] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                parents[int(stat.split("/")[2])] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    if _servers:
        with open(forkserver.records_file(_servers_folder)) as f:
            for line in f:
                child, requester, server = map(int, line.split(" ", 3)[:3])
                if parents.get(child) == _servers[server].pid:  # still its: not a reused pid
                    parents[child] = requester
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_env(**extra: str) -> dict[str, str]:
    """The environment for a test's subprocess, with any GPU hidden and faulthandler on.

    Those tests check the CPU and gloo paths (``tests/test_cuda.py`` checks CUDA in-process). On
    a machine with one GPU, the examples would pick it and float16, and two ranks would share
    it, which NCCL refuses.
    """
    # faulthandler: a hung process prints its stacks on SIGABRT (see communicate)
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONFAULTHANDLER": "1", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def torchrun_command(*args: str) -> list[str]:
    """``python -m torch.distributed.run *args`` on a free port of its own, not the default
    29500: a torchrun that an earlier test (or another job on the machine) left running can
    neither block nor be joined by this one."""
    return [sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port()), *args]


_servers: list[subprocess.Popen] = []  # the fork servers, started by the first popen
_servers_folder = ""  # their sockets, turn and records (tests/forkserver.py)
_seeds: list[int] = []  # their hash seeds
_records_start = 0  # the size of the records file when the running test began


def popen(cmd, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)``; ``[sys.executable, script or -m module, ...]``
    forked by tests/forkserver.py's servers, which have torch and trainer imported already (a
    torchrun launcher's workers too), instead of a fresh interpreter that spends about 2 s of
    CPU importing torch. ``TRAINER_TEST_FORKSERVER=0`` starts fresh interpreters."""
    if os.environ.get("TRAINER_TEST_FORKSERVER") == "0":
        return subprocess.Popen(cmd, **kwargs)
    if not _servers:
        _start_servers()
    return forkserver.ForkedPopen(cmd, **kwargs)


def _start_servers() -> None:
    """Start the fork servers, each a fresh interpreter with its own hash seed, and wait until
    they are ready."""
    global _servers_folder
    folder = tempfile.mkdtemp(prefix="trainer-tests-")
    with open(os.path.join(folder, "turn"), "w") as f:
        f.write("0")
    open(forkserver.records_file(folder), "w").close()
    _seeds.extend(_hash_seeds())
    for index, seed in enumerate(_seeds):
        env = cpu_env(PYTHONHASHSEED=str(seed))
        env.pop("OMP_NUM_THREADS", None)  # the default; a child sets the number it is given
        command = [sys.executable, forkserver.__file__, folder, str(index)]
        _servers.append(
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        )
    _servers_folder = folder
    for server in _servers:
        if not select.select([server.stdout], [], [], 120)[0]:
            pytest.fail("a fork server (tests/forkserver.py) did not start within 120 s")
        assert server.stdout.readline() == b"ready\n", "a fork server failed to start"
    os.environ[forkserver.ENV_FOLDER] = folder


def _hash_seeds() -> list[int]:
    """The servers' hash seeds: ``$TRAINER_TEST_HASHSEEDS`` (comma-separated), else
    ``$PYTHONHASHSEED`` for all where it is fixed (as fresh interpreters would have it), else
    random and distinct."""
    given = os.environ.get("TRAINER_TEST_HASHSEEDS")
    if given:
        seeds = [int(seed) for seed in given.split(",")]
        if len(seeds) != forkserver.SERVERS:
            raise ValueError(
                f"TRAINER_TEST_HASHSEEDS={given} has {len(seeds)} seeds: give one for each of "
                f"the {forkserver.SERVERS} fork servers, as a failed test's report does."
            )
        return seeds
    fixed = os.environ.get("PYTHONHASHSEED", "random")
    if fixed != "random":
        return [int(fixed)] * forkserver.SERVERS
    return random.SystemRandom().sample(range(1, 2**32), forkserver.SERVERS)


def _records_size() -> int:
    if not _servers:
        return 0
    return os.path.getsize(forkserver.records_file(_servers_folder))


def pytest_unconfigure(config):
    for server in _servers:  # its standard input closed, it exits
        server.stdin.close()
    for server in _servers:
        server.wait(timeout=30)
    if _servers:
        shutil.rmtree(_servers_folder, ignore_errors=True)
