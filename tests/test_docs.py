"""Every ```python block of README.md and docs/*.md runs; the loop's pseudocode and the table of
Trainer arguments in docs/ match the code.

A block runs in a fresh namespace, in a temporary current directory (so a default or relative
``work_dir`` never lands in the repository). An HTML comment on the line before the block (a
blank line between is allowed) says more, in words separated by spaces:

- ``setup``: first run SETUP below (``Net``/``MyModel``, ``dataset``, ``loader``,
  ``train_loader``, ``val_loader``, ``test_loader``, ``accuracy``, ``model``, ``optimizer``,
  ``scheduler``, ``my_iterable_dataset``, and the usual imports);
- ``trained``: with ``setup``, also a finished run in ``other_run`` and ``ddp_weights.pth``, a
  state_dict with DDP's ``module.`` prefix;
- ``continue``: run in the namespace of the block before it in the same file;
- ``stub:NAME``: a stand-in module ``NAME`` (``wandb``) that records what it is given;
- ``needs:NAME``: skipped where the optional module ``NAME`` (``transformers``) is missing;
- ``torchrun``: run the block as a script under torchrun, 2 CPU processes;
- ``skip (why)``: compile only (what needs CUDA, or torchrun with a model of its own);
- ``hook order`` and ``arguments table``: checked by the tests at the end of this file.

Blocks are tested in files' order; a block and the ``continue`` blocks after it are one test.
"""

import inspect
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from trainer import Trainer

from conftest import Recorder, communicate, cpu_env, popen, torchrun_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
    if name.endswith(".md")
)  # fmt: skip
WORDS = {"setup", "trained", "continue", "torchrun", "skip", "hook", "order", "arguments", "table"}

SETUP = """
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from trainer import Trainer
from trainer.hooks import EvalHook


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, batch):
        x, y = (t.to(self.body[0].weight.device) for t in batch)
        return nn.functional.cross_entropy(self.body(x), y)


MyModel = Net
torch.manual_seed(0)
centres = torch.randn(10, 64)
y = torch.randint(0, 10, (768,))
x = centres[y] + 0.5 * torch.randn(768, 64)
dataset = TensorDataset(x[:512], y[:512])
train_loader = loader = DataLoader(dataset, batch_size=32, shuffle=True)
val_loader = DataLoader(TensorDataset(x[512:640], y[512:640]), batch_size=64)
test_loader = DataLoader(TensorDataset(x[640:], y[640:]), batch_size=64)


def accuracy(model, batch):
    x, y = batch
    return {"acc": (model.body(x).argmax(1) == y).float()}


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(512):
            yield x[i], y[i]


my_iterable_dataset = Stream()
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
"""

TRAINED = """
_model = Net()
_optimizer = torch.optim.SGD(_model.parameters(), lr=0.1)
Trainer(_model, _optimizer, None, loader, max_epochs=10, work_dir="other_run").train()
torch.save({"module." + k: v for k, v in _model.state_dict().items()}, "ddp_weights.pth")
"""


class Block:
    def __init__(self, path, line, code, words):
        self.path, self.line, self.code, self.words = path, line, code, words

    @property
    def id(self):
        return f"{self.path}:{self.line}"


