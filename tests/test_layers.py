"""The layer contract: MaxKXConv(args, k=k)(x, adj) == XConv(args)(maxk(x), adj),
forward and gradients, for every adjacency form and edge case."""

import warnings

import pytest
import torch
from torch_geometric.explain.algorithm.utils import set_masks
from torch_geometric.nn import GINConv, SAGEConv

import pyg_maxk
from helpers import (
    F_IN,
    F_OUT,
    FORMS,
    K,
    N,
    adjacency,
    assert_same_as_stock,
    dense_maxk,
    gin_mlp,
    make_pair,
    random_edge_index,
    random_features,
    random_weights,
)
from pyg_maxk import CBSR
from pyg_maxk.nn import MaxKGCNConv, MaxKGINConv, MaxKSAGEConv


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_contract_every_adjacency_form(kind, form):
    ei = random_edge_index(N, N, 50, seed=3)
    value = random_weights(ei.size(1)) if form in ("SparseTensor", "coo", "csr", "csc") else None
    adj = adjacency(form, ei, (N, N), value)
    ours, stock = make_pair(kind)
    if kind == "gcn" and form == "csc":
        # Stock GCNConv cannot normalise a CSC adjacency; neither can we.
        with pytest.raises(NotImplementedError):
            ours(random_features(), adj)
        return
    assert_same_as_stock(ours, stock, random_features(), (adj,), K)


@pytest.mark.parametrize("kind", ["sage", "gin"])
@pytest.mark.parametrize("form", ["edge_index", "SparseTensor", "csr"])
def test_contract_bipartite(kind, form):
    n_src, n_dst = 11, 7
    ei = random_edge_index(n_src, n_dst, 30, seed=4)
    adj = adjacency(form, ei, (n_src, n_dst))
    ours, stock = make_pair(kind)
    x = (random_features(n_src, seed=5), random_features(n_dst, seed=6))
    size = (n_src, n_dst) if form == "edge_index" else None
    args = (adj, size)
    assert_same_as_stock(ours, stock, x, args, K)


@pytest.mark.parametrize("kind", ["sage", "gin"])
def test_contract_bipartite_without_target_features(kind):
    n_src, n_dst = 11, 7
    ei = random_edge_index(n_src, n_dst, 30, seed=4)
    ours, stock = make_pair(kind)
    assert_same_as_stock(ours, stock, (random_features(n_src), None), (ei, (n_src, n_dst)), K)


def test_contract_gcn_edge_weight_and_options():
    ei = random_edge_index(N, N, 50, seed=7)
    w = random_weights(ei.size(1))
    for kw in ({}, {"improved": True}, {"add_self_loops": False},
               {"normalize": False}, {"bias": False}):
        ours, stock = make_pair("gcn", **kw)
        assert_same_as_stock(ours, stock, random_features(), (ei, w), K)


@pytest.mark.parametrize("kw", [{"aggr": "sum"}, {"root_weight": False},
                                {"normalize": True}, {"bias": False}])
def test_contract_sage_options(kw):
    ei = random_edge_index(N, N, 50, seed=8)
    ours, stock = make_pair("sage", **kw)
    assert_same_as_stock(ours, stock, random_features(), (ei,), K)


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_contract_empty_edge_set(kind):
    ei = torch.empty(2, 0, dtype=torch.long)
    ours, stock = make_pair(kind)
    assert_same_as_stock(ours, stock, random_features(), (ei,), K)


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_contract_wide_features_and_identity_k(kind):
    f_in = 300  # beyond uint8 indices
    ei = random_edge_index(N, N, 40, seed=9)
    ours, stock = make_pair(kind, f_in=f_in, k=17)
    x = random_features(f=f_in)
    assert pyg_maxk.maxk(x, 17).indices.dtype == torch.int16
    assert_same_as_stock(ours, stock, x, (ei,), 17)
    # k >= dim is the identity: the MaxK conv equals the stock conv on x.
    ours, stock = make_pair(kind, f_in=f_in, k=f_in + 5)
    assert_same_as_stock(ours, stock, x, (ei,), f_in + 5)


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
@pytest.mark.slow
def test_gradcheck_float64(kind):
    ei = random_edge_index(8, 8, 20, seed=10)
    torch.manual_seed(0)
    conv = make_pair(kind, f_in=6, k=3)[0].double()
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    with pyg_maxk.use_backend("torch"):
        assert torch.autograd.gradcheck(lambda x: conv(x, ei), (x,))


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_state_dict_loads_both_ways(kind):
    ours, stock = make_pair(kind)
    assert set(ours.state_dict()) == set(stock.state_dict())
    ours.load_state_dict(stock.state_dict())
    stock.load_state_dict(ours.state_dict())


