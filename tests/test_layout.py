"""The package's layout: its layers (``lint-imports``, the contract in pyproject.toml), no lazy
plumbing, what a default run leaves unimported, and every name the docs import from where they
say."""

import ast
import glob
import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import cpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "trainer")
# The imports of the package's own modules that may stand inside a function: heavy optional
# parts only (DCP takes most of a second to import), each with a comment saying so.
IMPORTED_WHEN_USED = {("trainer/checkpoint.py", "sharded_checkpoint")}

DEFAULT_RUN = """
import json, sys, tempfile
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainer import Trainer

class Regressor(nn.Linear):
    def forward(self, batch):
        return nn.functional.mse_loss(super().forward(batch[0]), batch[1])

model = Regressor(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
trainer = Trainer(model, optimizer, None, data, max_epochs=1, work_dir=tempfile.mkdtemp())
trainer.train()
trainer.train()  # resumes from its checkpoint: finished, nothing more to train
print(json.dumps(sorted(sys.modules)))
"""


def modules():
    for path in sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)):
        yield os.path.relpath(path, ROOT), ast.parse(open(path).read())


@pytest.mark.slow  # starts lint-imports, which reads the whole package
def test_every_module_imports_only_the_layers_below_it():
    lint = shutil.which("lint-imports")
    assert lint is not None, 'lint-imports is missing: pip install -e ".[dev]"'
    proc = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 kept, 0 broken" in proc.stdout


def test_no_lazy_plumbing():
    """No module ``__getattr__`` (lazy exports); the package's own modules are imported at the
    top, but for the heavy optional parts named above; no ``_private`` name crosses modules."""
    problems = []
    for path, tree in modules():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                problems.append(f"{path}: a module __getattr__")
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and node.level:
                    names = tuple(a.name for a in node.names)
                    if not any((path, name) in IMPORTED_WHEN_USED for name in names):
                        problems.append(f"{path}:{node.lineno}: imports {names} in a function")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private and not all(name.startswith("__") for name in private):
                    problems.append(f"{path}:{node.lineno}: imports private {private}")
    assert problems == []


@pytest.mark.slow  # a fresh interpreter
def test_a_default_run_leaves_distributed_checkpoint_and_the_trackers_unimported(tmp_path):
    script = tmp_path / "default_run.py"
    script.write_text(textwrap.dedent(DEFAULT_RUN))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=cpu_env(), timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert "trainer.trainer" in loaded and "trainer.checkpoint" in loaded
    assert {"torch.distributed.checkpoint", "trainer.sharded_checkpoint"} & loaded == set()
    # trainer.writers holds MLflowWriter and WandbWriter: the trackers are imported by their use
    assert "trainer.writers" in loaded and {"mlflow", "wandb"} & loaded == set()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = [os.path.join(ROOT, "README.md")] + sorted(
    glob.glob(os.path.join(ROOT, "docs", "*.md"))
)


def documented_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) for every ``from trainer... import ...`` in README.md and docs/*.md,
    in code blocks and in the prose."""
    found = []
    for path in DOC_FILES:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for module, names in re.findall(r"from (trainer[\w.]*) import (\([^)]*\)|[\w, ]+)", text):
            for name in names.strip("()").split(","):
                name = name.split(" as ")[0].strip()
                if name:
                    found.append((os.path.relpath(path, ROOT), module, name))
    return found


def api_reference_names() -> list[str]:
    """The dotted names docs/api.md documents (``::: trainer.hooks.EvalHook``) and their listed
    members."""
    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as f:
        text = f.read()
    names = []
    for name, options in re.findall(r"^::: ([\w.]+)\n((?:    .*\n)*)", text, re.MULTILINE):
        names.append(name)
        members = re.search(r"members: \[([^\]]*)\]", options)
        names += [f"{name}.{m.strip()}" for m in members.group(1).split(",")] if members else []
    return names


def resolve(dotted: str) -> object:
    """The object a dotted name means: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[i:]:
            if isinstance(obj, type) and not hasattr(obj, attribute):  # set in __init__
                source = inspect.getsource(obj.__init__)
                assert re.search(rf"self\.{attribute}\b[^=\n]*=", source), dotted
                return attribute
            obj = getattr(obj, attribute)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_name_the_docs_import_imports_from_there():
    found = documented_imports()
    assert ("docs/distributed.md", "trainer.distributed", "destroy_distributed") in found
    failed = []
    for path, module, name in found:
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            failed.append(f"{path}: from {module} import {name}: {e}")
    assert failed == []


def test_every_name_of_the_api_reference_resolves():
    names = api_reference_names()
    assert "trainer.hooks.EMAHook" in names and "trainer.checkpoint.Checkpointer.wait" in names
    for name in names:
        assert resolve(name) is not None, name


def test_every_public_hook_and_helper_imports_from_the_package():
    import trainer
    from trainer import EMAHook, destroy_distributed, hooks  # noqa: F401

    # the hooks module's every name, and the process-group helpers the docs use
    assert set(hooks.__all__) <= set(trainer.__all__)
    assert {"init_distributed", "destroy_distributed"} <= set(trainer.__all__)
    for name in trainer.__all__:  # each the object its own module defines
        obj = getattr(trainer, name)
        home = importlib.import_module(obj.__module__)
        assert home.__name__.startswith("trainer.") and getattr(home, name) is obj, name
        assert name not in hooks.__all__ or getattr(hooks, name) is obj, name
    assert len(set(trainer.__all__)) == len(trainer.__all__)
