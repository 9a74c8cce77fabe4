"""The test suite's helpers, in one module (test files import no other test
file): random graphs in every adjacency form, the stock-vs-MaxK comparison
the layer contract is written in, the layer pairs it compares, and the checks
of the kernels against float64 references that the simulator and GPU tests
share, and the check of a device-side assert in a fresh process."""
from __future__ import annotations

import warnings
from typing import Optional, Tuple

import pytest
import torch
from torch import Tensor
from torch_geometric.nn import GCNConv, GINConv, SAGEConv

import pyg_maxk
from pyg_maxk import CBSR, CSRGraph
from pyg_maxk.nn import MaxKGCNConv, MaxKGINConv, MaxKSAGEConv

FORMS = ("edge_index", "EdgeIndex", "SparseTensor", "coo", "csr", "csc")


def random_edge_index(num_src: int, num_dst: int, num_edges: int, *, seed: int = 0,
                      self_loops: bool = True, multi_edges: bool = True,
                      isolated: int = 2, device="cpu") -> Tensor:
    """Random edges; the last ``isolated`` target nodes receive none."""
    g = torch.Generator().manual_seed(seed)
    hi_dst = max(1, num_dst - isolated)
    src = torch.randint(0, num_src, (num_edges,), generator=g)
    dst = torch.randint(0, hi_dst, (num_edges,), generator=g)
    if self_loops and num_edges >= 4 and num_src == num_dst:
        src[:3] = dst[:3]
    if multi_edges and num_edges >= 6:
        src[-2:] = src[3]
        dst[-2:] = dst[3]
    return torch.stack([src, dst]).to(device)


def adjacency(form: str, edge_index: Tensor, size: Tuple[int, int],
              value: Optional[Tensor] = None):
    """``edge_index`` (source row 0, target row 1) in one of :data:`FORMS`;
    sparse forms are ``adj_t`` of shape ``[num_dst, num_src]``."""
    num_src, num_dst = size
    src, dst = edge_index
    if form == "edge_index":
        return edge_index
    if form == "EdgeIndex":
        from torch_geometric import EdgeIndex
        return EdgeIndex(edge_index, sparse_size=(num_src, num_dst))
    if form == "SparseTensor":
        SparseTensor = pytest.importorskip(
            "torch_sparse", reason="the SparseTensor form needs torch-sparse (the full tier "
            "installs it)").SparseTensor
        return SparseTensor(row=dst, col=src, value=value, sparse_sizes=(num_dst, num_src))
    if value is None:
        value = torch.ones(src.numel(), device=edge_index.device)
    coo = torch.sparse_coo_tensor(torch.stack([dst, src]), value, (num_dst, num_src))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if form == "coo":
            return coo
        if form == "csr":
            return coo.to_sparse_csr()
        if form == "csc":
            return coo.coalesce().to_sparse_csc()
    raise ValueError(form)


def dense_reference(h: pyg_maxk.CBSR) -> Tensor:
    """``h`` as a dense matrix by a plain scatter (no backend kernel)."""
    return h.values.new_zeros(h.num_rows, h.dim).scatter_(1, h.long_indices(), h.values)


def dense_maxk(x, k: int):
    """The stock layers' input: MaxK of ``x`` by the torch backend, dense."""
    if isinstance(x, (tuple, list)):
        return tuple(None if t is None else dense_maxk(t, k) for t in x)
    with pyg_maxk.use_backend("torch"):
        return pyg_maxk.maxk(x, k).to_dense()


def clone_features(x, requires_grad=True):
    if isinstance(x, (tuple, list)):
        return tuple(None if t is None else clone_features(t, requires_grad) for t in x)
    return x.detach().clone().requires_grad_(requires_grad)


def feature_grads(x):
    if isinstance(x, (tuple, list)):
        return [t.grad for t in x if t is not None]
    return [x.grad]


def assert_same_as_stock(maxk_conv, stock_conv, x, args, k, *, rtol=1e-4, atol=1e-5,
                         backend="torch"):
    """``maxk_conv(x, *args) == stock_conv(dense_maxk(x, k), *args)`` in value
    and in the gradients of the features and of every parameter."""
    maxk_conv.load_state_dict(stock_conv.state_dict())
    x_ours = clone_features(x)
    x_stock = clone_features(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pyg_maxk.use_backend(backend):
            out = maxk_conv(x_ours, *args)
        ref = stock_conv(dense_maxk(x_stock, k), *args)
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    weight = torch.randn_like(ref)  # a random (never all-ones) output gradient
    with pyg_maxk.use_backend(backend):
        (out * weight).sum().backward()
    (ref * weight).sum().backward()
    for g_ours, g_stock in zip(feature_grads(x_ours), feature_grads(x_stock)):
        torch.testing.assert_close(g_ours, g_stock, rtol=rtol, atol=atol)
    stock_params = dict(stock_conv.named_parameters())
    for name, p in maxk_conv.named_parameters():
        q = stock_params[name]
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)
    return out


