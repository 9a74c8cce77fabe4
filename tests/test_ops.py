"""The custom ops of ``pyg_maxk.ops._library`` on every backend that runs
here: ``torch.library.opcheck`` (schema, autograd registration, fake vs real
metadata, AOT dispatch with dynamic shapes), the fake implementations
against the real ones on edge-case inputs, and eager calls against the
dispatcher's."""
from __future__ import annotations

import pytest
import torch

import pyg_maxk
from helpers import poison_allocator, random_edge_index
from pyg_maxk import CSRGraph
from pyg_maxk.ops import _library as lib
from pyg_maxk.ops._conv_node import maxk_aggregate_linear_eager

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
#: The backends that run on this machine (the numba backend's kernels run in
#: Numba's simulator without a GPU: slow, so only the metadata checks).
BACKENDS = ["torch", "numba"] if ON_GPU else ["torch", "cpu",
                                               pytest.param("numba", marks=pytest.mark.sim)]
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor",
            "test_aot_dispatch_dynamic")


def _graph(num_src, num_dst, num_edges, normalization, seed=0):
    ei = random_edge_index(num_src, num_dst, num_edges, seed=seed).to(DEVICE)
    kwargs = {}
    if normalization == "gcn_weighted":
        normalization, kwargs = "gcn", {"edge_weight": torch.rand(num_edges, device=DEVICE)}
    return CSRGraph.from_adj(ei, (num_src, num_dst), normalization=normalization, **kwargs)


