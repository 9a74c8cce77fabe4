"""The benchmarks' own probes measure what they say they measure."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from overhead import STEP_MODELS, _identity_propagate  # noqa: E402

from helpers import random_edge_index  # noqa: E402


@pytest.mark.parametrize("kind", sorted(STEP_MODELS))
def test_identity_propagate_removes_every_aggregation_and_is_undone(kind):
    # The floor "stock without message passing": with PyG's propagate as the
    # identity on each conv the step no longer depends on the graph (PyG
    # generates a propagate per conv class, which a patch of
    # MessagePassing.propagate would miss), and afterwards it does again.
    torch.manual_seed(0)
    model = STEP_MODELS[kind](8, 16, 2, 3, k=None)
    x = torch.randn(20, 8)
    one, other = random_edge_index(20, 20, 60, seed=1), random_edge_index(20, 20, 60, seed=2)
    before = model(x, one)
    assert not torch.allclose(before, model(x, other))
    with _identity_propagate(model):
        torch.testing.assert_close(model(x, one), model(x, other))
    assert all("propagate" not in conv.__dict__ for conv in model.convs)
    torch.testing.assert_close(model(x, one), before)
