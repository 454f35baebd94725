from setuptools import find_packages, setup

setup(
    name="hooktrainer",  # "trainer" on PyPI is another project; the package is still `trainer`
    version="0.1.0",
    description="A minimal, hook-based PyTorch training loop with no overhead.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    url="https://github.com/trainer-dev/trainer",
    author="The trainer authors",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.9",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
    keywords=["pytorch", "deep learning", "training loop", "trainer", "hooks"],
    packages=find_packages(include=["trainer", "trainer.*"]),
    # py.typed (PEP 561): type checkers read the package's annotations instead of treating
    # every name imported from it as Any
    package_data={"trainer": ["py.typed"]},
    python_requires=">=3.9",
    # tqdm: the progress bar, on a terminal and in a notebook (small, no dependencies of its own)
    install_requires=["torch>=2.4", "numpy", "tensorboard", "tabulate", "tqdm>=4.66"],
    extras_require={
        # setuptools: tests/test_packaging.py builds the wheel with it, without a download
        "dev": [
            "pytest>=7",
            "pytest-timeout",
            # pytest -n 2 (pyproject's addopts): the slow tests wait on processes, side by side
            "pytest-xdist>=3",
            "ruff",
            "mypy",
            # lint-imports: the layers contract in pyproject.toml (tests/test_layout.py)
            "import-linter>=2.1",
            "setuptools>=70.1",
            "torchdata>=0.8",
            # the tracker writers' tests: MLflow's SQLite store (as the mlflow extra), W&B
            # offline, whose files the tests read with `wandb leet inspect`
            "mlflow-skinny>=3.0",
            "sqlalchemy>=1.4,<3",
            "alembic<2,!=1.10.0",
            "wandb>=0.31",
            # tests/test_transformers.py: Hugging Face models trained as they are (checked with
            # 4.46.3 and 5.24.0)
            "transformers>=4.46",
            # a notebook run in a Jupyter kernel, its progress bar a widget
            "nbclient",
            "ipykernel",
            "ipywidgets",
        ],
        "examples": ["scikit-learn"],
        # `mkdocs build --strict` builds the site in docs/ (.ci/run does)
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
        # StatefulDataLoader: checkpointed through its own state, IterableDatasets included
        "torchdata": ["torchdata>=0.8"],
        # trainer.writers.MLflowWriter: MLflow's client (the full `mlflow` package includes it),
        # and what its SQLite store, the one MLflow recommends and its default, needs beside it
        # (the full package's pins)
        "mlflow": ["mlflow-skinny>=3.0", "sqlalchemy>=1.4,<3", "alembic<2,!=1.10.0"],
        # trainer.writers.WandbWriter: a resumed run rewinds the W&B run (resume_from, 0.17.1)
        "wandb": ["wandb>=0.17.1"],
    },
)
