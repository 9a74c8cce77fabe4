"""The remembered one-node call of a conv (``MaxKConv.repeat_fused_call``):
a repeat equals the first call, and anything that decided the first call
sends the next one back through the layer's checks."""
import pytest
import torch

import pyg_maxk
from pyg_maxk.app.datasets import power_law_edge_index
from pyg_maxk.graph import CSRGraph
from pyg_maxk.nn import MaxKGCNConv, MaxKGINConv, MaxKSAGEConv

N, DIM, K = 60, 24, 6
#: The convs with a one-node call; "gin loops" takes a graph that holds its
#: root term as self-loops, "gin" adds the term on MaxK's dense output.
KINDS = ["sage", "gcn", "gin", "gin loops"]


@pytest.fixture
def graph_and_x():
    torch.manual_seed(0)
    ei = power_law_edge_index(N, 240, seed=0)
    return ei, torch.randn(N, DIM)


def _conv(kind, **kwargs):
    torch.manual_seed(0)
    if kind == "sage":
        return MaxKSAGEConv(DIM, 16, k=K, **kwargs)
    if kind == "gcn":
        return MaxKGCNConv(DIM, 16, k=K, **kwargs)
    return MaxKGINConv(torch.nn.Linear(DIM, 16), k=K, **kwargs)


def _graph(kind, ei, k=K):
    normalization = {"sage": "mean", "gcn": "gcn"}.get(kind, "sum")
    return CSRGraph.from_adj(ei, (N, N), normalization=normalization,
                             root_loops=kind == "gin loops").prepare(k)


def _linear_name(kind):
    return {"sage": "lin_l", "gcn": "lin"}.get(kind, "nn")


def _remembered(conv):
    """Whether conv remembers a call in full (a graph's first is only noted)."""
    last = conv.__dict__.get("_last_fused")
    return last is not None and len(last) > 1


def _warm(conv, x, g):
    """Two calls: the second is remembered."""
    conv(x, g)
    conv(x, g)
    assert _remembered(conv)


PLACES = [
    pytest.param("cpu", "auto", id="cpu"),
    pytest.param("cpu", "numba", id="sim", marks=pytest.mark.sim),
    pytest.param("cuda", "auto", id="gpu", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]),
]


@pytest.mark.parametrize("device,backend", PLACES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dropout", [0.0, 0.4])
def test_a_repeat_equals_the_first_call(kind, dropout, device, backend, graph_and_x):
    ei, x = graph_and_x
    ei, x = ei.to(device), x.to(device)
    conv, g = _conv(kind, dropout=dropout).to(device), _graph(kind, ei)
    results = []
    for call in range(3):  # noted, remembered, repeated
        torch.manual_seed(3)
        xs = x.clone().requires_grad_()
        with pyg_maxk.use_backend(backend):
            out = conv(xs, g)
        out.square().sum().backward()
        results.append((out.detach(), xs.grad, [p.grad.clone() for p in conv.parameters()]))
        conv.zero_grad()
        assert _remembered(conv) == (call > 0)
    (o1, g1, p1), _, (o2, g2, p2) = results
    assert torch.equal(o1, o2) and torch.equal(g1, g2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))


def _calls_through_checks(conv, x, adj):
    """Whether conv(x, adj) goes through the layer's checks (graph_for)."""
    seen = []
    original = conv.graph_for

    def spy(*args, **kwargs):
        seen.append(1)
        return original(*args, **kwargs)
    conv.graph_for = spy
    try:
        conv(x, adj)
    finally:
        del conv.graph_for
    return bool(seen)


@pytest.mark.parametrize("kind", KINDS)
def test_a_graph_s_third_call_skips_the_checks(kind, graph_and_x):
    ei, x = graph_and_x
    conv, g = _conv(kind), _graph(kind, ei)
    assert _calls_through_checks(conv, x, g)
    assert _calls_through_checks(conv, x, g)
    assert not _calls_through_checks(conv, x, g)


def test_a_new_graph_per_call_is_only_noted(graph_and_x):
    ei, x = graph_and_x
    conv = _conv("sage")
    for _ in range(3):
        g = _graph("sage", ei.clone())
        assert _calls_through_checks(conv, x, g)
        assert not _remembered(conv) and conv.__dict__["_last_fused"][0] is g


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("change", [
    "other graph", "other rows", "other dtype", "eval", "dropout", "k", "hook",
    "global hook", "module replaced", "backend", "deterministic", "edge_index", "explain"])
def test_a_change_goes_back_through_the_checks(kind, change, graph_and_x):
    ei, x = graph_and_x
    conv, g = _conv(kind), _graph(kind, ei)
    _warm(conv, x, g)
    adj, features = g, x
    undo = None
    if change == "other graph":
        adj = _graph(kind, ei.clone())
        assert adj is not g
    elif change == "other rows":
        features = torch.randn(N - 1, DIM)
    elif change == "other dtype":
        conv = conv.double()
        features = x.double()
    elif change == "eval":
        conv.eval()
    elif change == "dropout":
        conv.dropout = 0.5
    elif change == "k":
        conv.k = K + 1
        adj = g.prepare(K + 1)
    elif change == "hook":
        getattr(conv, _linear_name(kind)).register_forward_hook(lambda *a: None)
    elif change == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        undo = handle.remove
    elif change == "module replaced":
        name = _linear_name(kind)
        setattr(conv, name, type(getattr(conv, name))(DIM, 16, bias=kind != "gcn"))
    elif change == "backend":
        ctx = pyg_maxk.use_backend("torch")
        ctx.__enter__()
        undo = lambda: ctx.__exit__(None, None, None)  # noqa: E731
    elif change == "deterministic":
        torch.use_deterministic_algorithms(True)
        undo = lambda: torch.use_deterministic_algorithms(False)  # noqa: E731
    elif change == "edge_index":
        adj = ei
    elif change == "explain":
        conv.explain = True
        undo = lambda: setattr(conv, "explain", False)  # noqa: E731
    try:
        if change == "other rows":
            with pytest.raises(ValueError):
                conv(features, adj)
        else:
            assert _calls_through_checks(conv, features, adj)
    finally:
        if undo is not None:
            undo()


