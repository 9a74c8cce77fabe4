"""torch.compile of models built from the MaxK convs: eager's outputs and
gradients with static and dynamic shapes, no graph break on a prepared
graph (fullgraph=True), one per model call on a raw edge_index, fresh
results for a new adjacency, and a clear error for TorchScript."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch_geometric.data import Data

import pyg_maxk
from helpers import random_edge_index
from pyg_maxk.nn import MaxKGCN, MaxKGIN, MaxKGraphSAGE, MaxKSAGEConv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, F_IN, HIDDEN, K = 40, 12, 24, 6
#: (rtol, atol) of compiled against eager: on a GPU the backward's float
#: atomics add in no fixed order, so two runs agree to rounding only.
TOL = (1e-5, 1e-6) if DEVICE == "cpu" else (1e-4, 1e-5)
MODELS = {"sage": (MaxKGraphSAGE, "mean"), "gcn": (MaxKGCN, "gcn"), "gin": (MaxKGIN, "sum")}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _data(seed=0, num_nodes=N, num_edges=160):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_nodes, F_IN, generator=g)
    return x.to(DEVICE), random_edge_index(num_nodes, num_nodes, num_edges, seed=seed).to(DEVICE)


def _model(kind, seed=0):
    torch.manual_seed(seed)
    cls, _ = MODELS[kind]
    return cls(F_IN, HIDDEN, 2, 5, k=K, dropout=0.0).to(DEVICE)


def _run(model, x, adj):
    """Output and the gradients of every parameter and of ``x``."""
    model.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = model(x, adj)
    weight = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    (out * weight).sum().backward()
    return out.detach(), [x.grad] + [p.grad for p in model.parameters()]


def _assert_same(a, b, rtol=TOL[0], atol=TOL[1]):
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a, out_b, rtol=rtol, atol=atol)
    for g_a, g_b in zip(grads_a, grads_b):
        torch.testing.assert_close(g_a, g_b, rtol=rtol, atol=atol)


def _prepared(kind, edge_index, num_nodes=N):
    data = Data(edge_index=edge_index, num_nodes=num_nodes)
    return pyg_maxk.ToCSRGraph(MODELS[kind][1], k=K)(data).adj_t


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.slow
def test_compiled_model_matches_eager(kind, dynamic, prepared):
    x, ei = _data()
    adj = _prepared(kind, ei) if prepared else ei
    model = _model(kind)
    expected = _run(model, x, adj)
    compiled = torch.compile(model, backend="aot_eager", dynamic=dynamic, fullgraph=prepared)
    _assert_same(_run(compiled, x, adj), expected)
    # A second graph of another size through the same compiled model.
    x2, ei2 = _data(seed=1, num_nodes=N + 7, num_edges=200)
    adj2 = _prepared(kind, ei2, N + 7) if prepared else ei2
    _assert_same(_run(compiled, x2, adj2), _run(model, x2, adj2))


@pytest.mark.parametrize("kind", list(MODELS))
def test_dropout_in_training_compiles_whole_and_draws_as_eager(kind):
    # Dropout on the kept values is drawn before the fused op (a random op
    # dynamo traces): no graph break on a prepared graph, and eager's draw
    # for one seed where the compiled graph runs torch's own random ops.
    x, ei = _data()
    adj = _prepared(kind, ei)
    torch.manual_seed(0)
    model = MODELS[kind][0](F_IN, HIDDEN, 2, 5, k=K, dropout=0.5).to(DEVICE).train()
    torch.manual_seed(1)
    expected = _run(model, x, adj)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.manual_seed(1)
    _assert_same(_run(compiled, x, adj), expected)
    torch.manual_seed(2)
    assert not torch.equal(_run(model, x, adj)[0], expected[0])  # the draw follows the seed


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.slow
def test_inductor_compiles_a_prepared_graph_whole(kind):
    x, ei = _data()
    adj = _prepared(kind, ei)
    model = _model(kind)
    compiled = torch.compile(model, fullgraph=True)
    # Inductor fuses and reorders float32 sums: rounding-level differences.
    _assert_same(_run(compiled, x, adj), _run(model, x, adj), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.slow
def test_graph_breaks(kind):
    x, ei = _data()
    model = _model(kind)
    assert torch._dynamo.explain(model)(x, _prepared(kind, ei)).graph_break_count == 0
    # A raw adjacency: the model resolves its graph once, outside the graph.
    assert torch._dynamo.explain(model)(x, ei).graph_break_count == 1
    torch._dynamo.reset()
    conv = MaxKSAGEConv(F_IN, HIDDEN, k=K).to(DEVICE)
    assert torch._dynamo.explain(conv)(x, ei).graph_break_count <= 1  # per conv call


def _graph_inputs(model, x, adj, **kwargs):
    """Inputs of the compiled forward graph that are neither ``x`` nor a
    parameter or buffer: what the graph costs at the compiled boundary."""
    from torch._functorch.aot_autograd import aot_module_simplified
    counts = []

    def forward_compiler(gm, example_inputs):
        counts.append(sum(node.op == "placeholder" for node in gm.graph.nodes))
        return gm

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler,
                                     bw_compiler=lambda gm, _: gm)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(x, adj, **kwargs).sum().backward()
    return counts[0] - 1 - len(list(model.parameters())) - len(list(model.buffers()))


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.slow
def test_a_prepared_graph_crosses_the_compiled_boundary_as_one_tensor(kind):
    """Every tensor at the boundary costs host time per call (guards, CUDA-graph
    input checks, saved tensors): the schedule, the structure and the edge
    values travel in one buffer."""
    x, ei = _data()
    assert _graph_inputs(_model(kind), x, _prepared(kind, ei)) == 1


@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.slow
def test_a_new_adjacency_of_the_same_shape_gives_its_own_result(prepared):
    x, ei = _data()
    _, other = _data(seed=5)  # same node and edge counts, other edges
    model = _model("sage")
    compiled = torch.compile(model, backend="aot_eager")
    adjs = [_prepared("sage", e) if prepared else e for e in (ei, other)]
    outs = [compiled(x, adj) for adj in adjs]
    for adj, out in zip(adjs, outs):
        torch.testing.assert_close(out, model(x, adj), rtol=TOL[0], atol=TOL[1])
    assert not torch.allclose(outs[0], outs[1])
    # An edge_index edited in place is a new graph too.
    ei[0, :20] = (ei[0, :20] + 1) % N
    torch.testing.assert_close(compiled(x, ei), model(x, ei), rtol=TOL[0], atol=TOL[1])


@pytest.mark.slow
def test_precomputed_gcn_normalisation_compiles_and_trains():
    import torch_geometric.transforms as T
    x, ei = _data()
    data = T.GCNNorm()(Data(x=x, edge_index=ei, num_nodes=N))
    y = torch.randint(0, 5, (N,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    losses = []
    for compile_it in (False, True):
        model = MaxKGCN(F_IN, HIDDEN, 2, 5, k=K, normalize=False).to(DEVICE)
        model.load_state_dict(_model("gcn").state_dict())
        step_model = torch.compile(model, backend="aot_eager") if compile_it else model
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        run = []
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(
                step_model(data.x, data.edge_index, data.edge_weight), y)
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    assert losses[0][-1] < losses[0][0]


@pytest.mark.slow
def test_a_change_of_backend_recompiles():
    from pyg_maxk.ops import torch_ops
    x, ei = _data()
    adj = _prepared("sage", ei)
    model = _model("sage")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    expected = model(x, adj)
    calls = []
    original = torch_ops.spgemm
    torch_ops.spgemm = lambda *a: calls.append(1) or original(*a)
    try:
        torch.testing.assert_close(compiled(x, adj), expected)
        assert not calls  # "auto": the numba or cpu kernels
        with pyg_maxk.use_backend("torch"):
            torch.testing.assert_close(compiled(x, adj), expected, rtol=TOL[0], atol=TOL[1])
        assert calls, "the compiled model kept the backend it was first compiled with"
    finally:
        torch_ops.spgemm = original


@pytest.mark.slow
def test_a_graph_not_prepared_for_the_layers_k_breaks_the_graph_once():
    x, ei = _data()
    data = Data(edge_index=ei, num_nodes=N)
    adj = pyg_maxk.ToCSRGraph("mean", k=K + 1)(data).adj_t
    model = _model("sage")
    with pytest.raises(Exception, match=r"call graph\.prepare\(k\)"):
        torch.compile(model, backend="aot_eager", fullgraph=True)(x, adj)
    torch._dynamo.reset()
    assert torch._dynamo.explain(model)(x, adj).graph_break_count == 1
    torch.testing.assert_close(torch.compile(model, backend="aot_eager")(x, adj), model(x, adj))


def test_a_prepared_graph_must_suit_the_conv():
    x, ei = _data()
    model = _model("gcn")
    with pytest.raises(ValueError, match="'gcn' normalisation.*ToCSRGraph"):
        model(x, _prepared("sage", ei))
    with pytest.raises(ValueError, match="edge_weight with a CSRGraph"):
        model(x, _prepared("gcn", ei), torch.ones(ei.size(1), device=DEVICE))


def test_to_csr_graph_moves_with_the_data():
    x, ei = _data()
    data = pyg_maxk.ToCSRGraph("mean", k=K)(Data(x=x.cpu(), edge_index=ei.cpu()))
    assert "edge_index" not in data and isinstance(data.adj_t, pyg_maxk.CSRGraph)
    moved = copy.copy(data).to(DEVICE)
    assert moved.adj_t.device.type == DEVICE
    assert moved.adj_t.is_prepared(K) and all(  # still static inputs for CUDA graphs
        getattr(t, "_dynamo_static_input_type", None) for t in moved.adj_t.operands(K).tensors()
        if t is not None)
    model = _model("sage")
    torch.testing.assert_close(model(moved.x, moved.adj_t), model(x, ei), rtol=TOL[0],
                               atol=TOL[1])


def test_torchscript_is_a_clear_error():
    for module in (MaxKSAGEConv(F_IN, HIDDEN, k=K), _model("gin")):
        with pytest.raises(RuntimeError, match="TorchScript.*torch.compile"):
            torch.jit.script(module)


@pytest.mark.slow
def test_fullgraph_on_a_raw_adjacency_says_how_to_prepare_it():
    x, ei = _data()
    with pytest.raises(Exception, match="ToCSRGraph"):
        torch.compile(_model("sage"), backend="aot_eager", fullgraph=True)(x, ei)
