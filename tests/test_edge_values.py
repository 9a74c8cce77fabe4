"""Gradients w.r.t. edge values: learnable GCN edge weights and the edge
masks of PyG's explain module, against the stock convs on MaxK'd dense
features (values and gradients of the features, parameters, weights and
masks), on every backend that runs here."""
import warnings

import pytest
import torch
from torch_geometric.explain.algorithm.utils import clear_masks, set_masks

import pyg_maxk
from helpers import dense_maxk, make_pair, random_edge_index, sparse_tensor_on_cuda_or_skip
from pyg_maxk.nn import MaxKGCN

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
#: The numba backend's kernels run in Numba's simulator without a GPU: slow,
#: so there only :func:`test_numba_kernels_in_the_simulator` covers them.
BACKENDS = ["torch", "numba"] if ON_GPU else ["torch", "cpu"]
N, F_IN, K = 30, 24, 5


def _dtype(backend):
    return torch.float32 if backend == "numba" else torch.float64


def _edges(seed=3):
    """Random edges with a multi-edge and a self-loop; rows long enough to be
    split into several work items (see the ``split_rows`` fixture)."""
    ei = random_edge_index(N, N, 300, seed=seed)
    return torch.cat([ei, ei[:, :2], torch.tensor([[4, 7], [4, 7]])], 1).to(DEVICE)


def _one_loop_per_node(ei):
    """``ei`` without a node's second and later self-loops: of several, PyG's
    ``gcn_norm`` keeps any one's weight on CUDA (pyg_maxk the last one's, on
    every device: ``test_gcn_norm_of_an_edge_list_is_pygs``)."""
    src, dst = ei.cpu()
    looped, keep = set(), []
    for a, b in zip(src.tolist(), dst.tolist()):
        keep.append(a != b or a not in looped)
        if a == b:
            looped.add(a)
    return ei[:, torch.tensor(keep, device=ei.device)]


@pytest.fixture
def split_rows(monkeypatch):
    import pyg_maxk.graph.schedule
    # Rows of more than 8 edges split.
    monkeypatch.setattr(pyg_maxk.graph.schedule, "PAIRS_PER_ITEM", 8 * K)


def _tol(dtype):
    return dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)


def _run(conv, x, args, backend=None):
    with warnings.catch_warnings(), pyg_maxk.use_backend(backend or pyg_maxk.get_backend()):
        warnings.simplefilter("ignore")
        return conv(x, *args)