def assert_same_selection(h: pyg_maxk.CBSR, x: Tensor, k: int, order: str = "column") -> None:
    """``h`` keeps exactly the entries torch.topk keeps, in ``order``:
    ``"column"`` (the CPU kernels) or ``"bank"`` (the GPU kernel: by column
    mod 32, then column). Among equal values the kernels keep the lowest
    columns, torch.topk unspecified ones, so tied columns may differ (their
    values do not)."""
    values, _ = torch.topk(x, k, dim=1)
    cols = h.indices.long()
    rank = {"column": cols, "bank": (cols % 32) * x.size(1) + cols // 32}[order]
    assert (rank.diff(dim=1) > 0).all(), f"columns are not in {order} order"
    # Each kept value is the entry at its column, and the kept values are
    # topk's: so a value that occurs once in its row sits at topk's column.
    torch.testing.assert_close(x.gather(1, cols), h.values, rtol=0, atol=0)
    torch.testing.assert_close(h.values.sort(dim=1, descending=True).values, values,
                               rtol=0, atol=0)


def few_valued_rows(seed: int, rows: int = 9, dim: int = 70) -> Tensor:
    """Rows of -2, -1, -0.0, 0.0 and 1: selections cut through runs of ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 2, (rows, dim), generator=g).float()
    x[x == 0] = torch.where(torch.rand(int((x == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
    return x


def assert_ties_keep_lowest_columns(h: pyg_maxk.CBSR, x: Tensor) -> None:
    """Among the entries equal to a row's k-th largest value, ``h`` keeps
    exactly the first ones in column order."""
    kth = h.values.min(dim=1, keepdim=True).values
    cols = h.indices.long()
    for r in range(x.size(0)):
        tied = (x[r] == kth[r]).nonzero().view(-1)
        picked = cols[r][h.values[r] == kth[r]].sort().values
        assert torch.equal(picked, tied[:picked.numel()])


# ------------------------------------------------------ layer pairs
N, F_IN, F_OUT, K = 14, 24, 8, 5


def random_features(n=N, f=F_IN, seed=1, dtype=torch.float32):
    return torch.randn(n, f, generator=torch.Generator().manual_seed(seed)).to(dtype)


def random_weights(e, seed=2):
    return torch.rand(e, generator=torch.Generator().manual_seed(seed)) + 0.1


def gin_mlp(f_in=F_IN, f_out=F_OUT):
    return torch.nn.Sequential(torch.nn.Linear(f_in, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, f_out))


def make_pair(kind, f_in=F_IN, k=K, **kw):
    torch.manual_seed(0)
    if kind == "sage":
        return MaxKSAGEConv(f_in, F_OUT, k=k, **kw), SAGEConv(f_in, F_OUT, **kw)
    if kind == "gcn":
        return MaxKGCNConv(f_in, F_OUT, k=k, **kw), GCNConv(f_in, F_OUT, **kw)
    if kind == "gin":
        return (MaxKGINConv(gin_mlp(f_in), k=k, train_eps=True, eps=0.3, **kw),
                GINConv(gin_mlp(f_in), train_eps=True, eps=0.3, **kw))
    raise ValueError(kind)



# --------------------------------------------- kernels against float64
ON_GPU = torch.cuda.is_available()


DEVICE = "cuda" if ON_GPU else "cpu"


def poison_allocator(nbytes: int = 1 << 26) -> None:
    """Fill memory the CUDA caching allocator will hand out next with NaN,
    so that outputs a kernel fails to write show up."""
    if ON_GPU:
        junk = torch.full((nbytes // 4,), float("nan"), device=DEVICE)
        del junk


def random_cbsr(num_rows, dim, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, dim, generator=g)
    values, idx = x.topk(k, dim=1)
    return CBSR(values.to(DEVICE, dtype), idx.to(DEVICE, pyg_maxk.index_dtype_for(dim)), dim)


def split_items(graph: CSRGraph, k: int) -> torch.Tensor:
    """The split marks of the work items the kernels run at ``k`` (nonzero
    for an item of a split row)."""
    from pyg_maxk.graph import unpack
    return unpack(*graph.operands(k)).item_split


def kernel_maxk(x: torch.Tensor, k: int) -> CBSR:
    """MaxK through the select kernel itself (its custom op, differentiable)."""
    from pyg_maxk.ops import _library
    values, indices = _library.maxk_select(x, k, "numba")
    return CBSR(values, indices, x.size(1))


def reference_spgemm(graph: CSRGraph, h: CBSR) -> torch.Tensor:
    """``A @ dense(h)`` in float64."""
    return torch.sparse.mm(graph.torch_csr(torch.float64), dense_reference(h).double())


def reference_sspmm(graph: CSRGraph, h: CBSR, grad_out: torch.Tensor) -> torch.Tensor:
    """``(A^T @ grad_out)`` sampled at the CBSR pattern, in float64."""
    a_t = graph.torch_csr(torch.float64).t().to_sparse_csr()
    return torch.sparse.mm(a_t, grad_out.double()).gather(1, h.long_indices())


def check_kernels(graph, dim, k, seed=0, rtol=1e-5, atol=1e-5, h=None, reference=None,
                  backend="numba"):
    """The aggregation over ``graph`` and its CBSR gradient against float64,
    over the CSR graph ``reference`` (default: ``graph``)."""
    reference = graph if reference is None else reference
    h = random_cbsr(graph.num_src, dim, k, seed) if h is None else h
    values = h.values.clone().requires_grad_()
    poison_allocator()
    with pyg_maxk.use_backend(backend):
        out = pyg_maxk.aggregate(graph, h.with_values(values))
    ref = reference_spgemm(reference, h)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)
    grad_out = torch.randn(graph.num_dst, dim).to(DEVICE)
    poison_allocator()
    with pyg_maxk.use_backend(backend):
        out.backward(grad_out)
    torch.testing.assert_close(values.grad.double(), reference_sspmm(reference, h, grad_out),
                               rtol=rtol, atol=atol)
    return out, values.grad


def assert_norm_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5):
    """``|actual - expected| <= tol * |expected|`` in the 2-norm: float32 sums
    of many terms (a GEMM over 150,000 rows) miss a float64 reference by more
    than an elementwise tolerance on their smallest entries."""
    err = float((actual.double() - expected.double()).norm() / expected.double().norm())
    assert err <= tol, f"relative error {err:.3g} > {tol:g}"


def check_cbsr_linear(h: CBSR, out_features: int, bias: bool, seed: int = 0,
                      expect_kernel: bool = True, forward_tol: float = 1e-5):
    """``pyg_maxk.ops.cbsr_linear`` against a float64 dense linear, forward
    (elementwise within ``forward_tol``, and norm-relative) and backward
    (cuBLAS's GEMMs: norm-relative), and whether its forward ran the CBSR
    linear kernel (wherever it fits when the caller forces ``linear_pays``)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, h.dim, generator=g).to(DEVICE, h.dtype).requires_grad_()
    b = (torch.randn(out_features, generator=g).to(DEVICE, h.dtype).requires_grad_()
         if bias else None)
    values = h.values.clone().requires_grad_()
    hv = h.with_values(values)
    with pyg_maxk.use_backend("numba"):
        assert (pyg_maxk.ops.linear_backend(hv, weight, b) == "numba") == expect_kernel
        poison_allocator()
        out = pyg_maxk.ops.cbsr_linear(hv, weight, b)
    dense = dense_reference(h).double()
    ref = torch.nn.functional.linear(dense, weight.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), ref, rtol=forward_tol, atol=forward_tol)
    assert_norm_close(out, ref)
    grad = torch.randn(out.shape, generator=g).to(DEVICE, h.dtype)
    out.backward(grad)
    ref_values = (grad.double() @ weight.double()).gather(1, h.long_indices())
    assert_norm_close(values.grad, ref_values)
    assert_norm_close(weight.grad, grad.double().t() @ dense)