def test_aliases_swap_with_one_import():
    from pyg_maxk.nn import GCNConv as G
    from pyg_maxk.nn import GINConv as I
    from pyg_maxk.nn import SAGEConv as S

    assert S is MaxKSAGEConv and G is MaxKGCNConv and I is MaxKGINConv
    conv = S(F_IN, F_OUT)  # stock arguments only: k defaults to 32
    assert conv.k == 32 and "k=32" in repr(conv)


@pytest.mark.parametrize("make", [
    lambda: MaxKSAGEConv(8, 8, aggr="lstm"),
    lambda: MaxKSAGEConv(8, 8, aggr="max"),
    lambda: MaxKSAGEConv(8, 8, project=True),
    lambda: MaxKGINConv(torch.nn.Linear(8, 8), aggr="mean"),
    lambda: MaxKSAGEConv(8, 8, flow="target_to_source"),
    lambda: MaxKSAGEConv(8, 8, k=0),
    lambda: MaxKGCNConv(8, 8, k=2.5),
])
def test_unsupported_options_are_clear_errors(make):
    with pytest.raises(ValueError):
        make()


def test_bad_inputs_raise():
    conv = MaxKSAGEConv(F_IN, F_OUT, k=K)
    ei = random_edge_index(N, N, 30)
    with pytest.raises(ValueError, match="2-D"):
        conv(torch.randn(F_IN), ei)
    with pytest.raises(ValueError, match="integer"):
        conv(random_features(), ei.float())
    with pytest.raises(ValueError, match="expects"):
        conv(random_features(), ei, (N + 1, N))
    with pytest.raises(ValueError, match="expects"):
        conv((random_features(N), random_features(N - 3)), ei, (N, N))
    with pytest.raises(IndexError):
        conv(random_features(N - 5), ei)
    meta = random_features().to("meta")
    with pytest.raises(ValueError, match="device"):
        conv(meta, ei)
    gcn = MaxKGCNConv(F_IN, F_OUT, k=K)
    with pytest.raises(ValueError, match="tuple"):
        gcn((random_features(), random_features()), ei)
    with pytest.raises(ValueError, match="edge mask has"):
        set_masks(gcn, torch.rand(ei.size(1) + 1), ei)
        gcn(random_features(), ei)


def test_graph_built_once_across_layers_and_epochs(monkeypatch):
    import pyg_maxk.graph.csr as graph_module

    builds, build = [], graph_module._build
    monkeypatch.setattr(graph_module, "_build", lambda *a: builds.append(1) or build(*a))
    ei = random_edge_index(N, N, 30)
    convs = [MaxKSAGEConv(F_IN, F_IN, k=K) for _ in range(3)]
    x = random_features()
    for _ in range(2):
        h = x
        for conv in convs:
            h = conv(h, ei)
        h.sum().backward()
    assert len(builds) == 1  # 3 layers x 2 epochs, forward and backward: one build
    ei[0, 0] = (ei[0, 0] + 1) % N  # an edit in place is a new graph
    convs[0](x, ei)
    assert len(builds) == 2


