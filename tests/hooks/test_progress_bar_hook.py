import contextlib
import io
import logging
import os
import re
import sys
import threading
import types
import warnings

import pytest
from tqdm.auto import tqdm

import trainer.logger as trainer_logging
from trainer import HookBase
from trainer.hooks import ProgressBarHook
from trainer.logger import _console_handler

from conftest import FakeClock, Tick


class Terminal(io.StringIO):
    def isatty(self):
        return True


def screen(output):
    """The lines a terminal (or a notebook's output area) shows: a carriage return goes back to
    the line's start, and what follows it overwrites what was there."""
    lines = []
    for line in output.split("\n"):
        shown = ""
        for part in line.split("\r"):
            shown = part + shown[len(part) :]
        lines.append(shown.rstrip())
    return lines


def test_the_bar_draws_each_epoch_on_a_terminal_a_few_times_a_second(make_trainer, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("trainer.hooks.progress_bar_hook.time", clock)
    monkeypatch.setattr("tqdm.std.time", clock.time)  # tqdm's clock, for the it/s
    terminal = Terminal()
    trainer = make_trainer(max_epochs=2, log_period=4)
    trainer.register_hooks([Tick(clock, 0.05), ProgressBarHook(interval=0.2, stream=terminal)])
    trainer.train()
    output = terminal.getvalue()
    # each epoch: its start, at most one redraw per 0.2 s (4 iterations of 0.05 s: 2), its end,
    # and its line left standing
    assert output.count("\r") == 2 * (1 + 2 + 1 + 1)
    epoch_1, epoch_2, rest = screen(output)
    loss = trainer.metric_storage.value_maybe_smooth("total_loss")  # as of the last log point
    assert re.fullmatch(r"epoch 1/2 \|#+\| 8/8 \[20.00it/s, ETA 0:00:00, loss [\d.]+\]", epoch_1)
    assert re.fullmatch(r"epoch 2/2 \|#+\| 8/8 \[20.00it/s, ETA 0:00:00, loss (.+)\]", epoch_2)
    assert epoch_2.endswith(f"loss {loss:.4g}]")
    first_draw = output.split("\r")[2]  # after 1 of 8 iterations (the 1st: at the epoch's start)
    assert re.fullmatch(r"epoch 1/2 \|#.{9}\| 1/8 \[20.00it/s, ETA 0:00:00\] *", first_draw)
    assert rest == ""  # each epoch's line ended, and nothing after
    assert trainer_logging.live_bar is None  # the log records no longer clear it


def test_the_bar_shows_the_eta_of_the_run_and_a_stream_without_a_total(make_trainer, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("trainer.hooks.progress_bar_hook.time", clock)
    monkeypatch.setattr("tqdm.std.time", clock.time)
    terminal = Terminal()
    stream = [batch for batch in make_trainer(max_epochs=1).data_loader]  # 8 batches
    trainer = make_trainer(max_iters=12, loader=iter_forever(stream), log_period=4)
    trainer.register_hooks([Tick(clock, 1.0), ProgressBarHook(interval=0.1, stream=terminal)])
    trainer.train()
    draws = terminal.getvalue().split("\r")
    # after 3 of 12 iterations of 1 s, 9 more take 9 s; no bar and no total in a stream
    assert draws[4].rstrip() == "epoch 1 3it [ 1.00it/s, ETA 0:00:09]"
    assert screen(terminal.getvalue())[0].startswith("epoch 1 12it [ 1.00it/s, ETA 0:00:00, loss")


class iter_forever:
    """A stream (no length) that yields the same batches forever."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        while True:
            yield from self.batches


def test_no_bar_where_the_console_is_not_a_terminal(make_trainer):
    stream = io.StringIO()
    trainer = make_trainer(max_epochs=1)
    # none is registered by default, with or without progress_bar
    assert not any("ProgressBarHook" in h for h in trainer.hooks.info())
    trainer.register_hook(ProgressBarHook(stream=stream))  # and one registered draws nothing
    trainer.train()
    assert stream.getvalue() == ""


def test_on_a_terminal_the_bar_is_a_default_hook_that_unregisters(make_trainer, monkeypatch):
    monkeypatch.setattr("sys.stderr", Terminal())
    trainer = make_trainer(max_epochs=1)
    assert "ProgressBarHook (priority 91)" in trainer.hooks.info()
    assert [type(h) for h in trainer.unregister_hook(ProgressBarHook)] == [ProgressBarHook]
    assert not any("ProgressBarHook" in h for h in trainer.hooks.info())


@contextlib.contextmanager
def drawing_on(terminal, monkeypatch):
    """(a logger printing on ``terminal`` through the console handler, the bar there)"""
    monkeypatch.setattr("sys.stderr", terminal)
    handler = _console_handler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("trainer.test_bar")
    log.addHandler(handler)
    bar = tqdm(total=4, file=terminal, bar_format="{desc}")
    monkeypatch.setattr("trainer.logger.live_bar", bar)
    try:
        yield log, bar
    finally:
        log.removeHandler(handler)
        bar.close()


def test_a_log_line_clears_the_bar_and_draws_it_again_below(monkeypatch):
    terminal = Terminal()
    with drawing_on(terminal, monkeypatch) as (log, bar):
        bar.set_description_str("epoch 1 [##--] 2/4")
        log.warning("a log line")
    assert screen(terminal.getvalue()) == ["a log line", "epoch 1 [##--] 2/4", ""]


class HeldTerminal(Terminal):
    """A terminal whose write of a record's text waits until ``go`` is set."""

    def __init__(self, record):
        super().__init__()
        self.record, self.writing, self.go = record, threading.Event(), threading.Event()

    def write(self, text):
        if text.startswith(self.record):
            self.writing.set()
            assert self.go.wait(timeout=60)
        return super().write(text)


def test_a_record_from_another_thread_is_never_drawn_over_by_the_bar(monkeypatch):
    """A checkpoint's "Saved ... (on disk)" comes from the writer thread: while it is written,
    the bar's redraw from the training thread waits, so the record keeps a line of its own."""
    terminal = HeldTerminal("saved")
    with drawing_on(terminal, monkeypatch) as (log, bar):
        bar.set_description_str("epoch 1 [#---] 1/4")
        writer = threading.Thread(target=log.warning, args=("saved",))
        writer.start()
        assert terminal.writing.wait(timeout=60)  # the record is being written
        redraw = threading.Thread(target=bar.set_description_str, args=("epoch 1 [##--] 2/4",))
        redraw.start()
        redraw.join(timeout=0.2)  # it cannot end while the record is written
        terminal.go.set()
        writer.join()
        redraw.join()
    assert screen(terminal.getvalue()) == ["saved", "epoch 1 [##--] 2/4", ""]


class CtrlCTerminal(Terminal):
    """A terminal whose first write once ``armed`` raises KeyboardInterrupt: a Ctrl-C that lands
    while the bar draws."""

    armed = False

    def write(self, text):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return super().write(text)


class CtrlCInTheDraw(HookBase):
    """Arms the terminal before iteration 5 (the bar draws at its end); when training ends, logs
    from another thread while the bar is still up, as the checkpoint writer's thread does."""

    priority = ProgressBarHook.priority - 1  # its after_train too: before the bar is closed

    def __init__(self, terminal, log):
        self.terminal, self.log, self.logged = terminal, log, threading.Event()

    def before_iter(self):
        self.terminal.armed = self.trainer.cur_iter == 4

    def after_train(self):
        writer = threading.Thread(target=self.write, daemon=True)
        writer.start()
        writer.join(timeout=10)  # not forever, should tqdm's lock be held

    def write(self):
        self.log.warning("Saved checkpoint (on disk).")
        self.logged.set()


def test_a_ctrl_c_in_the_draw_leaves_tqdms_lock_free(make_trainer, monkeypatch):
    """tqdm's refresh() releases its lock without try/finally: a Ctrl-C in the draw kept it, and
    the writer thread's "Saved" record waited for it forever, and train() for the write."""
    trainer = make_trainer(max_epochs=1)  # on no terminal yet: no bar of its own
    terminal = CtrlCTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    log = logging.getLogger("trainer.test_bar")
    handler = _console_handler()  # on the terminal, keeping the bar below its records
    log.addHandler(handler)
    interrupt = CtrlCInTheDraw(terminal, log)
    trainer.register_hooks([ProgressBarHook(interval=1e-9, stream=terminal), interrupt])
    try:
        with pytest.raises(SystemExit):
            trainer.train()
    finally:
        log.removeHandler(handler)
    assert interrupt.logged.is_set()
    assert trainer.cur_iter == 4
    assert screen(terminal.getvalue())[0].endswith("WARNING]: Saved checkpoint (on disk).")


class FailAfter(HookBase):
    """Raises ``error`` at the end of iteration ``iteration`` (an index)."""

    def __init__(self, iteration, error):
        self.iteration, self.error = iteration, error

    def after_iter(self):
        if self.trainer.cur_iter == self.iteration:
            raise self.error


@pytest.mark.parametrize("error, ends", [(RuntimeError("boom"), RuntimeError),
                                         (KeyboardInterrupt(), SystemExit)])  # fmt: skip
def test_a_run_that_stops_early_draws_the_bar_where_it_stopped(make_trainer, error, ends):
    """Drawn last at iteration 1 of the epoch (the next redraw is a long way off), the bar shows
    the iterations done when a failure or Ctrl-C ends training (a notebook's widget turns red
    there), before it is closed."""
    terminal = Terminal()
    trainer = make_trainer(max_epochs=2)  # 8 iterations an epoch
    trainer.register_hooks([ProgressBarHook(interval=1e9, stream=terminal), FailAfter(13, error)])
    with pytest.raises(ends):
        trainer.train()
    drawn, blanks, rest = terminal.getvalue().split("\r")[-3:]
    assert re.match(r"epoch 2/2 \|#+.*\| 6/8 \[", drawn)  # iteration 14: the epoch's 6th
    assert blanks == " " * len(drawn.rstrip()) and rest == ""  # then erased, as before


class WarnAt(HookBase):
    """Warns at iteration ``iteration`` (an index), from the training thread or another one, as
    a model's forward does (a torch UserWarning)."""

    def __init__(self, iteration, thread):
        self.iteration, self.thread = iteration, thread

    def after_iter(self):
        if self.trainer.cur_iter == self.iteration:
            warn = lambda: warnings.warn("careful with that axe", stacklevel=1)  # noqa: E731
            if self.thread:
                worker = threading.Thread(target=warn)
                worker.start()
                worker.join()
            else:
                warn()


@pytest.mark.parametrize("thread", [False, True])
def test_a_warning_prints_above_the_bar_not_on_its_line(make_trainer, monkeypatch, thread):
    """``warnings`` writes to stderr itself: while the bar is drawn it goes the log records' way
    (the bar cleared, the warning written, the bar drawn again below), and when the bar ends
    ``warnings.showwarning`` is Python's again."""
    trainer = make_trainer(max_epochs=1)  # on no terminal yet: no bar of its own
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    # Python writes a warning on stderr itself (pytest records them instead: undone here)
    write = lambda message: sys.stderr.write(warnings._formatwarnmsg(message))  # noqa: E731
    monkeypatch.setattr("warnings._showwarnmsg_impl", write)
    showwarning = warnings.showwarning
    trainer.register_hooks([ProgressBarHook(interval=1e-9, stream=terminal), WarnAt(3, thread)])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        trainer.train()
    shown = screen(terminal.getvalue())
    warned = [i for i, line in enumerate(shown) if "UserWarning: careful with that axe" in line]
    assert len(warned) == 1 and shown[warned[0]].startswith(__file__)  # a line of its own
    assert re.match(r"epoch 1/1 \|#+\| 8/8 \[", shown[-2]) and shown[-1] == ""  # bar below
    assert warnings.showwarning is showwarning


def test_the_bar_leaves_a_showwarning_set_since_in_place(make_trainer, monkeypatch):
    monkeypatch.setattr("sys.stderr", Terminal())
    mine = []

    class SetShowwarning(HookBase):
        def after_iter(self):
            warnings.showwarning = lambda *args, **kwargs: mine.append(args[0])

    monkeypatch.setattr("warnings.showwarning", warnings.showwarning)  # restored after the test
    trainer = make_trainer(max_epochs=1)  # on a terminal: with a bar
    trainer.register_hook(SetShowwarning())
    trainer.train()
    warnings.warn("after the run", stacklevel=1)
    assert [str(message) for message in mine] == ["after the run"]


class ZMQInteractiveShell:
    """IPython's shell in a Jupyter kernel, by its name: what tqdm and the trainer look for."""


def test_in_a_notebook_one_bar_stands_for_the_log_points_lines(make_trainer, monkeypatch):
    """In a notebook without ipywidgets (tqdm draws text there, as here), and with it (a widget:
    test_a_notebook_shows_one_progress_display), the console keeps one bar for the run and
    every line but the log points'."""
    shell = ZMQInteractiveShell()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    console = io.StringIO()  # a kernel's stderr is not a terminal
    monkeypatch.setattr("sys.stderr", console)
    handler = _console_handler()  # what a notebook's trainer prints on, on stderr
    logging.getLogger("trainer").addHandler(handler)
    try:
        trainer = make_trainer(max_epochs=2, log_period=2)  # 16 iterations: 8 log points
        assert "ProgressBarHook (priority 91)" in trainer.hooks.info()
        trainer.register_hook(Warn())
        trainer.train()
    finally:
        logging.getLogger("trainer").removeHandler(handler)
    shown = screen(console.getvalue())
    assert [line for line in shown if line.startswith("epoch")] == [shown[-2]]  # one, last
    assert re.fullmatch(r"epoch 2/2 \|#+\| 8/8 \[.*it/s, ETA 0:00:00, loss [\d.]+\]", shown[-2])
    assert not any(" iter " in line for line in shown)  # no log point's line
    assert any("WARNING]: careful" in line for line in shown)
    assert any("Start training with iteration 1 of 16" in line for line in shown)
    assert any("Run summary" in line for line in shown)
    log = open(trainer.log_file).read()
    assert len(re.findall(r"INFO\]: epoch \d/2 \[\d/8\]  iter \d+/16", log)) == 8  # all in log.txt


class Warn(HookBase):
    def after_iter(self):
        if self.trainer.cur_iter == 5:
            logging.getLogger("trainer.test_bar").warning("careful")


NOTEBOOK_CELL = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer import Trainer

class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.linear(x), y)

torch.manual_seed(0)
data = TensorDataset(torch.randn(400, 4), torch.randn(400, 1))
model = Regression()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
trainer = Trainer(model, optimizer, None, DataLoader(data, batch_size=4), max_epochs=2,
                  log_period=10, checkpoint_period=0, work_dir="work_dir")
trainer.train()
trainer.cur_iter + 1
"""

WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.mark.slow
def test_a_notebook_shows_one_progress_display(tmp_path):
    """Runs a notebook as Jupyter does (a kernel, nbclient) with this trainer: 200 iterations,
    20 log points."""
    pytest.importorskip("ipykernel", reason="ipykernel (the dev extra) is not installed")
    nbformat = pytest.importorskip("nbformat", reason="nbformat (the dev extra) is missing")
    nbclient = pytest.importorskip("nbclient", reason="nbclient (the dev extra) is missing")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(NOTEBOOK_CELL)])
    client = nbclient.NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
        store_widget_state=True,
    )
    package = os.path.dirname(os.path.dirname(trainer_logging.__file__))  # this `trainer`
    client.execute(env={**os.environ, "PYTHONPATH": package})
    outputs = notebook.cells[0].outputs
    assert outputs[-1]["data"]["text/plain"] == "200"  # the run finished
    stderr = "".join(out["text"] for out in outputs if out.get("name") == "stderr")
    shown = screen(stderr)  # what the notebook shows of the stream
    assert any("Start training with iteration 1 of 200" in line for line in shown)
    assert not any(" iter " in line for line in shown)  # no log point's line
    widgets = [out for out in outputs if WIDGET in out.get("data", {})]
    if widgets:  # ipywidgets installed: one widget, its final state the last epoch's end
        assert len(widgets) == 1 and not any(line.startswith("epoch") for line in shown)
        state = notebook.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]
        models = [model["state"] for model in state["state"].values()]
        bars = [m for m in models if m.get("_model_name") == "FloatProgressModel"]
        assert [(bar["value"], bar["max"]) for bar in bars] == [(100, 100)]
        texts = [m["value"] for m in models if m.get("_model_name") == "HTMLModel"]
        assert any(text.startswith("epoch\u20072/2") for text in texts)  # spaces: U+2007
    else:  # tqdm draws text: one line, the last epoch's
        assert len([line for line in shown if line.startswith("epoch")]) == 1
        assert any(re.match(r"epoch 2/2 \|.+\| 100/100", line) for line in shown)


STOPPED_CELL = (
    NOTEBOOK_CELL.replace("trainer.train()\ntrainer.cur_iter + 1\n", "").replace(
        'work_dir="work_dir"', 'work_dir="{work_dir}"'
    )
    + """
import os, signal
from trainer import HookBase

class StopAt(HookBase):
    def after_iter(self):
        if self.trainer.cur_iter == 113:  # epoch 2, its 14th iteration of 100
            {stop}

trainer.register_hook(StopAt())
trainer.train()
"""
)


@pytest.mark.slow
def test_in_a_notebook_a_failure_or_ctrl_c_leaves_the_bar_where_it_stopped(tmp_path):
    """A failure, then the kernel's interrupt (SIGINT, as the stop button sends): each cell ends
    with its exception (a KeyboardInterrupt, not SystemExit(130)), its bar red at 14/100."""
    pytest.importorskip("ipykernel", reason="ipykernel (the dev extra) is not installed")
    nbformat = pytest.importorskip("nbformat", reason="nbformat (the dev extra) is missing")
    nbclient = pytest.importorskip("nbclient", reason="nbclient (the dev extra) is missing")
    stops = ['raise RuntimeError("boom")', "os.kill(os.getpid(), signal.SIGINT)"]
    cells = [STOPPED_CELL.format(work_dir=f"w{i}", stop=stop) for i, stop in enumerate(stops)]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
        store_widget_state=True,
    )
    package = os.path.dirname(os.path.dirname(trainer_logging.__file__))  # this `trainer`
    client.execute(env={**os.environ, "PYTHONPATH": package})
    errors = [
        [out for out in cell.outputs if out["output_type"] == "error"] for cell in notebook.cells
    ]
    assert [[out["ename"] for out in cell] for cell in errors] == [
        ["RuntimeError"],
        ["KeyboardInterrupt"],
    ]
    state = notebook.metadata.get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {"state": {}}
    )
    models = [model["state"] for model in state["state"].values()]
    bars = [m for m in models if m.get("_model_name") == "FloatProgressModel"]
    if bars:  # ipywidgets installed: each cell's widget red where it stopped
        assert [(bar["value"], bar["max"], bar["bar_style"]) for bar in bars] == [
            (14, 100, "danger")
        ] * 2


def test_a_warning_in_a_forked_worker_never_waits_for_the_bars_lock():
    """A DataLoader worker forked while a thread of the parent held tqdm's lock (the checkpoint
    writer's log line, tqdm's monitor) has that lock held forever: it shows warnings as before."""
    shown = []
    hook = ProgressBarHook()
    hook._showwarning = lambda *args, **kwargs: shown.append(args[0])
    hook._pid = os.getpid() + 1  # drawn by another process: this one is a forked worker
    with tqdm.get_lock():  # held, as by the parent's thread at the fork
        worker = threading.Thread(target=hook._show_warning, args=("careful", UserWarning, "f", 1))
        worker.start()
        worker.join(timeout=10)
    assert not worker.is_alive() and shown == ["careful"]