def _cbsr(num_rows, dim, k, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    values, idx = torch.randn(num_rows, dim, generator=g).topk(k, dim=1)
    return (values.to(DEVICE, dtype).requires_grad_(),
            idx.to(DEVICE, pyg_maxk.index_dtype_for(dim)))


def op_cases(backend, dtype=torch.float32):
    """``(op, args)`` for every op: bipartite and square graphs, with and
    without edge values, a row scale, empty edge sets and no rows."""
    cases = []
    for num_src, num_dst, num_edges, norm in ((12, 12, 40, "mean"), (9, 7, 25, "sum"),
                                              (10, 10, 30, "gcn_weighted"), (6, 5, 0, "sum")):
        graph, (dim, k) = _graph(num_src, num_dst, num_edges, norm), (20, 4)
        values, indices = _cbsr(num_src, dim, k, dtype=dtype)
        ops = graph.operands(k)
        cases.append((lib.spgemm, (*ops, values, indices, num_dst, dim, backend)))
        grad_out = torch.randn(num_dst, dim, device=DEVICE, dtype=dtype)
        cases.append((lib.sspmm, (*ops, indices, grad_out, num_src, backend)))
        cases.append((lib.sddmm, (*ops, values.detach(), indices, grad_out, backend)))
        if graph.weight is not None:  # learnable edge values: the SDDMM in the backward
            learnable = ops._replace(weight=graph.weight.detach().clone().requires_grad_())
            cases.append((lib.spgemm, (*learnable, values, indices, num_dst, dim, backend)))
        x = torch.randn(num_src, dim, device=DEVICE, dtype=dtype, requires_grad=True)
        scale = pyg_maxk.ops.dropout_scale(x, k, 0.5, True)
        for with_dense in (False, True):
            cases.append((lib.maxk_aggregate, (x, k, *ops, num_dst, with_dense, None, backend)))
        cases.append((lib.maxk_aggregate, (x, k, *ops, num_dst, True, scale, backend)))
        if graph.weight is not None:
            cases.append((lib.maxk_aggregate, (x, k, *learnable, num_dst, True, None, backend)))
        grad_values = torch.randn(num_src, k, device=DEVICE, dtype=dtype)
        grad_dense = torch.randn(num_src, dim, device=DEVICE, dtype=dtype)
        for given in ((grad_out, None, None, None), (grad_out, grad_values, grad_dense, None),
                      (None, grad_values, None, None), (None, None, grad_dense, None),
                      (grad_out, grad_values, grad_dense, scale)):
            cases.append((lib.maxk_input_grad, (*ops, indices, *given, dim, dtype, backend)))
        dense = torch.randn(num_src, dim, device=DEVICE, dtype=dtype, requires_grad=True)
        weight = None if graph.weight is None else graph.weight.to(dtype)
        cases.append((lib.spmm, (graph.rowptr, graph.col, weight, dense, num_src, False)))
    for rows in (7, 0):
        x = torch.randn(rows, 24, device=DEVICE, dtype=dtype, requires_grad=True)
        cases.append((lib.maxk_select, (x, 5, backend)))
        values, indices = _cbsr(rows, 24, 5, dtype=dtype)
        cases.append((lib.cbsr_to_dense, (values, indices, 24, backend)))
        dense = torch.randn(rows, 24, device=DEVICE, dtype=dtype, requires_grad=True)
        cases.append((lib.gather_at, (dense, indices, backend)))
        weight = torch.randn(6, 24, device=DEVICE, dtype=dtype, requires_grad=True)
        bias = torch.randn(6, device=DEVICE, dtype=dtype, requires_grad=True)
        dense = torch.randn(rows, 9, device=DEVICE, dtype=dtype, requires_grad=True)
        dense_weight = torch.randn(6, 9, device=DEVICE, dtype=dtype, requires_grad=True)
        for b in (bias, None):
            cases.append((lib.cbsr_linear, (values, indices, 24, weight, b, None, None, backend)))
        cases.append((lib.cbsr_linear, (values, indices, 24, weight, bias, dense, dense_weight,
                                        backend)))
        grad_out = torch.randn(rows, 6, device=DEVICE, dtype=dtype)
        for need in ((True, True, True), (True, False, False), (False, True, False),
                     (False, False, True)):
            cases.append((lib.cbsr_linear_backward,
                          (grad_out, values.detach(), indices, weight.detach(), 24, *need,
                           backend)))
    return cases


def _case_id(case):
    return case[0].name


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_passes_opcheck(backend):
    tests = OPCHECKS if backend != "numba" or ON_GPU else OPCHECKS[:3]
    covered = set()
    for op, args in op_cases(backend):
        torch.library.opcheck(op.op, args, test_utils=tests)
        covered.add(op)
    assert covered == set(lib.ALL_OPS)


def _metadata(out):
    outs = out if isinstance(out, tuple) else (out,)
    return [(t.shape, t.dtype, t.device) for t in outs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fake_implementations_report_the_real_metadata(backend, dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode
    if backend == "numba" and dtype == torch.float64:
        pytest.skip("the numba backend takes no float64 (a BackendError)")
    if backend == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the cpu backend takes no bfloat16 (a BackendError)")
    for op, args in op_cases(backend, dtype):
        real = op.op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                         for a in args]
            fake = op.op(*fake_args)
        assert _metadata(fake) == _metadata(real), op.name


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_calls_match_the_dispatcher(backend):
    # Eager mode skips the torch.library dispatcher (an autograd Function
    # around the same code); torch.compile sees the custom op. Same results,
    # forward and backward.
    for op, args in op_cases(backend):
        results = []
        for call in (op, op.op):
            inputs = [a.detach().clone().requires_grad_(a.requires_grad)
                      if isinstance(a, torch.Tensor) else a for a in args]
            out = call(*inputs)
            outs = out if isinstance(out, tuple) else (out,)
            floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
            if floats:
                sum(o.sum() * 0.5 + (o * o).sum() for o in floats).backward()
            grads = [a.grad for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
            results.append((outs, grads))
        (eager, eager_grads), (dispatched, dispatched_grads) = results
        for a, b in zip(eager + tuple(eager_grads), dispatched + tuple(dispatched_grads)):
            # The numba backward's atomics add in no fixed order.
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=op.name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatched_calls_without_autograd_run_the_implementation_once(backend, monkeypatch):
    # What compiled code calls at run time (no input needing a gradient,
    # plain tensors): the implementation straight from the autograd kernel,
    # without dispatching again below autograd; with fake tensors, the
    # second dispatch, to the fake implementation.
    from torch._subclasses.fake_tensor import FakeTensorMode
    redispatched = []
    original = torch._ops.OpOverload.redispatch
    monkeypatch.setattr(torch._ops.OpOverload, "redispatch",
                        lambda self, *a, **kw: redispatched.append(1) or original(self, *a, **kw))
    for op, args in op_cases(backend):
        plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        out = op.op(*plain)
        expected = op.impl(*plain)
        for got, want in zip(*(o if isinstance(o, tuple) else (o,) for o in (out, expected))):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=op.name)
        assert not redispatched, op.name
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in plain]
            op.op(*fake)
        assert redispatched, op.name
        redispatched.clear()


def test_the_requested_backend_travels_with_the_backward():
    # The backward runs the forward's choice, even where autograd runs it on
    # another thread (whose ContextVar holds no override).
    calls = []
    from pyg_maxk.ops import torch_ops
    original = torch_ops.sspmm
    torch_ops.sspmm = lambda *a: calls.append("sspmm") or original(*a)
    try:
        graph = _graph(8, 8, 20, "sum")
        values, indices = _cbsr(8, 16, 3)
        with pyg_maxk.use_backend("torch"):
            out = pyg_maxk.aggregate(graph, pyg_maxk.CBSR(values, indices, 16))
        out.sum().backward()  # outside the context
    finally:
        torch_ops.sspmm = original
    assert calls == ["sspmm"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dim, k", [pytest.param(20, 4, marks=pytest.mark.smoke), (64, 8),
                                    (64, 32), (64, 40), (256, 160)])