def test_dropout_on_kept_values_only():
    conv = MaxKSAGEConv(F_IN, F_OUT, k=K, dropout=0.5, root_weight=False, bias=False)
    stock = SAGEConv(F_IN, F_OUT, root_weight=False, bias=False)
    stock.load_state_dict(conv.state_dict())
    ei = random_edge_index(N, N, 30)
    x = random_features()
    conv.eval()
    torch.testing.assert_close(conv(x, ei), stock(dense_maxk(x, K), ei))  # no dropout in eval
    conv.train()
    torch.manual_seed(0)
    with pyg_maxk.use_backend("torch"):  # the same order of kept values as below
        out = conv(x, ei)
    # The same draw on the kept values alone (the MaxK-GNN paper's dropout):
    # zero or scaled by 1 / (1 - p) where MaxK keeps an entry, zero elsewhere.
    torch.manual_seed(0)
    with pyg_maxk.use_backend("torch"):
        h = pyg_maxk.maxk(x, K, dropout=0.5, training=True)
        kept = pyg_maxk.maxk(x, K)
    assert torch.equal(h.indices, kept.indices)
    dropped = h.values == 0
    assert 0 < dropped.float().mean() < 1
    torch.testing.assert_close(h.values[~dropped], 2 * kept.values[~dropped])
    torch.testing.assert_close(out, stock(h.to_dense(), ei))


@pytest.mark.parametrize("model_name", ["MaxKGraphSAGE", "MaxKGCN", "MaxKGIN"])
def test_models_train_and_stock_baseline(model_name):
    from pyg_maxk import nn as mnn

    cls = getattr(mnn, model_name)
    ei = random_edge_index(N, N, 40)
    y = torch.randint(0, 3, (N,))
    for k in (4, None):
        torch.manual_seed(0)
        model = cls(F_IN, 16, num_layers=2, out_channels=3, k=k, dropout=0.1)
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
        losses = []
        for _ in range(30):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(random_features(), ei), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0] * 0.7, (k, losses[0], losses[-1])
        assert ("k=4" if k else "stock") in repr(model)


@pytest.mark.parametrize("kind", ["sage", "gcn"])
def test_lazy_in_channels(kind):
    conv = (MaxKSAGEConv if kind == "sage" else MaxKGCNConv)(-1, F_OUT, k=K)
    ei = random_edge_index(N, N, 30)
    first = conv(random_features(), ei)  # sizes the weights (the unfused path)
    assert first.shape == (N, F_OUT)
    # Later calls fuse the bias and the root term into the GEMM: same result.
    torch.testing.assert_close(conv(random_features(), ei), first)
    assert_same_as_stock(conv, make_pair(kind)[1], random_features(), (ei,), K)


def test_models_ignore_edge_weights_where_their_stock_model_does():
    # SAGE and GIN take no edge weights (as PyG's BasicGNN); GCN does.
    from pyg_maxk.nn import MaxKGCN, MaxKGIN, MaxKGraphSAGE
    ei = random_edge_index(N, N, 40)
    weight = torch.rand(ei.size(1)) + 0.5
    for cls, uses_weights in ((MaxKGraphSAGE, False), (MaxKGIN, False), (MaxKGCN, True)):
        torch.manual_seed(0)
        model = cls(F_IN, 16, 2, 3, k=K)
        pyg_maxk.clear_graph_cache()
        weighted, plain = model(random_features(), ei, weight), model(random_features(), ei)
        assert torch.allclose(weighted, plain) != uses_weights, cls.__name__