HALF = [torch.float16, torch.bfloat16]


#: Unit roundoff of each half type: a float32 sum rounded once to it is
#: within this relative error of the exact sum (float32's own error is far
#: smaller).
HALF_UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def check_half_kernels(graph, dim, k, dtype, seed=0, h=None):
    """The kernels on half-precision CBSR values and output gradients against
    float64 references of the same (half) inputs, every output written over
    poisoned memory: the aggregation (in ``aggregation_dtype``: float32 when
    float32 edge values weight the sum) and the values' gradient within one
    rounding of a float32 sum, the backward kernel also on a half gradient,
    the edge values' gradient (float32) within float32 error, densify bit
    for bit."""
    from pyg_maxk.graph import unpack
    from pyg_maxk.ops import _library as lib
    from pyg_maxk.ops import aggregation_dtype, dtype_of, torch_ops

    h = random_cbsr(graph.num_src, dim, k, seed, dtype) if h is None else h
    unit = HALF_UNIT[dtype]
    values = h.values.clone().requires_grad_()
    poison_allocator()
    with pyg_maxk.use_backend("numba"):
        out = pyg_maxk.aggregate(graph, h.with_values(values))
        poison_allocator()
        dense = h.to_dense()
    assert out.dtype == aggregation_dtype(dtype, dtype_of(graph.weight), dtype_of(graph.row_scale))
    assert dense.dtype == dtype
    out_tol = unit if out.dtype == dtype else 1e-5
    torch.testing.assert_close(out.double(), reference_spgemm(graph, h), rtol=out_tol,
                               atol=1e-5)
    torch.testing.assert_close(dense, dense_reference(h), rtol=0, atol=0)
    g = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(graph.num_dst, dim, generator=g).to(DEVICE, dtype)
    poison_allocator()
    with pyg_maxk.use_backend("numba"):
        out.backward(grad_out.to(out.dtype))
    assert values.grad.dtype == dtype
    ref_grad = reference_sspmm(graph, h, grad_out)
    torch.testing.assert_close(values.grad.double(), ref_grad, rtol=unit, atol=1e-5)
    operands = graph.operands(k)
    poison_allocator()
    grad_values = lib.sspmm(*operands, h.indices, grad_out, graph.num_src, "numba")
    assert grad_values.dtype == dtype
    torch.testing.assert_close(grad_values.double(), ref_grad, rtol=unit, atol=1e-5)
    poison_allocator()
    grad_weight = lib.sddmm(*operands, h.values, h.indices, grad_out, "numba")
    assert grad_weight.dtype == torch.float32
    ref = torch_ops.sddmm(unpack(*operands), h.values.double(), h.indices,
                          grad_out.double())
    torch.testing.assert_close(grad_weight.double(), ref, rtol=1e-5, atol=2e-4)


