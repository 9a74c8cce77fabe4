"""The remembered one-node call of a conv (``MaxKConv.repeat_fused_call``):
a repeat equals the first call, and anything that decided the first call
sends the next one back through the layer's checks."""
import pytest
import torch

import pyg_maxk
from helpers import ON_GPU, assert_device_side_assert
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
    return conv.__dict__.get("_last_fused") is not None


def _warm(conv, x, g):
    conv(x, g)
    assert _remembered(conv)


PLACES = [
    pytest.param("cpu", "auto", id="cpu"),
    # The "numba" backend on CPU tensors: Numba's simulator, where no GPU is.
    *([] if ON_GPU else [pytest.param("cpu", "numba", id="sim", marks=pytest.mark.sim)]),
    pytest.param("cuda", "auto", id="gpu", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")]),
]


def _cases(kinds, dropouts, sim_kinds, sim_dropouts):
    """``(kind, dropout, device, backend)`` at every place; in the simulator,
    which runs every kernel thread in Python, only ``sim_kinds`` at
    ``sim_dropouts``."""
    return [pytest.param(kind, dropout, *place.values, marks=place.marks,
                         id=f"{kind}-{dropout}-{place.id}")
            for place in PLACES for kind in kinds for dropout in dropouts
            if place.id != "sim" or (kind in sim_kinds and dropout in sim_dropouts)]


@pytest.mark.parametrize("kind,dropout,device,backend",
                         _cases(KINDS, [0.0, 0.4], KINDS, [0.4]))
def test_a_repeat_equals_the_first_call(kind, dropout, device, backend, graph_and_x):
    ei, x = graph_and_x
    ei, x = ei.to(device), x.to(device)
    conv, g = _conv(kind, dropout=dropout).to(device), _graph(kind, ei)
    results = []
    for _ in range(2):
        torch.manual_seed(3)
        xs = x.clone().requires_grad_()
        with pyg_maxk.use_backend(backend):
            out = conv(xs, g)
        out.square().sum().backward()
        results.append((out.detach(), xs.grad, [p.grad.clone() for p in conv.parameters()]))
        conv.zero_grad()
        assert _remembered(conv)
    _assert_same_results(*results, device)


def _assert_same_results(first, second, device):
    """Equal outputs and gradients; on a GPU the gradients up to the order of
    the SSpMM's float atomics (two first calls differ as much there)."""
    (o1, g1, p1), (o2, g2, p2) = first, second
    assert torch.equal(o1, o2)
    for a, b in zip([g1, *p1], [g2, *p2]):
        if device == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b)


def _call_and_see(conv, x, adj):
    """``(conv(x, adj), whether it went through the layer's checks)``."""
    seen = []
    original = conv.graph_for

    def spy(*args, **kwargs):
        seen.append(1)
        return original(*args, **kwargs)
    conv.graph_for = spy
    try:
        out = conv(x, adj)
    finally:
        del conv.graph_for
    return out, bool(seen)


def _calls_through_checks(conv, x, adj):
    return _call_and_see(conv, x, adj)[1]


@pytest.mark.parametrize("kind", KINDS)
def test_the_second_call_skips_the_checks(kind, graph_and_x):
    ei, x = graph_and_x
    conv, g = _conv(kind), _graph(kind, ei)
    assert _calls_through_checks(conv, x, g)
    assert not _calls_through_checks(conv, x, g)


@pytest.mark.parametrize("kind,dropout,device,backend",
                         _cases(KINDS, [0.0], ["sage", "gin loops"], [0.0]))
def test_a_new_graph_of_the_same_kind_repeats_over_its_own_edges(kind, dropout, device,
                                                                  backend, graph_and_x):
    # A new graph per step (same sizes and options): the repeat reads the
    # new graph's operands and equals a first call on it.
    ei, x = graph_and_x
    x = x.to(device)
    other = _graph(kind, power_law_edge_index(N, 300, seed=1).to(device))
    conv = _conv(kind, dropout=dropout).to(device)
    reference = _conv(kind, dropout=dropout).to(device)
    results = []
    with pyg_maxk.use_backend(backend):
        _warm(conv, x, _graph(kind, ei.to(device)))
        for model, check in ((conv, False), (reference, True)):
            xs = x.clone().requires_grad_()
            out, checked = _call_and_see(model, xs, other)
            assert checked == check
            out.square().sum().backward()
            results.append((out.detach(), xs.grad, [p.grad for p in model.parameters()]))
    _assert_same_results(*results, device)
    assert conv.__dict__["_last_fused"][0] is other


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["sage", "gin"])
def test_a_new_edge_index_per_step_repeats_over_its_edge_list(model, graph_and_x):
    # On a GPU a model takes each new edge_index as an edge list: its convs
    # repeat their call over the next one's, as a first call would run it.
    import copy

    from pyg_maxk.graph import EdgeListGraph
    from pyg_maxk.nn import MaxKGIN, MaxKGraphSAGE
    ei, x = graph_and_x
    ei, x = ei.cuda(), x.cuda()
    other = power_law_edge_index(N, 300, seed=1).cuda()
    torch.manual_seed(0)
    net = (MaxKGraphSAGE if model == "sage" else MaxKGIN)(DIM, 16, 2, 4, k=K).cuda()
    net(x, ei.clone())
    reference = copy.deepcopy(net)  # remembers nothing
    out = net(x, other.clone())
    for conv in net.convs:
        assert isinstance(conv.__dict__["_last_fused"][0], EdgeListGraph)
    # The edge list's float atomics add in any order: two first calls differ
    # by about 1e-7 of the output's scale (GIN's sums reach a few hundred).
    expected = reference(x, other.clone())
    torch.testing.assert_close(out, expected, atol=1e-6 * expected.abs().max().item(),
                               rtol=1.3e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_graph_of_another_kind_goes_back_through_the_checks(kind, graph_and_x):
    # Its normalisation, GCN options or root loops differ: the checks refuse
    # it where the conv needs another, or take the path it needs.
    ei, x = graph_and_x
    conv = _conv(kind)
    _warm(conv, x, _graph(kind, ei))
    if kind == "sage":
        other = CSRGraph.from_adj(ei, (N, N), normalization="sum").prepare(K)
    elif kind == "gcn":
        other = CSRGraph.from_adj(ei, (N, N), normalization="gcn", gcn_improved=True).prepare(K)
    else:
        other = _graph("gin" if kind == "gin loops" else "gin loops", ei)
    if kind in ("sage", "gcn"):
        with pytest.raises(ValueError):
            conv(x, other)
    else:
        assert _calls_through_checks(conv, x, other)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("change", [
    "other rows", "other dtype", "eval", "dropout", "k", "hook",
    "global hook", "module replaced", "backend", "deterministic", "edge_index", "explain"])
def test_a_change_goes_back_through_the_checks(kind, change, graph_and_x):
    ei, x = graph_and_x
    conv, g = _conv(kind), _graph(kind, ei)
    _warm(conv, x, g)
    adj, features = g, x
    undo = None
    if change == "other rows":
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
            "assert conv.__dict__.get('_last_fused') is not None\n"
            "conv.eps.data.fill_(0.5)\n"
            "conv(x, g)\n"
            "torch.cuda.synchronize()\n")
    assert_device_side_assert(code, "eps changed")