@pytest.mark.parametrize("form", ["edge_index", "csr"])
@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
def test_half_precision_output_type_is_stocks(kind, form):
    # bf16 features under autocast: the result types follow the stock conv's
    # (GCN's float32 normalisation promotes its sum to float32; a mean or an
    # unweighted sum stays bf16), and the values agree to bf16 precision.
    ei = random_edge_index(N, N, 50, seed=3)
    adj = adjacency(form, ei, (N, N), random_weights(50) if form == "csr" else None)
    ours, stock = make_pair(kind)
    ours.load_state_dict(stock.state_dict())
    x = random_features(dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(x, adj)
        try:
            ref = stock(dense_maxk(x, K), adj)
        except (RuntimeError, NotImplementedError) as err:  # e.g. no bf16 CSR product on CPU
            pytest.skip(f"stock {kind} on {form} under CPU autocast: {err}")
    assert out.dtype == ref.dtype
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err < 2e-2, err


@pytest.mark.parametrize("form", ["coo", "csc", "csr"])
@pytest.mark.parametrize("kind", ["sage", "gin"])
def test_the_package_raises_no_warnings_of_its_own(kind, form):
    # torch's "sparse CSR support is in beta" comes from the package's own
    # conversions, not from anything the user wrote.
    ei = random_edge_index(N, N, 50, seed=3)
    adj = adjacency(form, ei, (N, N), random_weights(ei.size(1)))
    ours, _ = make_pair(kind)
    x = random_features().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(x, adj).sum().backward()
    assert x.grad is not None


def _autograd_node_names(out):
    names, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("kind", ["sage", "gcn", "gin", "gin_linear"])
def test_one_autograd_node_selects_aggregates_and_maps(kind):
    # Small graphs are bound by host time per autograd node: MaxK, the
    # aggregation and the conv's linear maps (SAGE's two, GCN's, GIN's where
    # its network is one linear map) are one node. SAGE's CBSR root term,
    # where it pays (the CPU kernels), and GIN's MLP are nodes of their own.
    if kind == "gin_linear":
        torch.manual_seed(0)
        ours = MaxKGINConv(torch.nn.Linear(F_IN, F_OUT), k=K, eps=0.3)
    else:
        ours, _ = make_pair(kind)
    x = random_features().requires_grad_()
    names = _autograd_node_names(ours(x, random_edge_index(N, N, 50, seed=3)))
    ours_nodes = [name for name in names if name.endswith("_functionBackward")]
    if kind == "sage" and ours.cbsr_root_pays(x):
        expected = ["maxk_aggregate_functionBackward", "cbsr_linear_functionBackward"]
    elif kind == "gin":
        expected = ["maxk_aggregate_functionBackward"]
    else:
        expected = ["maxk_aggregate_linear_functionBackward"]
        assert not any(name.startswith(("Addmm", "Mm", "T")) for name in names), names
    assert sorted(ours_nodes) == sorted(expected), names


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_contract_gin_with_a_linear_network(form, eps):
    # GIN's network as one linear map runs inside the conv's one node: with
    # its root term as self-loops (eps = 0 on a fixed edge_index) or on the
    # dense form (any fixed eps).
    ei = random_edge_index(N, N, 50, seed=3)
    value = random_weights(ei.size(1)) if form in ("SparseTensor", "coo", "csr", "csc") else None
    adj = adjacency(form, ei, (N, N), value)
    torch.manual_seed(0)
    ours = MaxKGINConv(torch.nn.Linear(F_IN, F_OUT), k=K, eps=eps)
    stock = GINConv(torch.nn.Linear(F_IN, F_OUT), eps=eps)
    for _ in range(3):  # a fixed graph: the loops, where they pay, from a hit on
        assert_same_as_stock(ours, stock, random_features(), (adj,), K)
        ours.zero_grad(), stock.zero_grad()


@pytest.mark.parametrize("kind", ["sage", "gin"])
@pytest.mark.parametrize("module_hook", [False, True])
def test_a_hooked_linear_map_is_called_as_a_module(kind, module_hook):
    # A forward hook, on the module or on every module, gets the module's
    # own call, outside the conv's node: the same results.
    ei = random_edge_index(N, N, 50, seed=4)
    torch.manual_seed(0)
    if kind == "sage":
        ours, stock = make_pair("sage")
        module = ours.lin_r
    else:
        ours = MaxKGINConv(torch.nn.Linear(F_IN, F_OUT), k=K, eps=0.3)
        stock = GINConv(torch.nn.Linear(F_IN, F_OUT), eps=0.3)
        module = ours.nn
    seen = []
    if module_hook:
        handle = module.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    else:
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: seen.append(out.shape) if m is module else None)
    try:
        assert_same_as_stock(ours, stock, random_features(), (ei,), K)
    finally:
        handle.remove()
    assert seen == [torch.Size([N, F_OUT])]