def every_k_case(k: int):
    """``(dtype, normalization, forced pairs)`` of the every-k sweeps: the
    three vary with ``k`` independently, so that every code path meets both
    half types, a row scale and float32 edge values."""
    dtype = torch.bfloat16 if k % 2 == 0 else torch.float16
    normalization = "mean" if (k // 2) % 2 == 0 else "sum"
    return dtype, normalization, k % 3 == 0


def check_half_reductions(monkeypatch, graph, dim, k, dtype, seed=0):
    """The values' gradient with packed half reductions
    (:func:`pyg_maxk.allow_half_reductions`) against a float64 reference of
    the same half inputs, written over poisoned memory: every entry within
    the bound of a sum of ``d`` terms rounded to the half type after every
    addition, ``(d + 1) * u * sum|terms|`` (``d``: the source's out-degree;
    one more rounding for the term itself), so a lost or doubled term, a
    wrong slot or column fails. Also checks that the packed kernel ran."""
    from pyg_maxk.ops import _library as lib
    from pyg_maxk.ops import numba_ops
    h = random_cbsr(graph.num_src, dim, k, seed, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(graph.num_dst, dim, generator=g).to(DEVICE, dtype)
    compiled = []
    kernel = numba_ops.sspmm_kernel
    monkeypatch.setattr(numba_ops, "sspmm_kernel",
                        lambda *a: compiled.append(a[-1]) or kernel(*a))
    monkeypatch.setattr(pyg_maxk.dispatch, "_half_reductions", True)
    poison_allocator()
    grad_values = lib.sspmm(*graph.operands(k), h.indices, grad_out, graph.num_src, "numba")
    assert compiled == [True] and grad_values.dtype == dtype
    a_t = graph.torch_csr(torch.float64).t().to_sparse_csr()
    exact = torch.sparse.mm(a_t, grad_out.double()).gather(1, h.long_indices())
    magnitude = torch.sparse.mm(a_t.abs(), grad_out.double().abs()).gather(1, h.long_indices())
    out_degree = torch.bincount(graph.col.long(), minlength=graph.num_src).double()
    bound = (out_degree[:, None] + 1) * HALF_UNIT[dtype] * magnitude * 1.01 + 1e-30
    error = (grad_values.double() - exact).abs()
    assert bool((error <= bound).all()), float((error / bound).max())
    assert float(magnitude.sum()) > 0



def sparse_tensor_on_cuda_or_skip():
    torch_sparse = pytest.importorskip("torch_sparse")
    try:
        torch_sparse.SparseTensor(row=torch.zeros(1, dtype=torch.long, device="cuda"),
                                  col=torch.zeros(1, dtype=torch.long, device="cuda"),
                                  sparse_sizes=(1, 1)).csr()
    except RuntimeError as err:  # e.g. a CPU-only torch_sparse build
        pytest.skip(f"torch_sparse has no CUDA ops here ({err})")


def assert_device_side_assert(code: str, message: str) -> None:
    """Run ``code`` in a fresh Python process (a device-side assert ends its
    CUDA context) and check that it failed there, on a device-side assert
    or ``message``, and not on an assertion of its own."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "AssertionError" not in result.stderr, result.stderr[-2000:]
    assert "device-side assert" in result.stderr or message in result.stderr, \
        result.stderr[-2000:]