def test_edge_value_gradient_against_float64(backend, dim, k, monkeypatch):
    """The SDDMM (the aggregation's gradient w.r.t. its edge values) against a
    float64 dense reference, on rows split across work items, a bipartite
    graph, multi-edges and self-loops, and the empty edge set; ``k`` with 1,
    2 and 4 slots per load, groups of lanes wider than ``k`` and several
    chunks per lane (k=160); the torch backend over chunks of 7 edges (the
    last one shorter)."""
    import pyg_maxk.graph.schedule
    from pyg_maxk.ops import torch_ops
    # Rows of more than 16 edges split.
    monkeypatch.setattr(pyg_maxk.graph.schedule, "PAIRS_PER_ITEM", 16 * k)
    monkeypatch.setattr(torch_ops, "SDDMM_CHUNK_ENTRIES", 7 * k + 3)
    dtype = torch.float64 if backend != "numba" else torch.float32
    for num_src, num_dst, num_edges in ((30, 30, 400), (9, 7, 25), (6, 5, 0)):
        ei = random_edge_index(num_src, num_dst, num_edges, seed=1).to(DEVICE)
        if num_edges:  # a multi-edge and a self-loop
            ei = torch.cat([ei, ei[:, :1], torch.tensor([[3], [3]], device=DEVICE)], 1)
        weight = torch.rand(ei.size(1), device=DEVICE, dtype=torch.float64)
        graph = CSRGraph.from_adj(ei, (num_src, num_dst), edge_weight=weight,
                                  dtype=torch.float64 if dtype == torch.float64 else
                                  torch.float32)
        values, indices = _cbsr(num_src, dim, k, seed=2, dtype=dtype)
        ops = graph.operands(k)
        if num_edges == 400:
            assert bool((pyg_maxk.graph.unpack(*ops).item_split != 0).any())
        learnable = ops._replace(weight=graph.weight.detach().clone().requires_grad_())
        grad_out = torch.randn(num_dst, dim, device=DEVICE, dtype=dtype)
        with pyg_maxk.use_backend(backend):
            out = lib.spgemm(*learnable, values.detach(), indices, num_dst, dim, backend)
        (grad_weight,) = torch.autograd.grad(out, learnable.weight, grad_out)
        dense = torch.zeros(num_src, dim, dtype=torch.float64, device=DEVICE).scatter_(
            1, indices.long(), values.detach().double())
        row = torch.repeat_interleave(torch.arange(num_dst, device=DEVICE),
                                      (graph.rowptr[1:] - graph.rowptr[:-1]).long())
        expected = (dense[graph.col.long()] * grad_out.double()[row]).sum(1)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(grad_weight.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_dense", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_maxk_aggregate_equals_its_steps(backend, with_dense, dropout):
    # The fused op against maxk, aggregate and to_dense, forward and the
    # gradients of x (through all three outputs) and of the edge values;
    # with dropout on the kept values, one seed giving both the same draw.
    base = _graph(12, 12, 40, "gcn_weighted")
    edge_values = base.weight.detach().clone().requires_grad_()
    x = torch.randn(12, 20, device=DEVICE, requires_grad=True)
    results = []
    with pyg_maxk.use_backend(backend):
        for fused in (True, False):
            graph = base.with_weight(edge_values, base.normalization)  # fresh edge-value views
            torch.manual_seed(1)
            if fused:
                agg, h, dense = pyg_maxk.ops.maxk_aggregate(x, 4, graph, with_dense=with_dense,
                                                            dropout=dropout, training=True)
            else:
                h = pyg_maxk.maxk(x, 4, dropout=dropout, training=True)
                agg = pyg_maxk.aggregate(graph, h)
                dense = pyg_maxk.ops.to_dense(h) if with_dense else None
            loss = (agg * agg).sum() + (h.values ** 3).sum()
            if with_dense:
                loss = loss + (dense * torch.arange(20.0, device=DEVICE)).sum()
            else:
                assert dense is None
            results.append((agg, h.to_dense(), *torch.autograd.grad(loss, [x, edge_values])))
    if dropout:
        dropped = (results[0][1] == 0) & (pyg_maxk.maxk(x, 4).to_dense() != 0)
        assert dropped.any() and not dropped.all()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


#: Outputs of maxk_aggregate whose gradients flow, by case: ``(with_dense,
#: dropout, outputs used)``.
_EAGER_CASES = [(True, True, ("agg", "values", "dense")), (False, False, ("agg",)),
                (True, False, ("dense",)), (False, True, ("values",)),
                (True, True, ("agg", "dense"))]
#: The kernel families that run maxk_aggregate's eager path here (in Numba's
#: simulator one case: slow).
_EAGER_PARAMS = ([("numba", torch.float32, *case) for case in _EAGER_CASES] if ON_GPU else
                 [("cpu", torch.float32, *case) for case in _EAGER_CASES]
                 + [("cpu", torch.float64, *_EAGER_CASES[0]),
                    pytest.param("numba", torch.float32, *_EAGER_CASES[0],
                                 marks=pytest.mark.sim)])


@pytest.mark.parametrize("backend,dtype,with_dense,dropout,outputs", _EAGER_PARAMS)
def test_maxk_aggregate_eager_path_equals_the_op(backend, dtype, with_dense, dropout, outputs):
    # In eager mode, where one kernel family runs all its steps,
    # maxk_aggregate calls its implementations under one autograd node of
    # its own: its outputs and its gradient for any subset of them used are
    # the op's (called through the dispatcher).
    graph = _graph(26, 20, 120, "mean", seed=4)
    x = torch.randn(26, 24, device=DEVICE, dtype=dtype)
    scale = (torch.rand(26, 5, device=DEVICE) < 0.6).to(dtype) / 0.6 if dropout else None
    grads = {"agg": torch.randn(20, 24), "values": torch.randn(26, 5),
             "dense": torch.randn(26, 24)}
    results = []
    for eager in (True, False):
        xg = x.clone().requires_grad_()
        if eager:
            out = lib.maxk_aggregate_eager(xg, 5, graph.operands(5), 20, with_dense, scale,
                                           backend)
        else:
            out = lib.maxk_aggregate.op(xg, 5, *graph.operands(5), 20, with_dense, scale,
                                        backend)
        named = dict(zip(("agg", "values", "indices", "dense"), out))
        eager_node = type(named["agg"].grad_fn).__name__ == "maxk_aggregate_functionBackward"
        assert eager_node == eager
        loss = sum((named[name] * grads[name].to(DEVICE, dtype)).sum() for name in outputs)
        loss.backward()
        results.append((*[named[name] for name in outputs], named["indices"], xg.grad))
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", [
    "numba" if ON_GPU else pytest.param("numba", marks=pytest.mark.sim), "cpu"])
