"""What of cuda_graph=True can be checked without a GPU (the rest is in test_cuda.py)."""

import collections

import pytest
import torch
from torch import nn

from trainer.cuda_graph import _flatten, _unflatten, check_graphable

from conftest import TinyModel


def test_cuda_graph_refuses_what_it_cannot_capture(make_trainer):
    with pytest.raises(ValueError, match="needs a model on a CUDA device, got cpu"):
        make_trainer(cuda_graph=True)
    cuda = torch.device("cuda")
    model = TinyModel()
    plain_sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"capturable=True \(SGD: fused=True\), got SGD"):
        check_graphable(model, plain_sgd, cuda, float16_scaler=False)
    check_graphable(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True), cuda, False)
    fused_only = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    with pytest.raises(ValueError, match="capturable=True .*got Adam"):
        check_graphable(model, fused_only, cuda, float16_scaler=False)
    capturable = torch.optim.Adam(model.parameters(), lr=0.1, capturable=True)
    check_graphable(model, capturable, cuda, float16_scaler=False)  # fine
    with pytest.raises(ValueError, match="float16 AMP needs fused=True"):
        check_graphable(model, capturable, cuda, float16_scaler=True)
    with pytest.raises(ValueError, match="not support a DataParallel model"):
        check_graphable(nn.DataParallel(model), capturable, cuda, float16_scaler=False)


def test_cuda_graph_batch_layouts_round_trip():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"pair": Pair(torch.ones(2, 3), torch.zeros(2)), "ids": [torch.arange(2)], "k": 7}
    tensors, layout = _flatten([batch])
    assert len(tensors) == 3
    rebuilt = _unflatten(layout, iter(tensors))[0]
    assert isinstance(rebuilt["pair"], Pair) and rebuilt["k"] == 7
    assert rebuilt["pair"].x is tensors[0] and rebuilt["ids"][0] is tensors[2]
    partial = {"pair": Pair(torch.ones(1, 3), torch.zeros(1)), "ids": [torch.arange(1)], "k": 7}
    assert _flatten([partial])[1] != layout
    assert _flatten([{**batch, "pair": Pair(torch.ones(2, 3), torch.ones(2))}])[1] == layout
