from setuptools import find_packages, setup

setup(
    name="hooktrainer",  # "trainer" on PyPI is another project; the package is still `trainer`
    version="0.1.0",
    description="A minimal, hook-based PyTorch training loop with no overhead.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["trainer", "trainer.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy", "tensorboard", "tabulate"],
    extras_require={
        "dev": ["pytest>=7", "pytest-timeout", "ruff", "torchdata>=0.8"],
        "examples": ["scikit-learn"],
        # `mkdocs build --strict` builds the site in docs/ (.ci/run does)
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
        # StatefulDataLoader: checkpointed through its own state, IterableDatasets included
        "torchdata": ["torchdata>=0.8"],
    },
)