def test_maxk_aggregate_eager_backward_runs_again_with_retain_graph(backend):
    # The Numba select launch zeroes the sums of the backward's SSpMM; they
    # serve one backward, and a second one (retain_graph=True) adds the same
    # gradient again.
    if backend == "cpu" and ON_GPU:
        pytest.skip("the CPU kernels run CPU tensors")
    graph = _graph(26, 20, 120, "mean", seed=5)
    x = torch.randn(26, 24, device=DEVICE)
    grad = torch.randn(20, 24, device=DEVICE)
    poison_allocator()
    xg = x.clone().requires_grad_()
    agg = lib.maxk_aggregate_eager(xg, 5, graph.operands(5), 20, False, None, backend)[0]
    agg.backward(grad, retain_graph=True)
    first = xg.grad.clone()
    agg.backward(grad)
    ref = x.clone().requires_grad_()
    lib.maxk_aggregate.op(ref, 5, *graph.operands(5), 20, False, None, backend)[0].backward(grad)
    torch.testing.assert_close(first, ref.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xg.grad, 2 * ref.grad, rtol=1e-5, atol=1e-6)


def test_maxk_aggregate_eager_path_is_taken_only_where_it_applies():
    # Learnable edge values (their gradient is the op's SDDMM), a type or a
    # backend whose steps do not all run on one kernel family, an input
    # under a tracing mode: the op. A second derivative through the eager
    # node refuses, as the op's does.
    from torch._subclasses.fake_tensor import FakeTensorMode
    graph = _graph(12, 12, 40, "sum", seed=2)
    x = torch.randn(12, 16, device=DEVICE, requires_grad=True)
    packed = graph.operands(4)
    assert lib.maxk_aggregate_eager(x, 4, packed, 12, False, None, "auto") is not None
    learnable = graph.with_weight(torch.rand(graph.num_edges, device=DEVICE).requires_grad_(),
                                  "sum").operands(4)
    assert lib.maxk_aggregate_eager(x, 4, learnable, 12, False, None, "auto") is None
    assert lib.maxk_aggregate_eager(x.half(), 4, packed, 12, False, None, "auto") is None
    assert lib.maxk_aggregate_eager(x, 4, packed, 12, False, None, "torch") is None
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert lib.maxk_aggregate_eager(x, 4, packed, 12, False, None, "auto") is None
    agg = lib.maxk_aggregate_eager(x, 4, packed, 12, False, None, "auto")[0]
    (grad,) = torch.autograd.grad(agg.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives are not supported"):
        grad.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_maxk_aggregate_dropout_keeps_the_features_type(backend, dtype):
    # Dropout's factors are float32 at least; the kept values stay in the
    # features' type, rounded once, fused or in separate steps alike.
    if (backend, dtype) in (("cpu", torch.bfloat16), ("numba", torch.float64)):
        pytest.skip(f"the {backend} kernels do not take {dtype}")
    graph = _graph(12, 12, 40, "sum")
    x = torch.randn(12, 20, device=DEVICE, dtype=dtype, requires_grad=True)
    results = []
    with pyg_maxk.use_backend(backend):
        for fused in (True, False):
            torch.manual_seed(3)
            if fused:
                agg, h, dense = pyg_maxk.ops.maxk_aggregate(x, 4, graph, with_dense=True,
                                                            dropout=0.25, training=True)
            else:
                h = pyg_maxk.maxk(x, 4, dropout=0.25, training=True)
                agg, dense = pyg_maxk.aggregate(graph, h), pyg_maxk.ops.to_dense(h)
            assert h.values.dtype == dense.dtype == dtype
            loss = agg.float().square().sum() + dense.float().sum()
            results.append((agg, dense, *torch.autograd.grad(loss, [x])))
    tol = {} if dtype == torch.float64 else dict(rtol=1e-2, atol=1e-2)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **tol)


