import torch

from trainer import collect_env


def test_collect_env_is_a_table_with_versions():
    table = collect_env()
    assert torch.__version__ in table
    assert "CUDA available" in table and "numpy" in table
