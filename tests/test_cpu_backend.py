"""The "cpu" backend (Numba parallel CPU kernels): kernels against float64
references and torch.topk, the layer contract, and float64 gradients."""
import pytest
import torch

import pyg_maxk
from helpers import (
    FORMS,
    K,
    N,
    adjacency,
    assert_same_as_stock,
    assert_same_selection,
    assert_ties_keep_lowest_columns,
    few_valued_rows,
    make_pair,
    random_edge_index,
    random_features,
    random_weights,
)
from pyg_maxk import CBSR, CSRGraph
from pyg_maxk.graph import unpack
from pyg_maxk.ops import cpu_ops


def random_cbsr(num_rows, dim, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    values, idx = torch.randn(num_rows, dim, generator=g, dtype=dtype).topk(k, dim=1)
    return CBSR(values, idx.to(pyg_maxk.index_dtype_for(dim)), dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalization,size,dim,k", [
    ("sum", (30, 30), 40, 6), ("mean", (17, 9), 300, 7), ("gcn", (25, 25), 20, 19),
    ("sum", (5, 4), 16, 3)])
def test_kernels_against_float64(dtype, normalization, size, dim, k):
    num_edges = 0 if size == (5, 4) else 160
    ei = random_edge_index(*size, num_edges, seed=1)
    w = torch.rand(num_edges) + 0.1 if normalization != "mean" else None
    graph = CSRGraph.from_adj(ei, size, edge_weight=w, normalization=normalization)
    h = random_cbsr(size[0], dim, k, dtype)
    values = h.values.clone().requires_grad_()
    with pyg_maxk.use_backend("cpu"):
        out = pyg_maxk.aggregate(graph, h.with_values(values))
    a = graph.torch_csr(torch.float64)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out.double(), torch.sparse.mm(a, h.to_dense().double()), **tol)
    grad_out = torch.randn(size[1], dim, dtype=dtype)
    out.backward(grad_out)
    ref = torch.sparse.mm(a.t().to_sparse_csr(), grad_out.double()).gather(1, h.long_indices())
    torch.testing.assert_close(values.grad.double(), ref, **tol)