def blocks(path):
    """The ```python blocks of a file, each with the words of the comment before it."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().split("\n")
    found, i = [], 0
    while i < len(lines):
        if lines[i].strip().startswith("```python"):
            start = i
            i += 1
            while not lines[i].strip().startswith("```"):
                i += 1
            before = [line for line in lines[:start] if line.strip()][-1:]
            match = re.fullmatch(r"<!-- test: (.*) -->", before[0].strip()) if before else None
            words = match.group(1).split() if match else []
            if "skip" in words:  # the reason follows
                words = words[: words.index("skip") + 1]
            unknown = [w for w in words if w not in WORDS and not w.startswith(("stub:", "needs:"))]
            assert not unknown, f"{path}:{start + 1}: unknown test words {unknown}"
            found.append(Block(path, start + 1, "\n".join(lines[start + 1 : i]) + "\n", words))
        i += 1
    return found


def chains():
    """Each block with the ``continue`` blocks that follow it."""
    result = []
    for path in DOCS:
        for block in blocks(path):
            if "continue" in block.words:
                assert result and result[-1][0].path == path, f"{block.id}: nothing to continue"
                result[-1].append(block)
            else:
                result.append([block])
    return result


CHAINS = chains()


def stub_module(name):
    """A module whose every function records its call and returns a stand-in that does too."""
    calls = []

    class Recorder:
        def __init__(self, path):
            self.path = path

        def __getattr__(self, attr):
            return Recorder(f"{self.path}.{attr}")

        def __call__(self, *args, **kwargs):
            calls.append((self.path, args, kwargs))
            return Recorder(f"{self.path}()")

    module = types.ModuleType(name)
    module.__getattr__ = lambda attr: Recorder(f"{name}.{attr}")
    module.calls = calls
    return module


@pytest.mark.parametrize(
    "chain",
    [
        # a block run under torchrun starts processes: in the slow set
        pytest.param(chain, marks=pytest.mark.slow) if "torchrun" in chain[0].words else chain
        for chain in CHAINS
    ],
    ids=[chain[0].id for chain in CHAINS],
)
def test_code_block_runs(chain, tmp_path, monkeypatch):
    before = files_under(os.path.join(ROOT, "work_dir"))
    run_chain(chain, tmp_path, monkeypatch)
    # A run of the example (README's first command) may have left work_dir/ in the checkout:
    # the blocks neither create it nor change what is in it.
    assert files_under(os.path.join(ROOT, "work_dir")) == before


def files_under(folder):
    """Each file under ``folder`` with its size and modification time (empty if none)."""
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            stat = os.stat(os.path.join(parent, name))
            found[os.path.join(parent, name)] = (stat.st_size, stat.st_mtime_ns)
    return found


def run_chain(chain, tmp_path, monkeypatch):
    first = chain[0]
    if {"skip", "hook", "arguments"} & set(first.words):
        for block in chain:
            compile(block.code, block.id, "exec")
        return
    for word in first.words:
        if word.startswith("needs:"):
            pytest.importorskip(word[6:])
    monkeypatch.chdir(tmp_path)
    if "torchrun" in first.words:
        script = tmp_path / "train.py"
        script.write_text(first.code)
        cmd = torchrun_command("--nproc_per_node", "2", str(script))
        proc = popen(
            cmd, cwd=tmp_path, env=cpu_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _, stderr = communicate(proc, timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        return
    stubs = {}
    for word in first.words:
        if word.startswith("stub:"):
            stubs[word[5:]] = stub_module(word[5:])
            monkeypatch.setitem(sys.modules, word[5:], stubs[word[5:]])
    namespace = {"__name__": "__main__"}
    if "setup" in first.words or "trained" in first.words:
        exec(compile(SETUP, "SETUP", "exec"), namespace)
    if "trained" in first.words:
        exec(compile(TRAINED, "TRAINED", "exec"), namespace)
    for block in chain:
        exec(compile(block.code, block.id, "exec"), namespace)
    for name, module in stubs.items():
        assert module.calls, f"{first.id} never called {name}"


def test_every_python_block_is_collected():
    for path in DOCS:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            count = len(re.findall(r"^```python", f.read(), re.MULTILINE))
        assert count == len(blocks(path)), path


# ----------------------------------------------------------------------------------------------
# The loop's pseudocode against a real run


def marked_block(path, word):
    (block,) = [b for b in blocks(path) if word in b.words]
    return block.code


def shape(events):
    """What the pseudocode says of each event: its epoch for epoch events, its epoch and
    iteration for iteration events."""
    out = []
    for name, epoch, it in events:
        if name in ("before_train", "after_train"):
            out.append((name,))
        elif name in ("before_epoch", "after_epoch"):
            out.append((name, epoch))
        else:
            out.append((name, epoch, it))
    return out


def test_the_loop_pseudocode_calls_what_a_real_run_calls(make_trainer):
    recorder = Recorder()
    trainer = make_trainer(max_epochs=3)  # 8 iterations per epoch
    trainer.register_hook(recorder)
    original = trainer.train_one_iter
    trainer.train_one_iter = lambda: (recorder._record("train_one_iter"), original())
    trainer.train()

    events = []
    namespace = {}

    class Calls:
        def __getattr__(self, name):
            return lambda: events.append((name, namespace.get("epoch"), namespace.get("iter")))

    namespace.update(hooks=Calls(), trainer=Calls(), start_epoch=0, max_epochs=3, epoch_iters=8)
    exec(marked_block("docs/loop.md", "hook"), namespace)
    assert shape(events) == shape(recorder.events)


# ----------------------------------------------------------------------------------------------
# The Lightning port against the loop Lightning runs


def test_the_lightning_port_trains_bit_equal_to_lightnings_automatic_optimization(
    tmp_path, monkeypatch
):
    """docs/coming-from-lightning.md's autoencoder, trained by the Trainer, against what
    Lightning's automatic optimization does for each batch (zero_grad, training_step, backward,
    step) from the same seed, data and data order."""
    monkeypatch.chdir(tmp_path)
    (port,) = [b for b in blocks("docs/coming-from-lightning.md") if "class AutoEncoder" in b.code]
    ported = {"__name__": "__main__"}
    exec(compile(port.code, port.id, "exec"), ported)
    setup, _ = port.code.split("trainer = Trainer(")  # the seed, data, model and optimizer
    by_hand = {"__name__": "__main__"}
    exec(compile(setup, port.id, "exec"), by_hand)
    model, optimizer = by_hand["autoencoder"], by_hand["optimizer"]
    for _ in range(ported["trainer"].max_epochs):
        for batch in by_hand["train_loader"]:
            optimizer.zero_grad()
            loss = model(batch)  # the LightningModule's training_step
            loss.backward()
            optimizer.step()
    assert ported["trainer"].cur_iter + 1 == 16  # two epochs of 8 batches
    trained = dict(ported["autoencoder"].named_parameters())
    for name, parameter in model.named_parameters():
        assert torch.equal(trained[name], parameter), name


# ----------------------------------------------------------------------------------------------
# The table of Trainer arguments against the signature


def test_the_arguments_table_lists_the_signature_in_order_with_its_defaults():
    with open(os.path.join(ROOT, "docs", "arguments.md"), encoding="utf-8") as f:
        page = f.read()
    table = page[page.index("<!-- test: arguments table -->") :].split("\n\n")[1]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", table, re.MULTILINE)
    parameters = list(inspect.signature(Trainer.__init__).parameters.values())[1:]
    documented = [(name, default.strip()) for name, default in rows]
    actual = [
        (p.name, "required" if p.default is inspect.Parameter.empty else f"`{p.default!r}`")
        for p in parameters
    ]
    assert documented == actual, "docs/arguments.md's table differs from Trainer.__init__"
    # the positional ones, as the page's first line spells the signature
    positional = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    spelled = ", ".join(
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in positional
    )
    assert f"`Trainer({spelled}, *, ...)`" in page.replace("\n", " ")


# ----------------------------------------------------------------------------------------------
# README's links into docs/ (MkDocs checks the links between the pages themselves)


def anchors(path):
    """The anchors of a page's headings, as MkDocs and GitHub make them."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        headings = re.findall(r"^#+ (.*)$", f.read(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}


