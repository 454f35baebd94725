"""The distribution is one people can adopt: its wheel ships ``py.typed``, so a user's mypy
checks their calls against trainer's annotations; it is licensed (Apache 2.0) and says so, with
its author, home page and classifiers, in its metadata."""

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt, byte for byte
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
COPYRIGHT = "Copyright 2026 The trainer authors\n"

# A user's script: the expression of each reveal_type, and the type mypy must reveal for it
# (mypy 2 writes `int` where older versions write `builtins.int`, `X | None` for Union[X, None])
B = r"(builtins\.)?"
REVEALED = {
    "trainer": r"trainer\.trainer\.Trainer",
    "trainer.cur_iter": B + "int",
    "trainer.lr": B + "float",
    "trainer.train": rf"def \(resume_from_checkpoint: .*str.* =, auto_resume: {B}bool =, "
    rf"continue_after_stop: {B}bool =\)",
    "trainer.evaluate": rf"def \(data_loader: Any, metric_fn: .*\) -> {B}dict\[{B}str, {B}float\]",
    "trainer.metric_storage": r"trainer\.metric_storage\.MetricStorage",
    "EvalHook(1, lambda: {'acc': 1.0})": r"trainer\.hooks\.eval_hook\.EvalHook",
}
USER_SCRIPT = """\
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer import Trainer
from trainer.hooks import EvalHook

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
trainer = Trainer(model, optimizer, None, loader, max_epochs=1)
trainer.train(auto_resume="yes")  # line 11: mypy flags it only if it sees train()'s signature
"""
# Only trainer is followed: analysing torch takes mypy ~15 s (MLflow and W&B, which
# trainer.writers imports when used, ~20 s more), and trainer's own types are the point. silent:
# a user is not shown errors inside an installed package.
MYPY_INI = """\
[mypy]
follow_imports = silent
[mypy-torch.*,numpy.*,tensorboard.*,tabulate.*,mlflow.*,wandb.*]
follow_imports = skip
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    """The wheel `pip wheel .` builds, from a copy of the sources (the build leaves `build/`
    and `*.egg-info` behind, which stay out of the checkout this way), with the environment's
    setuptools: no download."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(
        os.path.join(ROOT, "trainer"), src / "trainer",
        ignore=shutil.ignore_patterns("__pycache__"),
    )  # fmt: skip
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
         "-q", "-w", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = (tmp / "dist").glob("hooktrainer-*.whl")
    return str(path)


def run_mypy(site, tmp_path) -> tuple[str, dict[str, str]]:
    """mypy's output on USER_SCRIPT, with ``site`` on the path as an installed package's folder
    (mypy uses a package found on sys.path only if it has a ``py.typed``), and the type it
    revealed for each expression of REVEALED."""
    tmp_path.mkdir()
    lines = USER_SCRIPT.splitlines() + [f"reveal_type({expr})" for expr in REVEALED]
    (tmp_path / "user.py").write_text("\n".join(lines) + "\n")
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", ".mypy_cache",
         "--no-color-output", "--no-error-summary", "user.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    revealed = {}
    for line in output.splitlines():
        match = re.fullmatch(r'user\.py:(\d+): note: Revealed type is "(.*)"', line)
        if match:
            revealed[lines[int(match.group(1)) - 1][len("reveal_type(") : -1]] = match.group(2)
    assert set(revealed) == set(REVEALED), output
    return output, revealed


@pytest.mark.slow  # builds a wheel in a process of its own
def test_the_wheel_ships_py_typed_and_the_license(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        assert "trainer/py.typed" in names
        # dist-info/licenses/LICENSE (metadata 2.4) or dist-info/LICENSE (older setuptools)
        (license_file,) = [
            n for n in names if re.fullmatch(r"[^/]+\.dist-info/(licenses/)?LICENSE", n)
        ]
        with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
            assert whl.read(license_file) == f.read()


@pytest.mark.slow  # builds a wheel and runs mypy, each in a process of its own
def test_mypy_checks_a_users_script_against_trainers_types(wheel, tmp_path):
    pytest.importorskip("mypy")
    site = tmp_path / "site"  # the wheel installed: what `pip install hooktrainer` puts there
    zipfile.ZipFile(wheel).extractall(site)
    output, revealed = run_mypy(site, tmp_path / "typed")
    for expr, pattern in REVEALED.items():
        assert re.fullmatch(pattern, revealed[expr]), (expr, revealed[expr], output)
    assert re.search(
        r'user\.py:11: error: Argument "auto_resume" .* "str"; expected "bool"', output
    ), output
    assert "import-untyped" not in output and "import-not-found" not in output, output

    # The control: without py.typed mypy skips the package, and everything from it is Any
    os.remove(site / "trainer" / "py.typed")
    output, revealed = run_mypy(site, tmp_path / "untyped")
    assert set(revealed.values()) == {"Any"}, output
    assert "missing library stubs or py.typed marker" in output, output


def test_the_installed_distribution_says_license_author_home_and_classifiers():
    meta = importlib.metadata.metadata("hooktrainer")
    assert meta["License"] == "Apache-2.0"
    assert meta["Author"] == "The trainer authors"
    assert meta["Home-page"] or meta.get_all("Project-URL")
    assert meta["Requires-Python"] == ">=3.9"
    assert "LICENSE" in meta.get_all("License-File")
    classifiers = meta.get_all("Classifier")
    for classifier in (
        "License :: OSI Approved :: Apache Software License",
        "Development Status :: 3 - Alpha",
        "Programming Language :: Python :: 3 :: Only",
        "Typing :: Typed",
    ):
        assert classifier in classifiers
    # a classifier for each Python version python_requires lets in, 3.9 and up
    versions = [c.rsplit(" :: ", 1)[1] for c in classifiers if re.search(r":: 3\.\d+$", c)]
    assert versions[0] == "3.9" and versions == [
        f"3.{minor}" for minor in range(9, 9 + len(versions))
    ]


def test_license_is_the_apache_2_0_text_under_the_copyright_line():
    with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        text = f.read()
    assert text.startswith(COPYRIGHT.encode())
    assert hashlib.sha256(text[len(COPYRIGHT) :]).hexdigest() == APACHE_2_0_SHA256