def _compare(ours, stock, x, ours_args, stock_args, extra, backend, dtype):
    """Outputs and the gradients of ``x``, every parameter and the tensors of
    ``extra`` (``[(ours, stock)]`` pairs: edge weights, masks)."""
    ours.load_state_dict(stock.state_dict())
    ours, stock = ours.to(DEVICE, dtype), stock.to(DEVICE, dtype)
    x_ours = x.clone().requires_grad_()
    x_stock = x.clone().requires_grad_()
    out = _run(ours, x_ours, ours_args, backend)
    ref = _run(stock, dense_maxk(x_stock, K), stock_args)
    torch.testing.assert_close(out, ref, **_tol(dtype))
    g = torch.randn_like(ref)
    with pyg_maxk.use_backend(backend):
        (out * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_stock.grad, **_tol(dtype))
    stock_params = dict(stock.named_parameters())
    for name, p in ours.named_parameters():
        if stock_params[name].grad is not None:
            torch.testing.assert_close(p.grad, stock_params[name].grad, **_tol(dtype), msg=name)
    for a, b in extra:
        assert a.grad is not None and a.grad.abs().sum() > 0
        torch.testing.assert_close(a.grad, b.grad, **_tol(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [{}, {"improved": True}, {"add_self_loops": False},
                                     {"normalize": False, "add_self_loops": False}])
def test_gcn_learnable_edge_weights(backend, options, split_rows):
    dtype = _dtype(backend)
    ei = _one_loop_per_node(_edges()) if ON_GPU else _edges()
    w = (torch.rand(ei.size(1), dtype=dtype) + 0.1).to(DEVICE)
    w_ours, w_stock = w.clone().requires_grad_(), w.clone().requires_grad_()
    ours, stock = make_pair("gcn", **options)
    x = torch.randn(N, F_IN, dtype=dtype, device=DEVICE)
    _compare(ours, stock, x, (ei, w_ours), (ei, w_stock), [(w_ours, w_stock)], backend, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
@pytest.mark.parametrize("apply_sigmoid", [True, False])
def test_explain_edge_mask_as_in_propagate(backend, kind, apply_sigmoid, split_rows):
    dtype = _dtype(backend)
    ei = _edges()
    mask = torch.randn(ei.size(1), dtype=dtype).to(DEVICE)
    m_ours, m_stock = mask.clone().requires_grad_(), mask.clone().requires_grad_()
    ours, stock = make_pair(kind)
    set_masks(ours, m_ours, ei, apply_sigmoid=apply_sigmoid)
    set_masks(stock, m_stock, ei, apply_sigmoid=apply_sigmoid)
    x = torch.randn(N, F_IN, dtype=dtype, device=DEVICE)
    _compare(ours, stock, x, (ei,), (ei,), [(m_ours, m_stock)], backend, dtype)
    clear_masks(ours)
    clear_masks(stock)
    _compare(ours, stock, x, (ei,), (ei,), [], backend, dtype)  # the mask is gone


@pytest.mark.sim
@pytest.mark.skipif(ON_GPU, reason="the GPU runs the numba backend in every test above")
def test_numba_kernels_in_the_simulator(split_rows):
    test_gcn_learnable_edge_weights("numba", {}, None)
    test_explain_edge_mask_as_in_propagate("numba", "gin", True, None)
    test_bipartite_mask_and_the_empty_edge_set("numba")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bipartite_mask_and_the_empty_edge_set(backend):
    dtype = _dtype(backend)
    for num_edges in (40, 0):
        ei = random_edge_index(11, 7, num_edges, seed=5).to(DEVICE)
        ours, stock = make_pair("sage")
        mask = torch.randn(num_edges, dtype=dtype, device=DEVICE)
        m_ours, m_stock = mask.clone().requires_grad_(), mask.clone().requires_grad_()
        set_masks(ours, m_ours, ei)
        set_masks(stock, m_stock, ei)
        x_src = torch.randn(11, F_IN, dtype=dtype, device=DEVICE)
        x_dst = torch.randn(7, F_IN, dtype=dtype, device=DEVICE)
        ours.load_state_dict(stock.state_dict())
        ours, stock = ours.to(DEVICE, dtype), stock.to(DEVICE, dtype)
        with pyg_maxk.use_backend(backend):
            out = ours((x_src, x_dst), ei)
            out.square().sum().backward()
        ref = stock(dense_maxk((x_src, x_dst), K), ei)
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref, **_tol(dtype))
        if num_edges:
            torch.testing.assert_close(m_ours.grad, m_stock.grad, **_tol(dtype))


def test_masks_and_learnable_weights_need_more_than_a_prepared_graph():
    ours, _ = make_pair("gcn")
    ei = random_edge_index(N, N, 40)
    x = torch.randn(N, F_IN)
    w = torch.rand(ei.size(1), requires_grad=True)
    prepared = pyg_maxk.ToCSRGraph("gcn", k=K)(
        __import__("torch_geometric").data.Data(edge_index=ei, num_nodes=N)).adj_t
    set_masks(ours, torch.rand(ei.size(1), requires_grad=True), ei)
    with pytest.raises(NotImplementedError, match="prepared"):
        ours(x, prepared)
    clear_masks(ours)
    with pytest.raises(NotImplementedError, match="prepared"):
        ours(x, prepared, w)


@pytest.mark.parametrize("explanation_type", ["model", "phenomenon"])
def test_gnn_explainer_on_a_maxk_model(explanation_type):
    """PyG's GNNExplainer trains edge and feature masks through a MaxK model
    (the mask gradients are checked against stock in the tests above)."""
    from torch_geometric.explain import Explainer, GNNExplainer
    ei = random_edge_index(N, N, 120, seed=7)
    x = torch.randn(N, F_IN)
    torch.manual_seed(0)
    model = MaxKGCN(F_IN, 16, 2, 3, k=K)
    explainer = Explainer(model, algorithm=GNNExplainer(epochs=20),
                          explanation_type=explanation_type, node_mask_type="attributes",
                          edge_mask_type="object",
                          model_config=dict(mode="multiclass_classification",
                                            task_level="node", return_type="raw"))
    target = model(x, ei).argmax(-1) if explanation_type == "phenomenon" else None
    explanation = explainer(x, ei, index=3, target=target)
    edge_mask = explanation.edge_mask
    assert edge_mask.shape == (ei.size(1),) and bool(torch.isfinite(edge_mask).all())
    assert edge_mask.std() > 0  # trained, not its initial constant
    assert explanation.node_mask.shape == x.shape
    for conv in model.convs:  # the explainer cleared its masks
        assert conv.explain_edge_mask() is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("form", ["csr", "SparseTensor"])
def test_gcn_learnable_values_of_a_sparse_adjacency(backend, normalize, form):
    """Stock GCNConv takes a ``torch.sparse`` CSR or ``SparseTensor`` ``adj_t``
    whose values need a gradient (through ``gcn_norm``); so does the MaxK conv."""
    dtype = _dtype(backend)
    ei = torch.unique(_edges(), dim=1)  # coalesced
    ei = ei[:, torch.argsort(ei[1] * N + ei[0])]  # in CSR order
    w = (torch.rand(ei.size(1), dtype=dtype) + 0.1).to(DEVICE)
    w_ours, w_stock = w.clone().requires_grad_(), w.clone().requires_grad_()

    def adj(values):
        if form == "SparseTensor":
            torch_sparse = pytest.importorskip("torch_sparse")
            if DEVICE == "cuda":
                sparse_tensor_on_cuda_or_skip()
            return torch_sparse.SparseTensor(row=ei[1], col=ei[0], value=values,
                                             sparse_sizes=(N, N), is_sorted=True)
        return torch.sparse_coo_tensor(ei.flip(0), values, (N, N)).coalesce().to_sparse_csr()

    options = {} if normalize else {"normalize": False, "add_self_loops": False}
    ours, stock = make_pair("gcn", **options)
    x = torch.randn(N, F_IN, dtype=dtype, device=DEVICE)
    for _ in range(2):  # the second call finds the cached structure
        w_ours.grad = w_stock.grad = None
        ours.zero_grad(), stock.zero_grad()
        _compare(ours, stock, x, (adj(w_ours),), (adj(w_stock),), [(w_ours, w_stock)], backend,
                 dtype)


def test_pg_explainer_on_a_maxk_model():
    from torch_geometric.explain import Explainer, PGExplainer
    ei = random_edge_index(N, N, 120, seed=8)
    x = torch.randn(N, F_IN)
    torch.manual_seed(0)
    model = MaxKGCN(F_IN, 16, 2, 3, k=K)
    explainer = Explainer(model, algorithm=PGExplainer(epochs=3, lr=0.01),
                          explanation_type="phenomenon", edge_mask_type="object",
                          model_config=dict(mode="multiclass_classification",
                                            task_level="node", return_type="raw"))
    target = model(x, ei).argmax(-1)
    for epoch in range(3):
        loss = explainer.algorithm.train(epoch, model, x, ei, target=target, index=2)
        assert loss == loss  # finite: gradients reached the explainer's MLP
    explanation = explainer(x, ei, target=target, index=2)
    assert explanation.edge_mask.shape == (ei.size(1),)


@pytest.mark.slow
def test_learnable_edge_weights_under_compile():
    torch._dynamo.reset()
    ei = random_edge_index(N, N, 120, seed=9)
    x = torch.randn(N, F_IN)
    torch.manual_seed(0)
    model = MaxKGCN(F_IN, 16, 2, 3, k=K)
    compiled = torch.compile(model)
    grads = []
    for m in (model, compiled):
        w = torch.full((ei.size(1),), 0.5, requires_grad=True)
        model.zero_grad()
        m(x, ei, w).square().sum().backward()
        grads.append([w.grad] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["sage", "gcn", "gin"])
@pytest.mark.parametrize("form", ["csr", "SparseTensor"])
def test_explain_edge_mask_on_a_sparse_adjacency(backend, kind, form):
    """PyG's explained propagate takes a sparse ``adj_t`` too: its mask follows
    the stored entries (CSR order), extended past GCN's self-loops as PyG
    extends it."""
    dtype = _dtype(backend)
    ei = torch.unique(_edges(), dim=1)
    ei = ei[:, torch.argsort(ei[1] * N + ei[0])]  # CSR order
    values = (torch.rand(ei.size(1), dtype=dtype) + 0.5).to(DEVICE)
    if form == "SparseTensor":
        torch_sparse = pytest.importorskip("torch_sparse")
        if DEVICE == "cuda":
            sparse_tensor_on_cuda_or_skip()
        adj = torch_sparse.SparseTensor(row=ei[1], col=ei[0], value=values,
                                        sparse_sizes=(N, N), is_sorted=True)
    else:
        adj = torch.sparse_coo_tensor(ei.flip(0), values, (N, N)).coalesce().to_sparse_csr()
    mask = torch.randn(ei.size(1), dtype=dtype, device=DEVICE)
    m_ours, m_stock = mask.clone().requires_grad_(), mask.clone().requires_grad_()
    ours, stock = make_pair(kind)
    set_masks(ours, m_ours, ei)
    set_masks(stock, m_stock, ei)
    x = torch.randn(N, F_IN, dtype=dtype, device=DEVICE)
    _compare(ours, stock, x, (adj,), (adj,), [(m_ours, m_stock)], backend, dtype)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.slow
def test_gradcheck_of_the_aggregation_in_its_edge_values(backend, split_rows):
    """float64 ``gradcheck`` of the CBSR aggregation in its edge values and
    CBSR values (the SDDMM and the SSpMM), with split rows."""
    from pyg_maxk.ops import _library as lib
    ei = _edges().cpu()  # both backends here are CPU ones, on every machine
    graph = pyg_maxk.CSRGraph.from_adj(ei, (N, N), edge_weight=torch.rand(ei.size(1)),
                                       dtype=torch.float64)
    ops = graph.operands(K)
    item_split = pyg_maxk.graph.unpack(*ops).item_split
    if item_split is not None:  # a CPU graph has a schedule only for the simulated kernels
        assert bool((item_split != 0).any())
    g = torch.Generator().manual_seed(4)
    values, idx = torch.randn(N, 12, generator=g, dtype=torch.float64).topk(K, dim=1)
    indices = idx.to(pyg_maxk.index_dtype_for(12))

    def aggregate(weight, values):
        return lib.spgemm(*ops._replace(weight=weight), values, indices, N, 12, backend)

    weight = graph.weight.detach().clone().requires_grad_()
    with pyg_maxk.use_backend(backend):
        assert torch.autograd.gradcheck(aggregate, (weight, values.requires_grad_()))


def test_to_hetero_and_graph_mask_explainer():
    """A MaxK model converted with ``to_hetero`` trains; PyG's
    GraphMaskExplainer, which reads every message through a replaced
    ``explain_message``, is a clear error (the sparse product forms none)."""
    from torch_geometric.data import HeteroData
    from torch_geometric.explain import Explainer
    from torch_geometric.explain.algorithm import GraphMaskExplainer
    from torch_geometric.nn import to_hetero

    from pyg_maxk.nn import MaxKSAGEConv

    data = HeteroData()
    data["a"].x, data["b"].x = torch.randn(10, 8), torch.randn(7, 8)
    data["a", "to", "b"].edge_index = random_edge_index(10, 7, 30, seed=1)
    data["b", "to", "a"].edge_index = random_edge_index(7, 10, 30, seed=2)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = MaxKSAGEConv((-1, -1), 16, k=4)

        def forward(self, x, edge_index):
            return self.conv(x, edge_index)

    model = to_hetero(Net(), data.metadata())
    out = model(data.x_dict, data.edge_index_dict)
    assert out["a"].shape == (10, 16) and out["b"].shape == (7, 16)
    sum(o.square().sum() for o in out.values()).backward()

    ei = random_edge_index(N, N, 80, seed=3)
    x = torch.randn(N, F_IN)
    torch.manual_seed(0)
    gcn = MaxKGCN(F_IN, 16, 2, 3, k=K)
    explainer = Explainer(gcn, algorithm=GraphMaskExplainer(2, epochs=5),
                          explanation_type="model", node_mask_type="attributes",
                          edge_mask_type="object",
                          model_config=dict(mode="multiclass_classification",
                                            task_level="node", return_type="raw"))
    with pytest.raises(NotImplementedError, match="explain_message"):
        explainer(x, ei, index=1)