def test_a_backward_through_an_op_without_autograd_is_a_clear_error():
    # The backward's own ops (sspmm, sddmm, maxk_input_grad) have no
    # autograd: differentiating them again (create_graph=True) raises instead
    # of dropping their terms silently.
    graph = _graph(12, 12, 40, "sum")
    x = torch.randn(12, 20, device=DEVICE, requires_grad=True)
    agg, *_ = lib.maxk_aggregate(x, 4, *graph.operands(4), 12, False, None, "torch")
    (grad_x,) = torch.autograd.grad(agg.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        grad_x.sum().backward()


# ------------------------------------------------- maxk_aggregate_linear
_LINEAR_BACKENDS = ["numba"] if ON_GPU else ["cpu", pytest.param("numba", marks=pytest.mark.sim)]


def _linear_terms(terms, dim, out, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    weights = {"weight": torch.randn(out, dim, generator=g, dtype=dtype),
               "bias": torch.randn(out, generator=g, dtype=dtype) if "bias" in terms else None,
               "root_weight": (torch.randn(out, dim, generator=g, dtype=dtype)
                               if "root_weight" in terms else None),
               "root_scale": (torch.tensor([1.3], dtype=dtype) if "root_scale" in terms
                              else None)}
    return {name: None if t is None else t.to(DEVICE).requires_grad_(name != "root_scale")
            for name, t in weights.items()}


def _composed(x, k, graph, weight, bias, root_weight, root_scale, dropout):
    """maxk_aggregate_linear as its steps: maxk_aggregate, then the GEMMs."""
    with_dense = root_weight is not None or root_scale is not None
    agg, _, dense = pyg_maxk.ops.maxk_aggregate(x, k, graph, with_dense=with_dense,
                                                dropout=dropout, training=True)
    if root_scale is not None:
        agg = agg + root_scale * dense
    out = torch.nn.functional.linear(agg, weight, bias)
    return out if root_weight is None else out + dense @ root_weight.t()


@pytest.mark.parametrize("backend", _LINEAR_BACKENDS)
@pytest.mark.parametrize("terms", [(), ("bias",), ("bias", "root_weight"),
                                   ("bias", "root_scale"), ("root_weight",)])
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_maxk_aggregate_linear_node_equals_its_steps(backend, terms, dropout):
    # One autograd node (the eager path) against maxk_aggregate and torch's
    # GEMMs: the output and every gradient, with dropout drawn alike.
    graph = _graph(26, 26, 120, "mean", seed=6)
    x = torch.randn(26, 24, device=DEVICE)
    grad = torch.randn(26, 10, device=DEVICE)
    results = []
    for fused in (True, False):
        w = _linear_terms(terms, 24, 10)
        xg = x.clone().requires_grad_()
        torch.manual_seed(11)
        with pyg_maxk.use_backend(backend):
            if fused:
                out = pyg_maxk.ops.maxk_aggregate_linear(
                    xg, 5, graph, w["weight"], w["bias"], root_weight=w["root_weight"],
                    root_scale=w["root_scale"], dropout=dropout, training=True)
                assert type(out.grad_fn).__name__ == "maxk_aggregate_linear_functionBackward"
            else:
                out = _composed(xg, 5, graph, **w, dropout=dropout)
        out.backward(grad)
        results.append([out, xg.grad] + [w[n].grad for n in ("weight", "bias", "root_weight")
                                          if w[n] is not None])
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["numba"] if ON_GPU else [
    "cpu", pytest.param("numba", marks=[pytest.mark.sim, pytest.mark.smoke])])
def test_maxk_aggregate_linear_node_computes_only_the_gradients_asked_for(backend):
    # Frozen weights, features without a gradient, no grad mode, a second
    # backward (retain_graph=True: the sums the select zeroed serve once).
    graph = _graph(20, 20, 90, "sum", seed=3)
    x = torch.randn(20, 16, device=DEVICE)
    grad = torch.randn(20, 6, device=DEVICE)
    w = _linear_terms(("bias", "root_weight"), 16, 6)
    with pyg_maxk.use_backend(backend):
        ref_x = x.clone().requires_grad_()
        _composed(ref_x, 4, graph, **w, dropout=0.0).backward(grad)
        ref = [ref_x.grad] + [w[n].grad.clone() for n in ("weight", "bias", "root_weight")]
        for t in w.values():
            if t is not None:
                t.grad = None
        w["weight"].requires_grad_(False)
        out = pyg_maxk.ops.maxk_aggregate_linear(x, 4, graph, w["weight"], w["bias"],
                                                 root_weight=w["root_weight"])
        out.backward(grad)
        assert w["weight"].grad is None
        torch.testing.assert_close(w["bias"].grad, ref[2])
        torch.testing.assert_close(w["root_weight"].grad, ref[3], rtol=1e-5, atol=1e-5)
        xg = x.clone().requires_grad_()
        poison_allocator()
        out = pyg_maxk.ops.maxk_aggregate_linear(xg, 4, graph, w["weight"], w["bias"],
                                                 root_weight=w["root_weight"])
        out.backward(grad, retain_graph=True)
        torch.testing.assert_close(xg.grad, ref[0], rtol=1e-5, atol=1e-5)
        out.backward(grad)
        torch.testing.assert_close(xg.grad, 2 * ref[0], rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            plain = pyg_maxk.ops.maxk_aggregate_linear(xg, 4, graph, w["weight"], w["bias"],
                                                       root_weight=w["root_weight"])
        assert plain.grad_fn is None
        torch.testing.assert_close(plain, out.detach())


def test_maxk_aggregate_linear_composes_the_ops_where_its_node_does_not_apply():
    # The torch backend, weights of another dtype, a scale that needs a gradient,
    # learnable edge values, k >= dim: the same results through the ops one
    # by one (no node of its own). A second derivative refuses on both paths.
    graph = _graph(12, 12, 40, "sum", seed=2)
    x = torch.randn(12, 16, device=DEVICE, requires_grad=True)
    w = _linear_terms(("bias", "root_scale"), 16, 5)
    node = "maxk_aggregate_linear_functionBackward"

    def run(x, k=4, graph=graph, **changes):
        kwargs = dict(w, **changes)
        out = pyg_maxk.ops.maxk_aggregate_linear(x, k, graph, kwargs.pop("weight"),
                                                 kwargs.pop("bias"), **kwargs)
        torch.testing.assert_close(out, _composed(x, k, graph, **dict(w, **changes),
                                                  dropout=0.0), rtol=1e-5, atol=1e-5)
        return type(out.grad_fn).__name__

    assert run(x) == node
    with pyg_maxk.use_backend("torch"):
        assert run(x) != node
    assert maxk_aggregate_linear_eager(x, 4, graph.operands(4), 12, w["weight"].double(),
                                       None, None, None, None, "auto") is None
    assert run(x, root_scale=w["root_scale"].detach().requires_grad_()) != node
    learnable = graph.with_weight(torch.rand(graph.num_edges, device=DEVICE).requires_grad_(),
                                  "sum")
    assert run(x, graph=learnable) != node
    assert run(x, k=16) != node
    with pytest.raises(ValueError, match="as many targets as sources"):
        pyg_maxk.ops.maxk_aggregate_linear(x, 4, _graph(12, 9, 30, "sum"), w["weight"],
                                           root_scale=w["root_scale"])
    out = pyg_maxk.ops.maxk_aggregate_linear(x, 4, graph, w["weight"], w["bias"])
    (grad,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        grad.sum().backward()