def test_a_linear_subclass_is_called_as_a_module():
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    ei = random_edge_index(N, N, 50, seed=4)
    torch.manual_seed(0)
    ours = MaxKGINConv(Scaled(F_IN, F_OUT), k=K, eps=0.3)
    x = random_features()
    expected = 2 * torch.nn.functional.linear(
        GINConv(torch.nn.Identity(), eps=0.3)(dense_maxk(x, K), ei), ours.nn.weight, ours.nn.bias)
    torch.testing.assert_close(ours(x, ei), expected, rtol=1e-5, atol=1e-5)


def _calls_of(monkeypatch, owner, name: str) -> list:
    """A list that grows by one on every call of ``owner.name``, which still
    runs."""
    calls = []
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    return calls


@pytest.mark.parametrize("cbsr_root", [False, True])
@pytest.mark.parametrize("form", ["edge_index", "csr"])
def test_contract_sage_root_term_dense_and_cbsr(form, cbsr_root, monkeypatch):
    # SAGE's root term is a CBSR linear op where that pays, else stock's
    # dense linear map (each forced here).
    from pyg_maxk.nn import sage_conv
    calls = _calls_of(monkeypatch, sage_conv, "cbsr_linear")
    monkeypatch.setattr(sage_conv, "cbsr_linear_pays", lambda *args: cbsr_root)
    ei = random_edge_index(N, N, 50, seed=3)
    ours, stock = make_pair("sage")
    assert_same_as_stock(ours, stock, random_features(), (adjacency(form, ei, (N, N)),), K)
    assert bool(calls) == cbsr_root


@pytest.mark.parametrize("dense_root", [False, True])
@pytest.mark.parametrize("form", ["edge_index", "csr"])
def test_contract_gin_root_term_dense_and_scattered(form, dense_root, monkeypatch):
    # GIN's root term (1 + eps) h is added on the dense form on small graphs,
    # else scattered from the CBSR (each forced here; eps is trained, so its
    # gradient is checked too).
    from pyg_maxk.nn import gin_conv
    scattered = _calls_of(monkeypatch, CBSR, "add_to")
    monkeypatch.setattr(gin_conv, "dense_root_pays", lambda *args: dense_root)
    ei = random_edge_index(N, N, 50, seed=3)
    ours, stock = make_pair("gin")
    for backend in ("torch", "cpu"):
        assert_same_as_stock(ours, stock, random_features(), (adjacency(form, ei, (N, N)),), K,
                             backend=backend)
        stock.zero_grad()
        ours.zero_grad()
    assert bool(scattered) != dense_root


@pytest.mark.parametrize("loops_in_edge_index", [False, True])
def test_gin_root_term_runs_as_self_loops_at_a_fixed_eps_of_zero(loops_in_edge_index):
    # At a fixed eps = 0 on a small CPU graph the root term is one more edge
    # i -> i per node of the graph built from the edge_index (one sum, no
    # root term); the edge_index's own self-loops stay edges.
    from torch_geometric.nn import GINConv
    ei = random_edge_index(N, N, 50, seed=5)
    if loops_in_edge_index:
        ei = torch.cat([ei, torch.arange(0, N, 2).expand(2, -1)], dim=1)
    torch.manual_seed(0)
    ours, stock = MaxKGINConv(gin_mlp(), k=K), GINConv(gin_mlp())
    x = random_features()
    graph = ours.graph_for(ei, x, x)
    assert graph.root_loops and graph.num_edges == ei.size(1) + N
    for backend in ("cpu", "torch"):
        assert_same_as_stock(ours, stock, x, (ei,), K, backend=backend)
        ours.zero_grad()
        stock.zero_grad()