def test_readme_links_into_docs_resolve():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", f.read())
    assert links
    for path, anchor in links:
        assert os.path.exists(os.path.join(ROOT, path)), path
        assert not anchor or anchor in anchors(path), f"{path}#{anchor}"


# ----------------------------------------------------------------------------------------------
# The API page: the docstrings' cross-references are links


@pytest.mark.slow  # starts mkdocs
def test_api_page_renders_cross_references_as_links_that_resolve(tmp_path):
    """Docstrings cross-reference in mkdocs-autorefs' syntax (``[`state_dict`][]``, resolved
    from where the docstring stands): on the built API page each is a link to an anchor of the
    page, and no Sphinx role (``:meth:`x```) is left as raw text."""
    pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]  # strict: an unresolved reference fails
    page = (tmp_path / "api" / "index.html").read_text(encoding="utf-8")
    assert re.findall(r":(?:meth|class|func|attr|mod|exc|data|obj):<code>", page) == []
    links = re.findall(r'<a class="autorefs[^"]*"[^>]*href="([^"]*)"', page)
    anchors_on_page = set(re.findall(r' id="([^"]+)"', page))
    assert len(links) > 60
    assert {link for link in links if link.lstrip("#") not in anchors_on_page} == set()
    # a method's docstring names a method of its class: the link goes to that method
    restore = page.split('id="trainer.hooks.HookBase.load_state_dict"', 1)[1]
    assert restore.split("</p>", 1)[0].count('href="#trainer.hooks.HookBase.state_dict"') == 1