def test_aggregation_kernels_write_every_entry():
    # The outputs start poisoned: the kernels zero each row themselves,
    # rows without edges included.
    from pyg_maxk.kernels import cpu
    ei = random_edge_index(12, 10, 30, seed=4)
    graph = CSRGraph.from_adj(ei, (12, 10), normalization="sum")
    ops = unpack(*graph.operands(4))
    h = random_cbsr(12, 40, 4, torch.float32)
    out = torch.full((10, 40), float("nan"))
    one = torch.ones(1)
    cpu.spgemm_rows(ops.rowptr.numpy(), ops.col.numpy(), one.numpy(), False, h.values.numpy(),
                    h.indices.numpy(), out.numpy())
    a = graph.torch_csr(torch.float64)
    # float32 sums against float64 ones: float32's rounding (the kernels'
    # vectorised order differs between CPUs).
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), torch.sparse.mm(a, h.to_dense().double()), **tol)
    grad_out = torch.randn(10, 40)
    grad = torch.full((12, 4), float("nan"))
    cpu.sspmm_rows(ops.colptr.numpy(), ops.row_t.numpy(), one.numpy(), False, h.indices.numpy(),
                   grad_out.numpy(), grad.numpy())
    ref = torch.sparse.mm(a.t().to_sparse_csr(), grad_out.double()).gather(1, h.long_indices())
    torch.testing.assert_close(grad.double(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_scale,with_dense", [(False, False), (True, True), (False, True)])
def test_fused_forward_kernel_against_float64(dtype, with_scale, with_dense):
    # maxk_aggregate_rows (select, dropout scale, dense form, aggregation in
    # one call) writes every entry of its poisoned outputs: the selection
    # torch.topk keeps, the scaled values, and their sums over a weighted
    # graph of more sources than targets (rows without edges included).
    from pyg_maxk.kernels import cpu
    ei = random_edge_index(14, 10, 12, seed=6)
    graph = CSRGraph.from_adj(ei, (14, 10), edge_weight=torch.rand(12) + 0.1,
                              normalization="sum", dtype=dtype)
    ops = unpack(*graph.operands(5))
    assert bool((ops.rowptr[1:] == ops.rowptr[:-1]).any())
    x = random_features(14, 24, dtype=dtype, seed=2)
    scale = (torch.rand(14, 5, generator=torch.Generator().manual_seed(3)) < 0.6).to(dtype) / 0.6
    values = torch.full((14, 5), float("nan"), dtype=dtype)
    indices = torch.full((14, 5), -1, dtype=pyg_maxk.index_dtype_for(24))
    dense = torch.full((14, 24), float("nan"), dtype=dtype)
    out = torch.full((10, 24), float("nan"), dtype=dtype)
    cpu.maxk_aggregate_rows(x.numpy(), 5, scale.numpy(), with_scale, values.numpy(),
                            indices.numpy(), dense.numpy(), with_dense, ops.rowptr.numpy(),
                            ops.col.numpy(), ops.weight.numpy(), True, out.numpy())
    h = CBSR(values, indices, 24)
    assert_same_selection(CBSR(x.gather(1, indices.long()), indices, 24), x, 5)
    expected_values = x.gather(1, indices.long()) * (scale if with_scale else 1)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=0)
    if with_dense:
        torch.testing.assert_close(dense, h.to_dense(), rtol=0, atol=0)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    expected = torch.sparse.mm(graph.torch_csr(torch.float64), h.to_dense().double())
    torch.testing.assert_close(out.double(), expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalization", ["sum", "gcn"])
@pytest.mark.parametrize("given", ["agg", "agg,values,dense", "values", "dense", "agg,dense",
                                   "agg,values,dense,scale"])
def test_features_gradient_kernel_against_float64(dtype, normalization, given):
    # MaxK + aggregation's gradient w.r.t. the features in one kernel: the
    # SSpMM, the sum with the CBSR's and the dense form's gradients, the
    # dropout's scale, and densify; every entry of a poisoned output written.
    from pyg_maxk.kernels import cpu
    size, dim, k = ((14, 11) if normalization == "sum" else (14, 14)), 40, 5
    ei = random_edge_index(*size, 50, seed=2)
    w = torch.rand(50) + 0.1 if normalization == "gcn" else None
    graph = CSRGraph.from_adj(ei, size, edge_weight=w, normalization=normalization)
    ops = unpack(*graph.operands(k))
    h = random_cbsr(size[0], dim, k, dtype)
    g = torch.Generator().manual_seed(3)
    grads = {"agg": torch.randn(size[1], dim, generator=g, dtype=dtype),
             "values": torch.randn(size[0], k, generator=g, dtype=dtype),
             "dense": torch.randn(size[0], dim, generator=g, dtype=dtype),
             "scale": torch.randint(0, 2, (size[0], k), generator=g).to(dtype) * 2}
    present = {name: grads[name] if name in given.split(",") else None for name in grads}
    a = graph.torch_csr(torch.float64)
    kept = torch.zeros(size[0], k, dtype=torch.float64)
    if present["agg"] is not None:
        kept += torch.sparse.mm(a.t().to_sparse_csr(), grads["agg"].double()).gather(
            1, h.long_indices())
    if present["values"] is not None:
        kept += grads["values"].double()
    if present["dense"] is not None:
        kept += grads["dense"].double().gather(1, h.long_indices())
    if present["scale"] is not None:
        kept *= grads["scale"].double()
    ref = torch.zeros(size[0], dim, dtype=torch.float64).scatter_(1, h.long_indices(), kept)
    out = torch.full((size[0], dim), float("nan"), dtype=dtype)
    weight, weighted = cpu_ops._weight(ops.weight_t, dtype, out)
    placeholder = out[:1]
    arrays = [(placeholder if t is None else t).numpy() for t in present.values()]
    cpu.input_grad_rows(ops.colptr.numpy(), ops.row_t.numpy(), weight, weighted,
                        h.indices.numpy(), arrays[0], present["agg"] is not None, arrays[1],
                        present["values"] is not None, arrays[2], present["dense"] is not None,
                        arrays[3], present["scale"] is not None, out.numpy())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(out.double(), ref, **tol)
    # The op takes the kernel on the cpu backend; the same result as the torch
    # backend's separate steps.
    from pyg_maxk.ops import _library as lib
    packed = graph.operands(k)
    results = [lib.maxk_input_grad(*packed, h.indices, *present.values(), dim, dtype, backend)
               for backend in ("cpu", "torch")]
    torch.testing.assert_close(results[0], results[1], **tol)
    torch.testing.assert_close(results[0].double(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,dim,k,out_features,bias", [
    (40, 24, 5, 7, True), (13, 300, 9, 16, False), (0, 40, 3, 5, True), (6, 64, 10, 0, True),
    (1, 8, 1, 3, False), (20, 50, 16, 33, True)])
def test_cbsr_linear_kernels_against_float64(dtype, rows, dim, k, out_features, bias,
                                             monkeypatch):
    # The root-term linear on CBSR rows (SAGE's lin_r), forward and backward,
    # without a dense [N, dim] input anywhere (uint8 and int16 indices; k
    # below, at and between multiples of the kernels' groups of entries).
    h = random_cbsr(rows, dim, k, dtype, seed=rows)
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, dim, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(out_features, generator=g, dtype=dtype, requires_grad=True) if bias else None
    values = h.values.clone().requires_grad_()
    dense_calls = []
    monkeypatch.setattr(CBSR, "to_dense", lambda self: dense_calls.append(1))
    with pyg_maxk.use_backend("cpu"):
        out = pyg_maxk.ops.cbsr_linear(h.with_values(values), weight, b)
        grad_out = torch.randn(out.shape, generator=g, dtype=dtype)
        out.backward(grad_out)
    assert not dense_calls
    monkeypatch.undo()
    dense = h.to_dense().double()
    ref = torch.nn.functional.linear(dense, weight.double(), None if b is None else b.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    assert out.dtype == dtype and out.shape == (rows, out_features)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(values.grad.double(),
                               (grad_out.double() @ weight.double()).gather(1, h.long_indices()),
                               **tol)
    torch.testing.assert_close(weight.grad.double(), grad_out.double().t() @ dense, **tol)
    if bias:
        torch.testing.assert_close(b.grad.double(), grad_out.double().sum(0), **tol)


def test_cbsr_linear_cpu_kernels_only_for_one_float_type():
    # Mixed types (or autocast) take the dense path, which casts as F.linear does.
    h = random_cbsr(5, 16, 3, torch.float32)
    weight = torch.randn(4, 16, dtype=torch.float64)
    plan = pyg_maxk.ops.linear_backend
    with pyg_maxk.use_backend("cpu"):
        assert plan(h, weight.float(), None) == "cpu"
        assert plan(h, weight, None) == "dense"
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert plan(h, weight.float(), None) == "dense"
    with pyg_maxk.use_backend("torch"):
        assert plan(h, weight.float(), None) == "torch"


@pytest.mark.parametrize("form", [f for f in FORMS if f != "csc"])  # stock GCN rejects CSC
@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_layer_contract(kind, form):
    ei = random_edge_index(N, N, 50, seed=3)
    value = random_weights(ei.size(1)) if form in ("SparseTensor", "coo", "csr") else None
    ours, stock = make_pair(kind)
    assert_same_as_stock(ours, stock, random_features(), (adjacency(form, ei, (N, N), value),), K,
                         backend="cpu")


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_cpu_graphs_skip_the_work_schedule_outside_the_simulator(monkeypatch, kind):
    # Only the CUDA kernels read the work schedule: a CPU graph outside
    # Numba's simulator (where tests otherwise run) builds none, and the
    # "cpu" backend still gives the stock result, forward and backward.
    from pyg_maxk.graph import unpack
    monkeypatch.setattr(pyg_maxk.graph.csr, "_simulated_kernels", lambda: False)
    pyg_maxk.clear_graph_cache()
    ei = random_edge_index(N, N, 50, seed=3)
    graph = CSRGraph.from_adj(ei, (N, N), cache=False)
    operands = unpack(*graph.operands(K))
    assert operands.item_row is None and operands.zeroed_rows is None
    assert operands.colptr is not None  # the CPU backward's transposed graph
    ours, stock = make_pair(kind)
    assert_same_as_stock(ours, stock, random_features(), (ei,), K, backend="cpu")
    pyg_maxk.clear_graph_cache()


@pytest.mark.parametrize("kind", ["sage", "gin"])
def test_layer_contract_bipartite(kind):
    ei = random_edge_index(11, 7, 30, seed=4)
    ours, stock = make_pair(kind)
    x = (random_features(11), random_features(7, seed=5))
    assert_same_as_stock(ours, stock, x, (ei, (11, 7)), K, backend="cpu")


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
@pytest.mark.slow
def test_gradcheck_float64(kind):
    ei = random_edge_index(8, 8, 20, seed=10)
    conv = make_pair(kind, f_in=6, k=3)[0].double()
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    with pyg_maxk.use_backend("cpu"):
        assert torch.autograd.gradcheck(lambda x: conv(x, ei), (x,))


def cpu_maxk(x: torch.Tensor, k: int) -> CBSR:
    with pyg_maxk.use_backend("cpu"):
        return pyg_maxk.maxk(x, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
# (256, 32), (64, 16), (128, 8) and (8, 3): rows a power of two times the
# groups long, whose maxima the kernel folds by halving; the rest by runs.
@pytest.mark.parametrize("dim,k", [(256, 32), (64, 16), (128, 8), (8, 3), (100, 7), (1433, 1),
                                   (70, 69), (256, 255), (300, 64), (33, 32)])
def test_maxk_select_matches_topk(dtype, dim, k, monkeypatch):
    calls, original = [], cpu_ops.maxk_select
    monkeypatch.setattr(cpu_ops, "maxk_select", lambda x, k: calls.append(k) or original(x, k))
    x = torch.randn(150, dim, generator=torch.Generator().manual_seed(dim + k), dtype=dtype)
    x.requires_grad_()
    h = cpu_maxk(x, k)
    assert calls == [k] and h.indices.dtype == pyg_maxk.index_dtype_for(dim)
    assert_same_selection(h, x.detach(), k)
    g = torch.randn_like(h.values)
    h.values.backward(g)  # gradients reach the kept entries only
    torch.testing.assert_close(x.grad, torch.zeros_like(x).scatter(1, h.indices.long(), g))


@pytest.mark.parametrize("dim,k", [(70, 1), (70, 20), (70, 69), (64, 1), (64, 16)])
def test_maxk_select_many_ties_negatives_and_signed_zeros(dim, k):
    # Few distinct values: the k-th largest is tied, and bisection cannot
    # narrow the candidates down to exactly k (64 wide: folded maxima).
    x = few_valued_rows(k, dim=dim)
    h = cpu_maxk(x, k)
    assert_same_selection(h, x, k)
    assert_ties_keep_lowest_columns(h, x)


def test_maxk_select_nan_and_infinities():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 3.0, 3.0, nan, 3.0, -1.0, -inf, 0.0],
                      [nan, 2.0, nan, nan, inf, nan, 5.0, nan],
                      [-inf, -inf, -inf, -inf, -inf, -inf, -inf, -3.0]])
    h = cpu_maxk(x, 4)
    # NaN ranks above every number (as in torch.topk), ties keep the lowest
    # columns, and more NaNs than k keep the first k of them.
    assert h.indices.long().tolist() == [[1, 2, 3, 4], [0, 2, 3, 5], [0, 1, 2, 7]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_maxk_select_extreme_magnitudes(dtype):
    # The search interpolates between thresholds: spans that overflow the
    # dtype, subnormal gaps, infinite ends and one huge outlier per row.
    g = torch.Generator().manual_seed(3)
    big, tiny = torch.finfo(dtype).max, torch.finfo(dtype).smallest_normal
    x = torch.randn(8, 96, generator=g, dtype=dtype)
    x[0] *= big / 4                     # the row spans most of the range
    x[1] *= tiny                        # subnormal entries
    x[2, 5], x[2, 50] = big, -big       # one outlier at each end
    x[3, ::3] = float("inf")            # 32 infinities: more than k
    x[4, ::7] = float("-inf")
    x[5] = torch.linspace(-1, 1, 96, dtype=dtype) * big
    x[6, 10] = float("inf")
    x[7] = x[7].sign() * tiny * 2 ** torch.arange(96, dtype=dtype).remainder(40)
    for k in (1, 7, 20, 40):
        h = cpu_maxk(x, k)
        assert_same_selection(h, x, k)
        assert_ties_keep_lowest_columns(h, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,dim,k", [(40, 256, 32), (9, 300, 7), (0, 24, 5)])
def test_densify_and_its_gradient(dtype, rows, dim, k):
    # The kernels write every entry of their outputs (poisoned here), and
    # read the uint8 and int16 indices as stored.
    from pyg_maxk.kernels import cpu
    h = random_cbsr(rows, dim, k, dtype, seed=rows)
    dense = torch.full((rows, dim), float("nan"), dtype=dtype)
    cpu.densify_rows(h.values.numpy(), h.indices.numpy(), dense.numpy())
    torch.testing.assert_close(dense, h.to_dense(), rtol=0, atol=0)
    grad = torch.randn(rows, dim, dtype=dtype)
    sampled = torch.full((rows, k), float("nan"), dtype=dtype)
    cpu.gather_rows(grad.numpy(), h.indices.numpy(), sampled.numpy())
    torch.testing.assert_close(sampled, grad.gather(1, h.long_indices()), rtol=0, atol=0)
    # The ops run them, forward and backward.
    values = h.values.clone().requires_grad_()
    with pyg_maxk.use_backend("cpu"):
        assert pyg_maxk.dispatch.choose("densify", values, dim=dim, k=k) == "cpu"
        out = pyg_maxk.ops.to_dense(h.with_values(values))
    torch.testing.assert_close(out, h.to_dense(), rtol=0, atol=0)
    out.backward(grad)
    torch.testing.assert_close(values.grad, sampled, rtol=0, atol=0)


def test_maxk_select_no_rows():
    h = cpu_maxk(torch.empty(0, 40), 5)
    assert h.values.shape == (0, 5) and h.indices.shape == (0, 5)


def test_cpu_select_takes_rows_its_counts_keep_exact():
    x = torch.empty(1, 1)
    wide = pyg_maxk.dispatch.MAX_CPU_SELECT_DIM + 1
    with pyg_maxk.use_backend("auto"):
        assert pyg_maxk.dispatch.choose("select", x, dim=wide - 1, k=3) == "cpu"
        assert pyg_maxk.dispatch.choose("select", x, dim=wide, k=3) == "torch"
    with pyg_maxk.use_backend("cpu"), pytest.raises(pyg_maxk.dispatch.BackendError,
                                                    match="rows up to"):
        pyg_maxk.dispatch.choose("select", x, dim=wide, k=3)