def test_gin_root_loops_follow_eps_and_its_in_place_edits():
    # An edited (in place, or through .data, which no version counter sees)
    # or trained eps takes the root term again, an eps set back to 0 the loops.
    from torch_geometric.nn import GINConv
    ei = random_edge_index(N, N, 50, seed=6)
    torch.manual_seed(0)
    ours, stock = MaxKGINConv(gin_mlp(), k=K), GINConv(gin_mlp())
    x = random_features()
    assert ours.graph_for(ei, x, x).root_loops
    stock.eps.fill_(0.5)  # copied into ours in place by the check's load_state_dict
    assert_same_as_stock(ours, stock, x, (ei,), K, backend="cpu")
    assert not ours.graph_for(ei, x, x).root_loops
    ours.eps.zero_()
    assert ours.graph_for(ei, x, x).root_loops
    ours.eps.data.fill_(0.25)
    assert not ours.graph_for(ei, x, x).root_loops
    ours.eps.data.zero_()
    assert not MaxKGINConv(gin_mlp(), k=K, train_eps=True).graph_for(ei, x, x).root_loops
    x64 = x.double()
    assert ours.graph_for(ei, x64, x64).root_loops  # any features' type
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not ours.graph_for(ei, x, x).root_loops


def test_graph_with_gin_root_loops_serves_only_convs_that_fold_them():
    import copy
    import pickle
    ei = random_edge_index(N, N, 50, seed=7)
    graph = pyg_maxk.CSRGraph.from_adj(ei, (N, N), root_loops=True)
    for kept in (copy.deepcopy(graph), pickle.loads(pickle.dumps(graph)), graph.to("cpu")):
        assert kept.root_loops
    x = random_features()
    torch.manual_seed(0)
    gin = MaxKGINConv(gin_mlp(), k=K)
    torch.testing.assert_close(gin(x, graph), gin(x, ei))
    for other in (MaxKGINConv(gin_mlp(), k=K, eps=0.5),
                  MaxKGINConv(gin_mlp(), k=K, train_eps=True),
                  MaxKSAGEConv(F_IN, F_OUT, k=K, aggr="add")):
        with pytest.raises(ValueError, match="root term as self-loops"):
            other(x, graph)
    with pytest.raises(ValueError, match="square"):
        pyg_maxk.CSRGraph.from_adj(ei, (N, N + 1), root_loops=True)
    with pytest.raises(ValueError, match="sum"):
        pyg_maxk.CSRGraph.from_adj(ei, (N, N), normalization="mean", root_loops=True)


def test_gin_model_whose_convs_differ_in_eps_resolves_the_graph_per_conv(monkeypatch):
    # The model resolves one graph for every conv, unless one of them cannot
    # take GIN's root loops: then each conv takes the edge_index.
    from pyg_maxk.nn import MaxKGIN, gin_conv
    torch.manual_seed(0)
    model = MaxKGIN(F_IN, 16, 2, 3, k=K)
    model.convs[1].eps.fill_(0.5)
    x, ei = random_features(), random_edge_index(N, N, 50, seed=8)
    out = model(x, ei)
    monkeypatch.setattr(gin_conv, "root_loops_pay", lambda x: False)
    torch.testing.assert_close(out, model(x, ei))


