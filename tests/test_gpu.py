"""Heavy checks of the compiled kernels on a CUDA GPU: ``pytest -m gpu``.

Power-law graphs with a 50,000-neighbour row, dims 64 to 512, k from 1 to
dim, poisoned outputs, run-to-run agreement, half precision, and the layer
contract on every adjacency form.
"""
import gc
import warnings

import pytest
import torch

import pyg_maxk
from helpers import (
    FORMS,
    HALF,
    adjacency,
    assert_device_side_assert,
    assert_same_as_stock,
    assert_same_selection,
    check_cbsr_linear,
    check_half_kernels,
    check_half_reductions,
    check_kernels,
    dense_maxk,
    dense_reference,
    every_k_case,
    gin_mlp,
    kernel_maxk,
    make_pair,
    poison_allocator,
    random_cbsr,
    random_edge_index,
    sparse_tensor_on_cuda_or_skip,
    split_items,
)
from pyg_maxk import CSRGraph
from pyg_maxk.graph import EdgeListGraph, unpack
from pyg_maxk.kernels import geometry
from pyg_maxk.ops import numba_ops
from pyg_maxk.ops._launch import PreparedLaunch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def power_law_graph(num_nodes=20_000, avg_degree=20, max_degree=50_000, seed=0,
                    normalization="mean", isolated=100):
    ei = power_law_edges(num_nodes, avg_degree, max_degree, seed, isolated)
    return CSRGraph.from_adj(ei, (num_nodes, num_nodes), normalization=normalization)


def power_law_edges(num_nodes=20_000, avg_degree=20, max_degree=50_000, seed=0, isolated=100):
    """A GPU edge_index sorted by target, with a ``max_degree`` row and
    ``isolated`` nodes without edges."""
    g = torch.Generator().manual_seed(seed)
    deg = torch.distributions.LogNormal(1.5, 1.3).sample((num_nodes,)).long()
    deg = (deg * avg_degree / deg.float().mean()).long().clamp(max=max_degree)
    deg[0] = max_degree          # the 50k-degree row
    deg[-isolated:] = 0          # isolated nodes
    dst = torch.repeat_interleave(torch.arange(num_nodes), deg)
    src = torch.randint(0, num_nodes, (dst.numel(),), generator=g)
    return torch.stack([src, dst]).cuda()