@pytest.mark.parametrize("kind,option,value", [
    ("gcn", "improved", True), ("gcn", "add_self_loops", False), ("gcn", "normalize", False),
    ("sage", "aggr", "add")])
def test_a_changed_graph_option_meets_the_graph_check(kind, option, value, graph_and_x):
    # Options that decide the graph a conv needs: a prepared graph built for
    # the old ones is refused, as on a first call.
    ei, x = graph_and_x
    conv, g = _conv(kind), _graph(kind, ei)
    _warm(conv, x, g)
    setattr(conv, option, value)
    with pytest.raises(ValueError):
        conv(x, g)


def test_rebuilt_operands_go_back_through_the_checks(graph_and_x):
    # A graph cache settles a graph it serves often: new operands, whose
    # schedule the repeat must not miss.
    from pyg_maxk.graph.schedule import max_edges_per_item
    ei, x = graph_and_x
    conv, g = _conv("sage"), _graph("sage", ei)
    _warm(conv, x, g)
    g._unscheduled = None
    g._build_operands(max_edges_per_item(K))
    assert _calls_through_checks(conv, x, g)
    assert conv.__dict__["_last_fused"][6] is g.operands(K)


def test_the_remembered_call_is_not_copied_or_pickled(graph_and_x, tmp_path):
    import copy
    ei, x = graph_and_x
    conv, g = _conv("sage"), _graph("sage", ei)
    _warm(conv, x, g)
    assert not _remembered(copy.deepcopy(conv))
    torch.save(conv, tmp_path / "conv.pt")
    loaded = torch.load(tmp_path / "conv.pt", weights_only=False)
    assert not _remembered(loaded)
    assert torch.allclose(loaded(x, g), conv(x, g))


def test_a_pair_of_features_is_not_remembered(graph_and_x):
    ei, x = graph_and_x
    conv, g = _conv("sage"), _graph("sage", ei)
    for _ in range(2):
        conv((x, x), g)
    assert not _remembered(conv)


@pytest.mark.parametrize("kind", ["gin", "gin loops"])
@pytest.mark.parametrize("change", ["edited", "edited through data", "trained", "replaced"])
def test_a_changed_eps_goes_back_through_the_checks(kind, change, graph_and_x):
    # Over root loops eps must stay 0, which the checks enforce; the dense
    # root term reads eps on every call, but its gradient or type decide.
    ei, x = graph_and_x
    conv, g = _conv(kind), _graph(kind, ei)
    _warm(conv, x, g)
    if change == "edited":
        with torch.no_grad():
            conv.eps.fill_(0.5)
    elif change == "edited through data":  # no version counter sees it
        conv.eps.data.fill_(0.5)
    elif change == "trained":
        conv.eps.requires_grad_()
    else:
        conv.eps = torch.full((1,), 0.5)
    if kind == "gin loops":
        with pytest.raises(ValueError, match="root term as self-loops"):
            conv(x, g)
    else:
        assert _calls_through_checks(conv, x, g)


def test_a_repeat_reads_eps_anew(graph_and_x):
    # The dense root term's 1 + eps is computed per call, from eps as it is.
    ei, x = graph_and_x
    conv, g, reference = _conv("gin"), _graph("gin", ei), _conv("gin")
    _warm(conv, x, g)
    with torch.no_grad():
        conv.eps.fill_(0.5)
        reference.eps.fill_(0.5)
    conv(x, g)
    assert _remembered(conv) and not _calls_through_checks(conv, x, g)
    torch.testing.assert_close(conv(x, g), reference(x, ei))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_repeat_over_root_loops_checks_eps_on_the_gpu():
    # eps edited through .data: the repeated call, like the first, asserts
    # eps = 0 on the device (a fresh process: the assert ends its context).
    import subprocess
    import sys
    code = ("import torch\n"
            "from pyg_maxk import CSRGraph\n"
            "from pyg_maxk.nn import MaxKGINConv\n"
            "conv = MaxKGINConv(torch.nn.Linear(16, 8), k=4).cuda()\n"
            "ei = torch.randint(0, 50, (2, 200), device='cuda')\n"
            "g = CSRGraph.from_adj(ei, (50, 50), root_loops=True).prepare(4)\n"
            "x = torch.randn(50, 16, device='cuda')\n"
            "for _ in range(3):\n"
            "    conv(x, g)\n"
            "torch.cuda.synchronize()\n"
            "assert len(conv.__dict__['_last_fused']) > 1\n"
            "conv.eps.data.fill_(0.5)\n"
            "conv(x, g)\n"
            "torch.cuda.synchronize()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert "AssertionError" not in result.stderr, result.stderr[-2000:]
    assert "device-side assert" in result.stderr or "eps changed" in result.stderr