def test_gin_root_term_scattered_under_autocast_or_other_dtypes():
    # The dense form's in-place sum would promote to eps's dtype: features
    # of another dtype take the scattered root term.
    conv = MaxKGINConv(torch.nn.Linear(F_IN, F_OUT), k=K)
    x = random_features()
    assert conv.dense_root_pays(x)
    assert not conv.dense_root_pays(x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not conv.dense_root_pays(x)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("large", [False, True])
def test_sage_root_term_is_cbsr_where_the_cpu_kernels_run_it(backend, large, monkeypatch):
    # The CPU linear kernels do k/dim of a GEMM's multiply-adds, which pays
    # from CBSR_LINEAR_MIN_CPU_WORK of them (below, their fixed costs bind
    # the step); the torch backend's CBSR linear map is a GEMM of the dense
    # form anyway.
    from pyg_maxk import dispatch
    from pyg_maxk.nn import sage_conv
    calls = _calls_of(monkeypatch, sage_conv, "cbsr_linear")
    if large:  # the test's graph counts as large
        monkeypatch.setattr(dispatch, "CBSR_LINEAR_MIN_CPU_WORK", N * F_IN * F_OUT)
    ei = random_edge_index(N, N, 50, seed=4)
    ours, stock = make_pair("sage")
    assert_same_as_stock(ours, stock, random_features(), (ei,), K, backend=backend)
    assert bool(calls) == (backend == "cpu" and large)


def test_cbsr_root_decision_off_the_cpu_asks_no_backend(monkeypatch):
    # Off the CPU the CPU kernels never run: the answer comes without the
    # backend probe, which torch.compile cannot trace on a GPU host.
    from pyg_maxk import dispatch

    def probe(*args, **kwargs):
        raise AssertionError("the backend was asked")
    monkeypatch.setattr(dispatch, "choose", probe)
    assert not dispatch.cbsr_linear_pays(torch.empty(16, 8, device="meta"), 8, 4, 8)
    assert dispatch.cbsr_linear_pays(torch.empty(dispatch.LINEAR_MIN_ROWS, 8, device="meta"),
                                     8, 4, 8)

@pytest.mark.parametrize("hooked", [False, True])
def test_sage_dense_root_accumulates_in_place_unless_hooked(hooked, monkeypatch):
    # The dense root term's product is added in place into lin_l's output;
    # a hook on either linear module gets the modules' own calls instead.
    from pyg_maxk.nn import sage_conv
    monkeypatch.setattr(sage_conv, "cbsr_linear_pays", lambda *args: False)
    ei = random_edge_index(N, N, 50, seed=4)
    ours, stock = make_pair("sage")
    seen, in_place = [], []
    original = torch.Tensor.addmm_
    monkeypatch.setattr(torch.Tensor, "addmm_", lambda t, *a, **kw: in_place.append(1) or
                        original(t, *a, **kw))
    if hooked:
        ours.lin_r.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert_same_as_stock(ours, stock, random_features(), (ei,), K)
    assert seen == ([torch.Size([N, F_OUT])] if hooked else [])
    assert bool(in_place) != hooked


def test_dropout_runs_in_the_fused_op_and_cbsr_inputs_take_the_separate_steps():
    # Dropout on the kept values runs inside the one op (the same draw as
    # maxk's for one seed, the same output and gradient as the steps); a
    # CBSR input, selected already, runs the aggregation alone.
    ei = random_edge_index(N, N, 30)
    conv = MaxKGINConv(torch.nn.Linear(F_IN, F_OUT), k=K, dropout=0.5)
    x = random_features().requires_grad_()
    conv.train()
    torch.manual_seed(0)
    out = conv(x, ei)
    names = _autograd_node_names(out)
    assert "maxk_aggregate_linear_functionBackward" in names
    assert "spgemm_functionBackward" not in names
    torch.manual_seed(0)
    h = pyg_maxk.maxk(x, K, dropout=0.5, training=True)
    assert (h.values == 0).any()
    expected = conv(h, ei)
    assert "spgemm_functionBackward" in _autograd_node_names(expected)
    torch.testing.assert_close(out, expected)
    weights = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, weights)[0],
                               torch.autograd.grad(expected, x, weights)[0])
    conv.eval()
    torch.testing.assert_close(conv(pyg_maxk.maxk(x, K), ei), conv(x, ei))