@pytest.mark.parametrize("dim", [64, 128, 256, 300, 512])
def test_kernels_power_law_all_k(dim):
    graph = power_law_graph()
    assert int(graph.in_degree().max()) == 50_000
    for k in sorted({1, 2, 8, 32, dim // 2, dim - 1}):
        check_kernels(graph, dim, k, seed=k, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dim", [64, 256, 300])
def test_value_index_pairs_power_law(monkeypatch, dim):
    # The forward reads (value, index) pairs for k <= 16 on graphs of
    # PAIRS_MIN_EDGES edges and more; forced here.
    monkeypatch.setattr(numba_ops, "PAIRS_MIN_EDGES", 0)
    graph = power_law_graph(seed=4)
    for k in (1, 2, 3, 4, 5, 8, 12, 16):
        check_kernels(graph, dim, k, seed=k, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dim,out_features", [(64, 256), (256, 256), (256, 47), (300, 41),
                                              (368, 100)])
def test_cbsr_linear_kernel_many_rows(monkeypatch, dim, out_features):
    # 150,000 rows: one wave of blocks, each with thousands of rows per tile;
    # a partial last tile (47, 41, 100 columns); the widest W^T tile (368,
    # where k=184 no longer fits: the dense path). Sums of up to 184 float32
    # terms: elementwise within 1e-4, as the SpGEMM checks above.
    monkeypatch.setattr(pyg_maxk.dispatch, "_linear_pays", lambda dim, k: True)
    pyg_maxk.dispatch.clear_decisions()
    for k in sorted({1, 7, 8, 32, dim // 2}):
        check_cbsr_linear(random_cbsr(150_000, dim, k, seed=k), out_features, bias=k % 2 == 1,
                          seed=k, expect_kernel=geometry.takes_linear(dim, k),
                          forward_tol=1e-4)


def test_weighted_bipartite_gcn_graphs():
    ei = random_edge_index(5000, 3000, 200_000, seed=1).cuda()
    w = torch.rand(ei.size(1), device="cuda") + 0.1
    check_kernels(CSRGraph.from_adj(ei, (5000, 3000), edge_weight=w), 256, 32,
                  rtol=1e-4, atol=1e-4)
    sq = random_edge_index(4000, 4000, 100_000, seed=2).cuda()
    check_kernels(CSRGraph.from_adj(sq, (4000, 4000), normalization="gcn"), 128, 16,
                  rtol=1e-4, atol=1e-4)


def test_runs_agree_no_races():
    graph = power_law_graph(seed=3)
    h = random_cbsr(graph.num_src, 256, 32)
    outs, grads = [], []
    for _ in range(2):
        values = h.values.clone().requires_grad_()
        poison_allocator()
        with pyg_maxk.use_backend("numba"):
            out = pyg_maxk.aggregate(graph, h.with_values(values))
            out.backward(torch.ones_like(out))
        outs.append(out)
        grads.append(values.grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [64, 256, 512, 1000])
def test_maxk_select_all_k(dim):
    x = torch.randn(50_000, dim, device="cuda")
    for k in sorted({1, 7, 32, dim // 2, dim - 1}):
        poison_allocator()
        assert_same_selection(kernel_maxk(x, k), x, k, order="bank")


@pytest.mark.parametrize("dim,k", [(64, 7), (256, 32), (1000, 500)])
def test_maxk_select_counts_agree_with_and_without_redux(dim, k):
    # The layers count with redux.sync on sm_80+; the shuffle counts stay for
    # older GPUs. Random rows and rows of few values (ties across lanes).
    from pyg_maxk.kernels.maxk_select import select_kernel

    few = torch.randint(-2, 2, (5_000, dim), device="cuda").float()
    for x in (torch.randn(20_000, dim, device="cuda"), few):
        n = x.size(0)
        run, rows_per_block, threads, blocks = numba_ops._row_launch(n, x.device)
        picked = []
        for redux in (False, True):
            poison_allocator()
            values = torch.empty(n, k, device="cuda")
            indices = torch.empty(n, k, dtype=pyg_maxk.index_dtype_for(dim), device="cuda")
            run(select_kernel(dim, k, rows_per_block, redux), blocks, threads, x.device, x,
                x.view(torch.int32), values, indices, n, x, x, x, x)  # x: unused stand-ins
            picked.append((values, indices))
        assert torch.equal(picked[0][0], picked[1][0])
        assert torch.equal(picked[0][1], picked[1][1])
        assert_same_selection(pyg_maxk.CBSR(*picked[1], dim), x, k, order="bank")


@pytest.mark.parametrize("dim", [64, 256, 1000, 3072, 3073])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_dense_kernel_power_law_rows(dim, dtype):
    # 3072 is the widest row the kernel's shared memory takes; 3073 is an
    # error under the forced numba backend and a scatter under "auto".
    fits = geometry.takes_densify(dim)
    for k in sorted({1, 32, dim // 2, dim - 1}):
        h = random_cbsr(20_000, dim, k, seed=k, dtype=dtype)
        values = h.values.clone().requires_grad_()
        poison_allocator(1 << 28)
        if not fits:
            with pyg_maxk.use_backend("numba"), pytest.raises(pyg_maxk.BackendError,
                                                              match="densify kernel"):
                h.to_dense()
        with pyg_maxk.use_backend("numba" if fits else "auto"):
            dense = h.with_values(values).to_dense()
        assert dense.dtype == dtype
        torch.testing.assert_close(dense, dense_reference(h), rtol=0, atol=0)
        g = torch.randn(20_000, dim, device="cuda", dtype=dtype)
        dense.backward(g)
        torch.testing.assert_close(values.grad, g.gather(1, h.long_indices()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype):
    graph = power_law_graph(seed=4)
    h = random_cbsr(graph.num_src, 256, 32, dtype=dtype)
    with pyg_maxk.use_backend("numba"):
        out = pyg_maxk.aggregate(graph, h)
    assert out.dtype == dtype
    ref = torch.sparse.mm(graph.torch_csr(torch.float32), dense_reference(h).float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim", [64, 256, 512])
@pytest.mark.parametrize("normalization", ["mean", "gcn"])
def test_half_kernels_power_law_all_k(dim, dtype, normalization):
    # Every code path of the half-precision kernels: 1, 2 and 4 slots per
    # load, one lane per slot and several, the 50,000-neighbour row split
    # over work items, flat arrays (pairs below their edge threshold here),
    # a row scale (mean) and float32 edge values (gcn: a float32 result).
    graph = power_law_graph(normalization=normalization)
    for k in sorted({1, 3, 8, 16, 32, 33, dim - 1}):
        check_half_kernels(graph, dim, k, dtype, seed=k)


@pytest.mark.parametrize("dim,k", [(dim, k) for dim in (64, 128, 256, 512)
                                   for k in range(1, dim)])
def test_half_kernels_power_law_every_k(monkeypatch, dim, k):
    # Every k from 1 to dim - 1 at dims 64-512 on the power-law graph (its
    # 50,000-neighbour row split over work items), the half type, the
    # normalisation and forced pairs varying with k (every_k_case).
    dtype, normalization, pairs = every_k_case(k)
    if pairs:
        monkeypatch.setattr(numba_ops, "PAIRS_MIN_EDGES", 0)
    graph = power_law_graph(normalization="gcn" if normalization == "sum" else "mean")
    check_half_kernels(graph, dim, k, dtype, seed=k)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim", [64, 256, 512])
def test_half_reductions_power_law_all_k(monkeypatch, dim, dtype):
    # Packed half reductions on the power-law graph, each entry within its
    # rounding bound: every multiple of 8 below dim 64; k = 8, 32, 56, ...
    # below the wider dims.
    graph = power_law_graph(seed=2, normalization="gcn")
    for k in range(8, dim, 8 if dim <= 64 else 24):
        check_half_reductions(monkeypatch, graph, dim, k, dtype, seed=k)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim", [64, 256])
def test_half_value_index_pairs_power_law(monkeypatch, dim, dtype):
    # Packed half (value, index) words up to k=32, forced on this graph.
    monkeypatch.setattr(numba_ops, "PAIRS_MIN_EDGES", 0)
    graph = power_law_graph(seed=4)
    for k in (1, 2, 3, 4, 8, 12, 16, 24, 32):
        check_half_kernels(graph, dim, k, dtype, seed=k)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim", [64, 256, 1000])
def test_maxk_select_half_all_k(dim, dtype):
    x = torch.randn(50_000, dim, device="cuda").to(dtype)
    for k in sorted({1, 7, 32, dim // 2, dim - 1}):
        poison_allocator()
        h = kernel_maxk(x, k)
        assert h.values.dtype == dtype
        assert_same_selection(h, x, k, order="bank")


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_layer_contract_under_autocast(kind, input_dtype):
    # The MaxK conv under autocast against the stock conv on dense MaxK'd
    # features under the same autocast: the same output type, and outputs
    # and gradients as close to a float64 run of the stock conv as stock's
    # own (stock sums bf16 messages in bf16, the kernels in float32).
    # Features in float32 (a first layer) or bf16 (as autocast hands them on).
    import copy

    from helpers import clone_features, dense_maxk
    n = 3000
    ei = random_edge_index(n, n, 60_000, seed=5).cuda()
    ours, stock = make_pair(kind, f_in=256, k=32)
    ours, stock = ours.cuda(), stock.cuda()
    ours.load_state_dict(stock.state_dict())
    exact = copy.deepcopy(stock).double()
    x = torch.randn(n, 256, device="cuda").to(input_dtype)
    xs = [clone_features(x), clone_features(x), clone_features(x.double())]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with pyg_maxk.use_backend("numba"):
            out = ours(xs[0], ei)
        ref = stock(dense_maxk(xs[1], 32), ei)
    assert out.dtype == ref.dtype
    truth = exact(dense_maxk(xs[2], 32), ei)
    weight = torch.randn(ref.shape, device="cuda", dtype=torch.float64)
    for o in (out, ref, truth):
        (o.double() * weight).sum().backward()

    def err(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    exact_params = dict(exact.named_parameters())
    stock_params = dict(stock.named_parameters())
    pairs = [("output", out, ref, truth), ("features", xs[0].grad, xs[1].grad, xs[2].grad)]
    pairs += [(name, p.grad, stock_params[name].grad, exact_params[name].grad)
              for name, p in ours.named_parameters()]
    for what, a, b, t in pairs:
        assert err(a, t) <= 1.5 * err(b, t) + 1e-3, (what, err(a, t), err(b, t))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_layer_contract_on_cuda(kind, form):
    n = 3000
    ei = random_edge_index(n, n, 60_000, seed=5).cuda()
    weighted = form not in ("edge_index", "EdgeIndex")
    value = (torch.rand(ei.size(1), device="cuda") + 0.1) if weighted else None
    if form == "SparseTensor":
        sparse_tensor_on_cuda_or_skip()
    adj = adjacency(form, ei, (n, n), value)
    ours, stock = make_pair(kind, f_in=256, k=32)
    x = torch.randn(n, 256, device="cuda")
    if kind == "gcn" and form == "csc":
        with pytest.raises(NotImplementedError):
            ours.cuda()(x, adj)
        return
    assert_same_as_stock(ours.cuda(), stock.cuda(), x, (adj,), 32, rtol=1e-4, atol=1e-4,
                         backend="numba")


@pytest.mark.parametrize("half_reductions", [False, True])
def test_autocast_bf16_training_step(monkeypatch, half_reductions):
    # The numba backend under autocast against the torch backend under the
    # same autocast (same bf16 inputs to every op): outputs and gradients to
    # bf16 tolerance, norm-relative (bf16 ties may keep other columns), with
    # float32 or packed half reductions in the backward.
    monkeypatch.setattr(pyg_maxk.dispatch, "_half_reductions", half_reductions)
    ei = random_edge_index(2000, 2000, 20_000).cuda()
    x = torch.randn(2000, 64, device="cuda")
    results = []
    for backend in ("numba", "torch"):
        torch.manual_seed(0)
        model = pyg_maxk.nn.MaxKGraphSAGE(64, 128, 2, 5, k=16).cuda()
        with pyg_maxk.use_backend(backend):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x, ei)
            weight = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)
            (out.float() * weight).sum().backward()
        results.append((out.float(), [p.grad for p in model.parameters()]))
    (out, grads), (ref, ref_grads) = results
    assert ref.abs().sum() > 0
    for a, b in zip([out] + grads, [ref] + ref_grads):
        assert b is not None and a is not None
        err = float((a.double() - b.double()).norm() / b.double().norm())
        assert err < 5e-2, err


def _training_pair(kind, n=3000, k=32, seed=7):
    """Two equal MaxK models, their data, and a prepared graph."""
    from torch_geometric.data import Data
    cls = {"sage": pyg_maxk.nn.MaxKGraphSAGE, "gcn": pyg_maxk.nn.MaxKGCN,
           "gin": pyg_maxk.nn.MaxKGIN}[kind]
    norm = {"sage": "mean", "gcn": "gcn", "gin": "sum"}[kind]
    ei = random_edge_index(n, n, 40_000, seed=seed).cuda()
    adj = pyg_maxk.ToCSRGraph(norm, k=k)(Data(edge_index=ei, num_nodes=n)).adj_t
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, generator=g).cuda()
    y = torch.randint(0, 7, (n,), generator=g).cuda()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(cls(64, 128, 2, 7, k=k).cuda())
    return models, x, adj, y


def _step(model, opt, x, adj, y):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x, adj), y)
    loss.backward()
    opt.step()
    return loss


def _assert_models_close(a, b, tol=1e-4):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_cuda_graph_capture_of_a_whole_training_step(kind):
    (graphed, eager), x, adj, y = _training_pair(kind)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3, capturable=True) for m in (graphed, eager)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles and loads every kernel
        for _ in range(3):
            _step(graphed, opts[0], x, adj, y)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        _step(eager, opts[1], x, adj, y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _step(graphed, opts[0], x, adj, y)
    for _ in range(5):
        graph.replay()
        loss = _step(eager, opts[1], x, adj, y)
        # The backward's float atomics add in no fixed order: rounding apart.
        torch.testing.assert_close(static_loss, loss, rtol=1e-4, atol=1e-5)
    _assert_models_close(graphed, eager)


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_reduce_overhead_compile_trains_as_eager(kind):
    torch._dynamo.reset()
    (compiled, eager), x, adj, y = _training_pair(kind)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (compiled, eager)]
    step_model = torch.compile(compiled, mode="reduce-overhead", fullgraph=True)
    for _ in range(6):
        torch.compiler.cudagraph_mark_step_begin()
        loss = _step(step_model, opts[0], x, adj, y)
        ref = _step(eager, opts[1], x, adj, y)
        torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-5)
    _assert_models_close(compiled, eager)
    # Another prepared graph of the same shape (static inputs at other
    # addresses): the CUDA graphs re-record, never replay the first graph's.
    (_, _), _, other, _ = _training_pair(kind, seed=8)
    torch.compiler.cudagraph_mark_step_begin()
    out = step_model(x, other).clone()
    torch.testing.assert_close(out, eager(x, other), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out, eager(x, adj), rtol=1e-3, atol=1e-3)


# One training step of every MaxK model (float32 and bf16 autocast) in a new
# process; prints the summed disk-cache hits and misses of the package's
# kernels and the loss and gradient sums.
_CACHE_PROBE = r"""
import gc, json, torch
import pyg_maxk, pyg_maxk.nn
from numba.cuda.dispatcher import CUDADispatcher
from helpers import random_edge_index
from pyg_maxk.graph import EdgeListGraph, edge_list

ei = random_edge_index(3000, 3000, 40_000, seed=3).cuda()
g = torch.Generator().manual_seed(0)
x = torch.randn(3000, 64, generator=g).cuda()
y = torch.randint(0, 7, (3000,), generator=g).cuda()
# The edge-list kernels, forward and backward, on their own: in a model their
# atomics' order could flip a top-k tie downstream, beyond rounding.
xg = x.clone().requires_grad_()
out = pyg_maxk.aggregate(EdgeListGraph.from_edge_index(ei, (3000, 3000), normalization="mean"),
                         pyg_maxk.maxk(xg, 16))
out.square().sum().backward()
sums = [[float(out.double().abs().sum()), float(xg.grad.double().abs().sum())]]
edge_list.LAYERS_TAKE_EDGE_LISTS = False  # the models on CSR graphs: fixed-order sums
for cls in (pyg_maxk.nn.MaxKGraphSAGE, pyg_maxk.nn.MaxKGCN, pyg_maxk.nn.MaxKGIN):
    for dtype in (None, torch.bfloat16):
        torch.manual_seed(0)
        model = cls(64, 128, 2, 7, k=16).cuda()
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x, ei).float(), y)
        loss.backward()
        sums.append([float(loss)]
                    + [float(p.grad.double().abs().sum()) for p in model.parameters()])
ours = [d for d in gc.get_objects() if isinstance(d, CUDADispatcher)
        and type(d._cache).__name__ == "PackageCache"]
print(json.dumps({"kernels": len(ours),
                  "hits": sum(sum(d._cache_hits.values()) for d in ours),
                  "misses": sum(sum(d._cache_misses.values()) for d in ours),
                  "sums": sums}))
"""


def _run_cache_probe(cache_dir):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYG_MAXK_KERNEL_CACHE=str(cache_dir),
               PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _CACHE_PROBE], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_new_process_loads_the_compiled_kernels(tmp_path):
    cold = _run_cache_probe(tmp_path)
    assert cold["kernels"] > 0 and cold["misses"] > 0 and cold["hits"] == 0
    warm = _run_cache_probe(tmp_path)
    assert warm["misses"] == 0 and warm["hits"] == cold["misses"]
    # The loaded kernels compute what the compiled ones did (the backward's
    # float atomics add in no fixed order: rounding apart).
    for a, b in zip(cold["sums"], warm["sums"]):
        assert a == pytest.approx(b, rel=1e-4)


def test_small_graphs_give_no_occupancy_warnings():
    # Numba warns of grids smaller than the GPU on each launch it makes (a
    # kernel's first launch through a new launcher); a small graph's grids
    # are small by nature, so the package keeps that warning from the user.
    from pyg_maxk.ops import _launch
    _launch.launcher.cache_clear()
    ei = random_edge_index(14, 14, 50, seed=3).cuda()
    ours, _ = make_pair("sage")
    ours = ours.cuda()
    x = torch.randn(14, 24, device="cuda", requires_grad=True)
    with warnings.catch_warnings(), pyg_maxk.use_backend("numba"):
        warnings.simplefilter("error")
        ours(x, ei).sum().backward()
    assert x.grad is not None


def _host_syncs(fn) -> list:
    """Where ``fn`` makes synchronising CUDA calls: the innermost package
    line of each (the warnings of ``torch.cuda.set_sync_debug_mode``)."""
    import traceback
    sites = []

    def record(message, *args, **kwargs):
        # The sync warnings' own text: turning the mode on also warns once
        # that it "does not yet detect all synchronizing operations".
        if "called a synchronizing CUDA operation" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "pyg_maxk" in f.filename]
            sites.append(f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?")

    # A collection inside fn may finalise objects of earlier tests (whose
    # frees can sync): collect first, and not during fn.
    gc.collect()
    gc.disable()
    shown = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = shown
        gc.enable()
    return sites


@pytest.mark.parametrize("normalization", ["mean", "sum", "gcn"])
def test_a_new_graph_makes_no_host_sync(normalization):
    # What a conv builds for an edge_index it has not seen (a new graph per
    # mini-batch): the CSR (a stable sort, binary searches for the row
    # pointers), the range check (a device-side assert) and the operands of
    # one k with the bounded schedule.
    ei = random_edge_index(300, 300, 3000, seed=5).cuda()
    CSRGraph.from_adj(ei, (300, 300), normalization=normalization,
                      cache=False).operands_without_sync(4)
    torch.cuda.synchronize()
    sites = _host_syncs(lambda: CSRGraph.from_adj(
        ei.clone(), (300, 300), cache=False, normalization=normalization
    ).operands_without_sync(4))
    assert sites == []
    # The exact schedule (prepare) reads its two sizes in one sync.
    sites = _host_syncs(lambda: CSRGraph.from_adj(
        ei.clone(), (300, 300), cache=False, normalization=normalization).prepare(4))
    assert len(sites) <= 1, sites
    # A new graph's edge list (what a layer takes for it): no sync either.
    EdgeListGraph.from_edge_index(ei, (300, 300), normalization=normalization)
    torch.cuda.synchronize()
    assert _host_syncs(lambda: EdgeListGraph.from_edge_index(
        ei.clone(), (300, 300), normalization=normalization)) == []


@pytest.mark.parametrize("kind, learnable_weights, edge_lists", [
    ("sage", False, False), ("gcn", False, False), ("gcn", True, False), ("gin", False, False),
    ("sage", False, True), ("gcn", False, True), ("gin", False, True)])
def test_a_training_step_on_a_new_graph_makes_no_host_sync(monkeypatch, kind,
                                                           learnable_weights, edge_lists):
    # A new edge_index on every step, as mini-batches give: forward, loss,
    # backward and optimiser step with synchronising calls made errors
    # (GCN's normalisation too, which PyG's gcn_norm does with a sync; with
    # learnable edge weights, their values per call on the new structure),
    # over the new graph's CSR or its edge list.
    from pyg_maxk.graph import edge_list
    from pyg_maxk.nn import MaxKGCN, MaxKGIN, MaxKGraphSAGE
    monkeypatch.setattr(edge_list, "LAYERS_TAKE_EDGE_LISTS", edge_lists)
    torch.manual_seed(0)
    model = {"sage": MaxKGraphSAGE, "gcn": MaxKGCN, "gin": MaxKGIN}[kind](48, 64, 2, 5,
                                                                        k=8).cuda()
    x, y = torch.randn(300, 48, device="cuda"), torch.randint(0, 5, (300,), device="cuda")
    ei = random_edge_index(300, 300, 3000, seed=6).cuda()
    weight = torch.nn.Parameter(torch.rand(ei.size(1), device="cuda") + 0.5)
    opt = torch.optim.Adam([*model.parameters(), weight])

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(x, ei.clone(), weight) if learnable_weights else model(x, ei.clone())
        torch.nn.functional.cross_entropy(out, y).backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _gin_pair_on_cuda(f_in=24):
    from torch_geometric.nn import GINConv

    from pyg_maxk.nn import MaxKGINConv
    torch.manual_seed(0)
    ours, stock = MaxKGINConv(gin_mlp(f_in), k=6).cuda(), GINConv(gin_mlp(f_in)).cuda()
    ours.load_state_dict(stock.state_dict())
    return ours, stock


def _assert_gin_calls_match_stock(ours, stock, x, ei, calls):
    # No load_state_dict between calls (it edits eps in place, which makes
    # the next call read it again): the same weights, call after call.
    for _ in range(calls):
        x_ours, x_stock = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = ours(x_ours, ei), stock(dense_maxk(x_stock, 6), ei)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        weight = torch.randn_like(ref)
        (out * weight).sum().backward()
        (ref * weight).sum().backward()
        torch.testing.assert_close(x_ours.grad, x_stock.grad, rtol=1e-4, atol=1e-5)
        stock_params = dict(stock.named_parameters())
        for name, p in ours.named_parameters():
            torch.testing.assert_close(p.grad, stock_params[name].grad, rtol=1e-4, atol=1e-5)
        ours.zero_grad()
        stock.zero_grad()
        torch.cuda.synchronize()


def test_gin_root_term_runs_as_self_loops_once_a_gpu_graph_is_fixed():
    # At eps = 0 a GPU GIN conv takes a new edge_index as its edge list (the
    # dense root term), and a fixed one, once it is taken for one, as the CSR
    # graph with one more edge i -> i per node; stock's result on every call.
    from pyg_maxk.graph import edge_list
    ours, stock = _gin_pair_on_cuda()
    ei = random_edge_index(300, 300, 2000, seed=9).cuda()
    x = torch.randn(300, 24, device="cuda")
    assert isinstance(ours.graph_for(ei.clone(), x, x), EdgeListGraph)
    _assert_gin_calls_match_stock(ours, stock, x, ei, edge_list.CSR_AFTER_HITS + 3)
    graph = ours.graph_for(ei, x, x)
    assert isinstance(graph, CSRGraph) and graph.root_loops
    assert graph.num_edges == ei.size(1) + 300


def test_gin_root_loops_on_a_gpu_follow_in_place_edits_of_eps():
    # eps is read on the host without a sync, from the call after each edit:
    # the call in between adds the root term itself. Every call as stock's.
    from pyg_maxk.graph import edge_list
    ours, stock = _gin_pair_on_cuda()
    ei = random_edge_index(300, 300, 2000, seed=10).cuda()
    x = torch.randn(300, 24, device="cuda")
    calls = edge_list.CSR_AFTER_HITS + 3
    _assert_gin_calls_match_stock(ours, stock, x, ei, calls)
    assert ours.graph_for(ei, x, x).root_loops
    with torch.no_grad():
        ours.eps.fill_(0.5)
        stock.eps.fill_(0.5)
    _assert_gin_calls_match_stock(ours, stock, x, ei, 3)
    assert not ours.graph_for(ei, x, x).root_loops
    stock.eps.zero_()
    ours.load_state_dict(stock.state_dict())
    _assert_gin_calls_match_stock(ours, stock, x, ei, 3)
    assert ours.graph_for(ei, x, x).root_loops


def test_gin_eps_edited_through_data_under_gpu_root_loops_is_a_device_side_assert():
    # An edit through .data bumps no version counter, so the host keeps the
    # value it read: the conv checks eps = 0 on the device (a fresh process:
    # a device-side assert ends its CUDA context).
    code = ("import torch\n"
            "from pyg_maxk.nn import MaxKGINConv\n"
            "conv = MaxKGINConv(torch.nn.Linear(16, 8), k=4).cuda()\n"
            "ei = torch.randint(0, 50, (2, 200), device='cuda')\n"
            "x = torch.randn(50, 16, device='cuda')\n"
            "for _ in range(12):\n"
            "    conv(x, ei)\n"
            "    torch.cuda.synchronize()\n"
            "assert conv.graph_for(ei, x, x).root_loops\n"
            "conv.eps.data.fill_(0.5)\n"
            "conv(x, ei)\n"
            "torch.cuda.synchronize()\n")
    assert_device_side_assert(code, "eps changed")


@pytest.mark.parametrize("build", ["CSRGraph.from_adj(ei, (5, 5))",
                                   "graph.EdgeListGraph.from_edge_index(ei, (5, 5))"])
def test_an_out_of_range_edge_index_on_a_gpu_is_a_device_side_assert(build):
    # Checked without a host sync: the failure surfaces at the next sync
    # (a fresh process: a device-side assert ends its CUDA context).
    code = ("import torch\n"
            "from pyg_maxk import CSRGraph, graph\n"
            "ei = torch.tensor([[0, 7], [1, 2]], device='cuda')\n"
            f"g = {build}\n"
            "torch.cuda.synchronize()\n")
    assert_device_side_assert(code, "edge_index holds")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("normalization", ["sum", "mean", "gcn", "learnable"])
def test_repeated_calls_read_their_own_tensors(dtype, normalization):
    # From the second call on inputs of one kind an op patches its tensors'
    # pointers into launches prepared on the first: every call must read
    # its own features (and edge values) and write its own outputs, a hub
    # row split over work items included.
    graph = power_law_graph(num_nodes=3000, avg_degree=8, max_degree=2000, seed=2,
                            normalization="sum" if normalization == "learnable" else normalization)
    graph.prepare(16)  # the graphs of other edge values share its operands
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        weights = None
        if normalization == "learnable":
            weights = torch.rand(graph.num_edges, device="cuda", generator=gen).requires_grad_()
        grads = [torch.randn(graph.num_dst, 64, device="cuda", generator=gen, dtype=dtype)
                 for _ in range(2)]
        x = torch.randn(graph.num_src, 64, device="cuda", generator=gen, dtype=dtype)
        results = []
        for backend in ("numba", "torch"):
            poison_allocator()
            xb = x.clone().requires_grad_()
            wb = None if weights is None else weights.detach().clone().requires_grad_()
            g = graph if wb is None else graph.with_weight(wb, "sum")
            with pyg_maxk.use_backend(backend):
                agg, _, dense = pyg_maxk.ops.maxk_aggregate(xb, 16, g, with_dense=True)
                ((agg.float() * grads[0]).sum() + (dense.float() * grads[1]).sum()).backward()
            results.append((agg.float(), dense.float(), xb.grad.float(),
                            None if wb is None else wb.grad))
        tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
        for ours, ref in zip(*results):
            if ref is not None:
                torch.testing.assert_close(ours, ref, **tol)
    assert int(split_items(graph, 16).count_nonzero()) > 0
    if numba_ops.launcher()._driver is not None:  # the third calls took prepared launches
        for plans in (numba_ops._PLANS, numba_ops._graph_plans(unpack(*graph.operands(16)))):
            assert any(isinstance(p, PreparedLaunch) for p in plans.values())


def test_launches_read_each_calls_tensors_whatever_changes():
    # Each kind of call runs three times first (from the second, launches
    # are prepared and later calls patch their pointers into them); then
    # inputs of that kind's shapes that differ in what a stale launch would
    # get wrong, each against the torch backend on poisoned memory.
    ei = random_edge_index(12, 12, 40, seed=6).cuda()
    graph = CSRGraph.from_adj(ei, (12, 12), normalization="mean", cache=False)
    gen = torch.Generator().manual_seed(0)

    def check(base, k, g, view=lambda t: t):
        # maxk_aggregate of view(base), forward and the gradient reaching base.
        grad = torch.randn(g.num_dst, view(base).size(1), generator=gen).to(base)
        results = []
        for backend in ("numba", "torch"):
            poison_allocator()
            leaf = base.detach().clone().requires_grad_()
            with pyg_maxk.use_backend(backend):
                agg, _, dense = pyg_maxk.ops.maxk_aggregate(view(leaf), k, g, with_dense=True)
                (agg.float() * grad.float()).sum().backward()
            results.append((agg, dense, leaf.grad))
        tol = dict(rtol=1e-5, atol=1e-5) if base.dtype == torch.float32 else dict(rtol=2e-2,
                                                                                    atol=2e-2)
        for ours, ref in zip(*results):
            torch.testing.assert_close(ours, ref, **tol)

    def features(rows=12, cols=16, dtype=torch.float32, device="cuda"):
        return torch.randn(rows, cols, generator=gen).to(device, dtype)

    for _ in range(3):
        check(features(), 4, graph)
    if numba_ops.launcher()._driver is not None:
        assert any(isinstance(p, PreparedLaunch) for p in numba_ops._PLANS.values())
    check(features(cols=24), 4, graph, lambda t: t[:, 4:20])  # strided: read as a copy
    check(features(rows=13), 4, graph, lambda t: t[1:])       # a view at a storage offset
    other = CSRGraph.from_adj(random_edge_index(12, 12, 40, seed=7).cuda(), (12, 12),
                              normalization="mean", cache=False)
    check(features(), 4, other)                               # a new graph of the same shape
    edited = ei.clone()
    edited[0, :20] = edited[0, :20].flip(0)                   # an edited edge_index
    check(features(), 4, CSRGraph.from_adj(edited, (12, 12), normalization="mean"))
    longer = torch.cat([ei, random_edge_index(12, 12, 40, seed=8).cuda()], 1)
    check(features(), 4, CSRGraph.from_adj(longer[:, 40:], (12, 12), normalization="mean"))
    check(features(), 3, graph)                               # another k
    check(features(dtype=torch.bfloat16), 4, graph)           # another dtype
    for edges in (ei, edited, ei.clone()):                    # edge lists
        edge_list = EdgeListGraph.from_edge_index(edges, (12, 12), normalization="mean")
        check(features(), 4, edge_list)
        check(features(dtype=torch.bfloat16), 4, edge_list)
    if numba_ops.launcher()._driver is not None:  # one size's edge lists share their launches
        prepared = {key[0] for key, p in numba_ops._PLANS.items()
                    if isinstance(p, PreparedLaunch)}
        assert {"edge_list_check", "edge_list_scale", "edge_list_spgemm",
                "edge_list_sspmm"} <= prepared
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                             # torch's current stream
        check(features(), 4, graph)
        check(features(), 4, EdgeListGraph.from_edge_index(ei, (12, 12),
                                                           normalization="mean"))
    torch.cuda.current_stream().wait_stream(side)
    if torch.cuda.device_count() > 1:                         # plans are per device
        with torch.cuda.device(1):
            check(features(device="cuda:1"), 4, CSRGraph.from_adj(
                ei.to("cuda:1"), (12, 12), normalization="mean", cache=False))


@pytest.mark.parametrize("normalization", ["mean", "sum", "gcn"])
@pytest.mark.parametrize("dim,k", [(64, 16), (256, 32)])
def test_edge_list_of_a_power_law_graph_against_float64(normalization, dim, k):
    # The edge-list kernels' atomics on a hub of 50,000 in-edges (and its
    # sources), in a shuffled edge list, against the CSR graph in float64.
    ei = power_law_edges(num_nodes=20_000, avg_degree=10)
    ei = ei[:, torch.randperm(ei.size(1), device="cuda")]
    edge_list = EdgeListGraph.from_edge_index(ei, (20_000, 20_000), normalization=normalization)
    csr = CSRGraph.from_adj(ei, (20_000, 20_000), normalization=normalization, cache=False)
    check_kernels(edge_list, dim=dim, k=k, reference=csr, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_deterministic_mode_gives_the_same_bits_every_run(kind):
    # A fresh edge_index with a 50,000-neighbour hub: under deterministic
    # mode no edge list and no float atomics, so two runs agree bit for bit
    # (forward and every gradient), and the contract holds. warn_only: stock's
    # cuBLAS GEMMs would otherwise need CUBLAS_WORKSPACE_CONFIG set first.
    from pyg_maxk.graph.edge_list import takes_edge_list

    ei = power_law_edges(num_nodes=20_000, avg_degree=10)
    ei = ei[:, torch.randperm(ei.size(1), device="cuda")]
    x = torch.randn(20_000, 64, device="cuda")
    maxk_conv, stock_conv = (m.cuda() for m in make_pair(kind, f_in=64, k=16))
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert not takes_edge_list(ei, None, torch.float32)
        runs = []
        for _ in range(2):
            pyg_maxk.clear_graph_cache()
            maxk_conv.zero_grad()
            xs = x.clone().requires_grad_()
            out = maxk_conv(xs, ei.clone())
            out.backward(torch.ones_like(out) / out.numel() ** 0.5 + out.detach())
            runs.append([out.detach(), xs.grad] + [p.grad for p in maxk_conv.parameters()])
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        maxk_conv.zero_grad()
        assert_same_as_stock(maxk_conv, stock_conv, x, (ei,), 16, backend="auto", rtol=1e-4,
                             atol=1e-4)
        with pyg_maxk.use_backend("numba"), pytest.warns(UserWarning, match="float atomic"):
            maxk_conv(x, ei.clone())
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
