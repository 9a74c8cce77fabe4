import pytest
import torch

import pyg_maxk
from helpers import assert_same_selection
from pyg_maxk import CBSR, index_dtype_for
from pyg_maxk.nn import MaxK


def test_maxk_matches_topk_and_cbsr_layout():
    x = torch.randn(20, 64)
    with pyg_maxk.use_backend("torch"):
        h = pyg_maxk.maxk(x, 7)
    values, idx = torch.topk(x, 7, dim=1)
    assert h.values.shape == (20, 7) and h.indices.dtype == torch.uint8
    torch.testing.assert_close(h.values, values)
    assert torch.equal(h.indices.long(), idx)
    dense = h.to_dense()
    assert (dense != 0).sum(1).eq(7).all()
    torch.testing.assert_close(dense.gather(1, idx), values)


def test_maxk_on_cpu_keeps_topk_entries_in_column_order():
    # The default backend for CPU tensors is the Numba CPU select kernel.
    x = torch.randn(20, 64)
    h = pyg_maxk.maxk(x, 7)
    assert h.values.shape == (20, 7) and h.indices.dtype == torch.uint8
    assert_same_selection(h, x, 7)
    dense = h.to_dense()
    assert (dense != 0).sum(1).eq(7).all()
    torch.testing.assert_close(dense.sort(1, descending=True).values[:, :7],
                               torch.topk(x, 7, dim=1).values)


def test_maxk_ties_follow_topk():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0]] * 3)
    with pyg_maxk.use_backend("torch"):
        h = pyg_maxk.maxk(x, 2)
    assert torch.equal(h.indices.long(), torch.topk(x, 2, dim=1).indices)
    with pyg_maxk.use_backend("cpu"):  # ties: the lowest columns, in column order
        assert pyg_maxk.maxk(x, 2).indices.long().tolist() == [[1, 2]] * 3


def test_gradient_flows_to_kept_entries_only():
    x = torch.randn(5, 10, requires_grad=True)
    h = pyg_maxk.maxk(x, 3)
    h.to_dense().sum().backward()
    mask = torch.zeros_like(x).scatter(1, h.long_indices(), 1.0)
    assert torch.equal(x.grad, mask)


@pytest.mark.parametrize("dim,dtype", [(1, torch.uint8), (256, torch.uint8),
                                       (257, torch.int16), (32768, torch.int16),
                                       (32769, torch.int32)])
def test_index_dtype(dim, dtype):
    assert index_dtype_for(dim) == dtype


def test_k_at_least_dim_is_identity():
    x = torch.randn(4, 6, requires_grad=True)
    h = pyg_maxk.maxk(x, 6)
    assert h.is_full and h.values is x
    assert torch.equal(pyg_maxk.maxk(x, 100).to_dense(), x)


@pytest.mark.parametrize("k", [0, -1, 2.0, True, "3", None])
def test_bad_k(k):
    with pytest.raises(ValueError):
        pyg_maxk.maxk(torch.randn(3, 4), k)


def test_bad_features():
    with pytest.raises(ValueError, match="2-D"):
        pyg_maxk.maxk(torch.randn(4), 2)
    with pytest.raises(TypeError, match="floating"):
        pyg_maxk.maxk(torch.ones(3, 4, dtype=torch.long), 2)


def test_dropout_acts_on_kept_values():
    torch.manual_seed(0)
    x = torch.randn(50, 16)
    h = pyg_maxk.maxk(x, 4, dropout=0.5, training=True)
    ref = pyg_maxk.maxk(x, 4)
    assert torch.equal(h.indices, ref.indices)
    kept = h.values != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(h.values[kept], 2 * ref.values[kept])
    assert torch.equal(pyg_maxk.maxk(x, 4, dropout=0.5, training=False).values, ref.values)


def test_cbsr_validation_and_helpers():
    with pytest.raises(ValueError):
        CBSR(torch.randn(3, 2), torch.zeros(3, 3, dtype=torch.uint8), 8)
    with pytest.raises(TypeError):
        CBSR(torch.randn(3, 2), torch.zeros(3, 2), 8)
    with pytest.raises(ValueError):
        CBSR(torch.randn(3, 5), torch.zeros(3, 5, dtype=torch.uint8), 4)
    h = pyg_maxk.maxk(torch.randn(3, 8), 2)
    base = torch.randn(3, 8)
    expected = base + 2 * h.to_dense()
    torch.testing.assert_close(h.add_to(base, 2.0), expected)
    assert h.add_to(base, 2.0, inplace=True) is base
    torch.testing.assert_close(base, expected)
    assert "k=2" in repr(h) and h.shape == (3, 8)


def test_maxk_module():
    m = MaxK(3)
    x = torch.randn(4, 9)
    assert torch.equal(m(x), pyg_maxk.maxk(x, 3).to_dense())
    assert isinstance(MaxK(3, sparse_output=True)(x), CBSR)
    assert "k=3" in repr(m)
    with pytest.raises(ValueError):
        MaxK(0)


def test_cbsr_linear_matches_dense_linear_and_saves_no_dense_input():
    torch.manual_seed(0)
    x = torch.randn(40, 24, dtype=torch.float64)
    weight = torch.randn(7, 24, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    h = pyg_maxk.maxk(x.clone().requires_grad_(), 5)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        out = pyg_maxk.ops.cbsr_linear(h, weight, bias)
    assert torch.Size([40, 24]) not in saved  # only the [40, 5] CBSR and the weight
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (h.values, weight, bias), g)
    ref_out = torch.nn.functional.linear(h.to_dense(), weight, bias)
    ref = torch.autograd.grad(ref_out, (h.values, weight, bias), g)
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b)
    full = pyg_maxk.maxk(x, 24)  # k == dim: a plain linear
    torch.testing.assert_close(pyg_maxk.ops.cbsr_linear(full, weight),
                               torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_cbsr_linear_adds_a_dense_product(backend):
    """SAGE's two linear maps in one op: ``h W^T + b + dense V^T``, with the
    gradients of every operand."""
    torch.manual_seed(0)
    dtype = torch.float64
    x = torch.randn(30, 24, dtype=dtype)
    h = pyg_maxk.maxk(x.clone().requires_grad_(), 5)
    weight = torch.randn(7, 24, dtype=dtype, requires_grad=True)
    bias = torch.randn(7, dtype=dtype, requires_grad=True)
    dense = torch.randn(30, 11, dtype=dtype, requires_grad=True)
    dense_weight = torch.randn(7, 11, dtype=dtype, requires_grad=True)
    with pyg_maxk.use_backend(backend):
        out = pyg_maxk.ops.cbsr_linear(h, weight, bias, dense=dense, dense_weight=dense_weight)
    ref_out = (torch.nn.functional.linear(h.to_dense(), weight, bias)
               + dense @ dense_weight.t())
    torch.testing.assert_close(out, ref_out)
    inputs = (h.values, weight, bias, dense, dense_weight)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(ref_out, inputs, g)):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="together"):
        pyg_maxk.ops.cbsr_linear(h, weight, bias, dense=dense)
