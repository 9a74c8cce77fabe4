"""The "numba" backend: kernels against float64 references and the layer
contract against the stock convs.

Without a GPU these run in Numba's CUDA simulator on small CPU tensors (see
conftest.py); on a GPU (``pytest -m gpu`` adds the heavy cases) they run the
compiled kernels on CUDA tensors.
"""
import pytest
import torch

import pyg_maxk
from helpers import (
    DEVICE,
    FORMS,
    HALF,
    HALF_UNIT,
    ON_GPU,
    adjacency,
    assert_same_as_stock,
    assert_same_selection,
    assert_ties_keep_lowest_columns,
    check_cbsr_linear,
    check_half_kernels,
    check_half_reductions,
    check_kernels,
    dense_reference,
    every_k_case,
    few_valued_rows,
    kernel_maxk,
    make_pair,
    poison_allocator,
    random_cbsr,
    random_edge_index,
    reference_spgemm,
    split_items,
)
from pyg_maxk import CBSR, CSRGraph
from pyg_maxk.graph import EdgeListGraph
from pyg_maxk.kernels import cuda_module, geometry
from pyg_maxk.ops import numba_ops

pytestmark = pytest.mark.sim if not ON_GPU else []
#: The simulator cases the fast tier runs (conftest.py): each kernel family
#: at the ``k`` that picks each of its code paths, one layer contract per conv.
smoke = pytest.mark.smoke


@pytest.mark.parametrize("normalization,weighted", [
    ("sum", False), ("sum", True), pytest.param("mean", False, marks=smoke), ("mean", True),
    ("gcn", True)])
def test_spgemm_and_sspmm_against_float64(normalization, weighted):
    # Kernels read edge values ("sum"/"mean" with edge weights, "gcn"), none
    # ("sum"), or one scale per row ("mean" without edge weights).
    ei = random_edge_index(30, 30, 150, seed=1).to(DEVICE)
    w = (torch.rand(150) + 0.1).to(DEVICE) if weighted else None
    graph = CSRGraph.from_adj(ei, (30, 30), edge_weight=w, normalization=normalization)
    assert (graph.row_scale is not None) == (normalization == "mean" and not weighted)
    check_kernels(graph, dim=40, k=6)


def test_heavy_rows_split_across_items(monkeypatch):
    # One row of 200 edges with work items of 16 edges: atomics across items.
    monkeypatch.setattr(pyg_maxk.graph.schedule, "PAIRS_PER_ITEM", 16 * 4)
    src = torch.arange(200) % 25
    dst = torch.cat([torch.zeros(190, dtype=torch.long), torch.arange(1, 11)])
    graph = CSRGraph.from_adj(torch.stack([src, dst]).to(DEVICE), (25, 12))
    assert int((split_items(graph, k=4) != 0).sum()) == 12  # ceil(190 / 16)
    check_kernels(graph, dim=20, k=4)


@pytest.mark.parametrize("weighted", [pytest.param(False, marks=smoke), True])
def test_bounded_schedule_against_float64(monkeypatch, weighted):
    # The schedule a new graph gets without a host sync: padding items (no
    # edges, split > 0), zeroed rows padded with a scratch row below the
    # output, rows without edges, and a split row; the edge values' gradient
    # (SDDMM) too.
    monkeypatch.setattr(pyg_maxk.graph.schedule, "PAIRS_PER_ITEM", 16 * 4)
    src = torch.arange(120) % 25
    dst = torch.cat([torch.zeros(90, dtype=torch.long), torch.arange(2, 32)])
    w = (torch.rand(120) + 0.1).to(DEVICE) if weighted else None
    ei = torch.stack([src, dst]).to(DEVICE)
    exact = CSRGraph.from_adj(ei, (25, 40), edge_weight=w, cache=False)
    graph = CSRGraph.from_adj(ei, (25, 40), edge_weight=w, cache=False)
    graph._build_operands(pyg_maxk.graph.max_edges_per_item(4), bounded=True)
    assert not graph.is_prepared(4)
    assert int((split_items(graph, k=4) != 0).sum()) > int((split_items(exact, k=4) != 0).sum())
    check_kernels(graph, dim=20, k=4)  # against float64, forward and backward
    if weighted:
        h = random_cbsr(25, 20, 4, seed=3)
        grads = []
        for g in (graph, exact):
            values = g.weight.clone().requires_grad_()
            with pyg_maxk.use_backend("numba"):
                pyg_maxk.aggregate(g.with_weight(values, "sum"), h).sum().backward()
            grads.append(values.grad)
        torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("dim,k", [(24, 1), (80, 33), pytest.param(70, 64, marks=smoke)])
def test_one_lane_groups_and_slots_beyond_a_warp(dim, k):
    # k=1: 32 neighbours side by side per warp; k > 32: a lane owns several slots.
    ei = random_edge_index(40, 30, 400, seed=3).to(DEVICE)
    w = (torch.rand(400) + 0.1).to(DEVICE)
    check_kernels(CSRGraph.from_adj(ei, (40, 30), edge_weight=w), dim=dim, k=k)


@pytest.mark.parametrize("k", [5, 12, 32, 64])
def test_every_loads_in_flight_setting(k):
    # The forward issues 4 (k=5, 64, and k=32 with 4 slots per load) or 8
    # (k=12) neighbours' loads per lane at a time, over staged rounds of 128
    # neighbours (k <= 32) or 32 (k=64). A row of 300 edges spans several rounds, its last ending
    # part-way through a step, and at k >= 32 several work items.
    from pyg_maxk.kernels.spgemm import spgemm_unroll, spgemm_vector_width, staged_round
    width = spgemm_vector_width(k)
    assert spgemm_unroll(k, width) == (8 if 8 <= k <= 32 and width == 1 else 4)
    assert staged_round(k) == (128 if k <= 32 else 32)
    others = torch.randint(0, 35, (90,), generator=torch.Generator().manual_seed(k))
    src = torch.cat([torch.arange(300) % 35, others])
    dst = torch.cat([torch.zeros(300, dtype=torch.long), torch.arange(90) % 19 + 1])
    w = (torch.rand(390) + 0.1).to(DEVICE)
    check_kernels(CSRGraph.from_adj(torch.stack([src, dst]).to(DEVICE), (35, 20), edge_weight=w),
                  dim=80, k=k)


@pytest.mark.parametrize("dim,k,widths", [
    (40, 8, (1, 2)), (80, 16, (2, 4)), pytest.param(80, 32, (4, 4), marks=smoke), (300, 18, (2, 2)),
    (300, 32, (4, 4)), (96, 64, (4, 4))])
def test_vector_loads_and_atomics(dim, k, widths):
    # A lane reads 2 or 4 CBSR slots per load (and adds to them with one
    # atomic backward): index words of uint8 (dim <= 256) or int16 indices,
    # with and without edge values, rows spanning several work items.
    from pyg_maxk.kernels.spgemm import spgemm_vector_width, sspmm_vector_width
    assert (spgemm_vector_width(k), sspmm_vector_width(k)) == widths
    h = random_cbsr(35, dim, k, seed=k)
    for width in set(widths):
        words, used, bits = numba_ops._index_operand(h.indices, width, h.values.view(-1))
        assert (used, bits) == (width, 8 * h.indices.element_size())
        assert words.element_size() == width * h.indices.element_size()
    others = torch.randint(0, 35, (90,), generator=torch.Generator().manual_seed(k))
    src = torch.cat([torch.arange(300) % 35, others])
    dst = torch.cat([torch.zeros(300, dtype=torch.long), torch.arange(90) % 19 + 1])
    ei = torch.stack([src, dst]).to(DEVICE)
    w = (torch.rand(390) + 0.1).to(DEVICE)
    check_kernels(CSRGraph.from_adj(ei, (35, 20), edge_weight=w), dim=dim, k=k, h=h)
    check_kernels(CSRGraph.from_adj(ei, (35, 20), normalization="mean"), dim=dim, k=k, h=h)


def test_misaligned_cbsr_falls_back_to_single_slot_loads():
    # CBSR arrays that are views at an odd offset cannot be read 4 slots at
    # a time: the kernels read them one slot per load, with the same result.
    h = random_cbsr(35, 80, 32, seed=5)
    values = torch.empty(35 * 32 + 1, device=DEVICE)[1:].view(35, 32).copy_(h.values)
    indices = torch.empty(35 * 32 + 1, dtype=torch.uint8, device=DEVICE)[1:].view(35, 32)
    indices.copy_(h.indices)
    assert numba_ops._index_operand(indices, 4, values.view(-1))[1] == 1
    assert numba_ops._index_operand(h.indices, 4, values.view(-1))[1] == 1
    ei = random_edge_index(35, 20, 300, seed=6).to(DEVICE)
    check_kernels(CSRGraph.from_adj(ei, (35, 20), normalization="mean"), dim=80, k=32,
                  h=CBSR(values, indices, 80))


@pytest.mark.parametrize("dim,k", [(80, 1), pytest.param(80, 5, marks=smoke), (80, 16), (300, 8),
                                   (80, 17)])
def test_value_index_pairs(monkeypatch, dim, k):
    # On large graphs the forward reads the CBSR as (value, index) pairs up
    # to k=16: uint8 and int16 indices, one or two slots per load, rows
    # spanning several work items; k=17 is read from the flat arrays. Same
    # results either way.
    from pyg_maxk.kernels.spgemm import reads_pairs
    monkeypatch.setattr(numba_ops, "PAIRS_MIN_EDGES", 0)
    h = random_cbsr(35, dim, k, seed=k)
    pairs = numba_ops._spgemm_operands(h.values, h.indices, num_edges=1)[4]
    assert pairs == reads_pairs(k) == (k != 17)
    monkeypatch.setattr(pyg_maxk.graph.schedule, "PAIRS_PER_ITEM", 16 * k)
    ei = random_edge_index(35, 20, 300, seed=k).to(DEVICE)
    w = (torch.rand(300) + 0.1).to(DEVICE)
    for graph in (CSRGraph.from_adj(ei, (35, 20), edge_weight=w),
                  CSRGraph.from_adj(ei, (35, 20), normalization="mean")):
        assert bool(split_items(graph, k).any())
        check_kernels(graph, dim=dim, k=k, h=h)


@pytest.fixture
def linear_kernel_everywhere(monkeypatch):
    """The CBSR linear kernel wherever it fits, also where densify + GEMM is
    faster (the small shapes of these tests)."""
    monkeypatch.setattr(pyg_maxk.dispatch, "_linear_pays", lambda dim, k: True)
    monkeypatch.setattr(pyg_maxk.dispatch, "LINEAR_MIN_ROWS", 0)
    pyg_maxk.dispatch.clear_decisions()
    yield
    pyg_maxk.dispatch.clear_decisions()


@pytest.mark.parametrize("rows,dim,k,out_features,bias", [
    pytest.param(13, 40, 5, 7, True, marks=smoke), (9, 40, 1, 40, False), (6, 70, 32, 33, True),
    (11, 300, 9, 16, True), (5, 24, 23, 64, False), (4, 150, 140, 20, True)])
def test_cbsr_linear_kernel_against_float64(linear_kernel_everywhere, rows, dim, k,
                                            out_features, bias):
    # Odd and even k (slots staged in pairs), a partial last tile of output
    # columns, int16 indices (dim 300), more tiles than rows, slots beyond
    # those a lane loads a row ahead (k=140).
    check_cbsr_linear(random_cbsr(rows, dim, k, seed=k), out_features, bias, seed=k)


def test_cbsr_linear_kernel_takes_float32_within_shared_memory_only(linear_kernel_everywhere):
    from pyg_maxk.kernels.linear import linear_fits
    assert linear_fits(368, 32) and not linear_fits(369, 32)
    assert not geometry.takes_linear(400, 3)  # a W^T tile of 50 KiB: the dense path
    check_cbsr_linear(random_cbsr(4, 400, 3), 5, True, expect_kernel=False)
    h = random_cbsr(6, 30, 4, dtype=torch.float64)
    with pytest.raises(pyg_maxk.BackendError, match="float64"):  # the backend takes none
        check_cbsr_linear(h, 5, True, expect_kernel=False)


def test_cbsr_linear_kernel_only_where_it_beats_the_dense_path(monkeypatch):
    # Measured on an H200: faster than densify + GEMM for k <= 16 at dims 64
    # to 256 and k=32 at dim 256, slower at k=32 (dims 64, 128) and k=64.
    from pyg_maxk.kernels.linear import linear_pays
    assert linear_pays(64, 16) and linear_pays(128, 16) and linear_pays(256, 32)
    assert not (linear_pays(64, 32) or linear_pays(128, 32) or linear_pays(256, 64))
    rows = pyg_maxk.dispatch.LINEAR_MIN_ROWS
    for num_rows, expected in ((rows, "numba"), (rows - 1, "torch")):
        h = CBSR(torch.zeros(num_rows, 32, device=DEVICE),
                 torch.zeros(num_rows, 32, dtype=torch.uint8, device=DEVICE), 256)
        with pyg_maxk.use_backend("numba"):
            assert pyg_maxk.ops.linear_backend(h, torch.zeros(8, 256, device=DEVICE)) == expected
    monkeypatch.setattr(pyg_maxk.dispatch, "LINEAR_MIN_ROWS", 0)
    pyg_maxk.dispatch.clear_decisions()
    check_cbsr_linear(random_cbsr(6, 40, 20), 3, True, expect_kernel=False)
    check_cbsr_linear(random_cbsr(6, 40, 16), 3, True, expect_kernel=True)


def test_features_beyond_32_bit_offsets_are_a_clear_error():
    # The kernels index CBSR slots with uint32; the forward's (value, index)
    # pairs (k <= 16 on large graphs) take two per slot.
    large = numba_ops.PAIRS_MIN_EDGES
    for rows, k in ((2**27 - 1, 32), (2**27 - 1, 16), (2**28 - 1, 8)):
        numba_ops.check_cbsr_offsets(rows, k, large)
    numba_ops.check_cbsr_offsets(2**27, 16, large - 1)  # read flat on a smaller graph
    for rows, k in ((2**27, 32), (2**27, 16), (2**28, 8)):
        with pytest.raises(ValueError, match="uint32"):
            numba_ops.check_cbsr_offsets(rows, k, large)
    # Packed half-precision pairs take one offset per slot.
    numba_ops.check_cbsr_offsets(2**28 - 1, 16, large, torch.bfloat16)
    with pytest.raises(ValueError, match="uint32"):
        numba_ops.check_cbsr_offsets(2**28, 16, large, torch.bfloat16)


def test_too_wide_for_shared_memory_raises_when_forced_and_falls_back_under_auto():
    from pyg_maxk.kernels.spgemm import SHARED_BYTES
    dim = SHARED_BYTES // 4 + 1
    assert not geometry.takes_aggregation(3, dim)
    ei = random_edge_index(6, 5, 12, seed=4).to(DEVICE)
    graph = CSRGraph.from_adj(ei, (6, 5))
    h = random_cbsr(6, dim, 3)
    with pyg_maxk.use_backend("numba"), pytest.raises(pyg_maxk.BackendError,
                                                      match="shared memory.*'auto'"):
        pyg_maxk.aggregate(graph, h)
    if ON_GPU:
        assert pyg_maxk.dispatch.choose("aggregate", h.values, dim=dim, k=3) == "torch"
    torch.testing.assert_close(pyg_maxk.aggregate(graph, h).double(),
                               reference_spgemm(graph, h), rtol=1e-5, atol=1e-5)


def test_bipartite_empty_and_wide():
    ei = random_edge_index(17, 9, 60, seed=2).to(DEVICE)
    check_kernels(CSRGraph.from_adj(ei, (17, 9), normalization="mean"), dim=300, k=7)
    empty = CSRGraph.from_adj(torch.empty(2, 0, dtype=torch.long, device=DEVICE), (5, 4))
    check_kernels(empty, dim=16, k=3)


@pytest.mark.parametrize("dim,k", [(40, 1), pytest.param(40, 9, marks=smoke), (40, 39), (300, 12)])
def test_maxk_select_matches_topk(dim, k):
    x = torch.randn(13, dim).to(DEVICE).requires_grad_()
    poison_allocator()
    h = kernel_maxk(x, k)
    assert h.indices.dtype == pyg_maxk.index_dtype_for(dim)
    assert_same_selection(h, x.detach(), k, order="bank")
    idx = h.indices.long()
    g = torch.randn_like(h.values)
    h.values.backward(g)
    torch.testing.assert_close(x.grad, torch.zeros_like(x).scatter(1, idx, g))


@pytest.mark.parametrize("k", [1, 20, 69])
def test_maxk_select_many_ties_negatives_and_signed_zeros(k):
    # Few distinct values: the k-th largest is tied across lanes and slots.
    x = few_valued_rows(k).to(DEVICE)
    h = kernel_maxk(x, k)
    assert_same_selection(h, x, k, order="bank")
    assert_ties_keep_lowest_columns(h, x)


def test_maxk_select_ties_and_nan():
    x = torch.tensor([[1.0, 3.0, 3.0, float("nan"), 3.0, -1.0, float("-inf"), 0.0]] * 2)
    h = kernel_maxk(x.to(DEVICE), 4)
    # NaN kept (torch.topk ranks it first), then the tied 3.0s; column order.
    assert h.indices.long().cpu().tolist() == [[1, 2, 3, 4]] * 2


def test_maxk_select_writes_bank_major_order():
    # Kept columns 60..69 of 70: by column mod 32 (64..69 are banks 0..5,
    # 60..63 banks 28..31), as the SpGEMM/SSpMM read them best.
    x = torch.arange(70.0).repeat(3, 1)
    h = kernel_maxk(x.to(DEVICE), 10)
    assert h.indices.long().cpu().tolist() == [[64, 65, 66, 67, 68, 69, 60, 61, 62, 63]] * 3
    assert h.values.cpu().tolist() == [[64.0, 65, 66, 67, 68, 69, 60, 61, 62, 63]] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [40, 300])
def test_maxk_select_matches_topk_at_k32(dim, dtype):
    # k = 32, the benchmarks' k: as many kept entries as lanes.
    x = torch.randn(13, dim).to(DEVICE, dtype)
    poison_allocator()
    assert_same_selection(kernel_maxk(x, 32), x, 32, order="bank")


@pytest.mark.parametrize("num_rows,dim,k,dtype", [
    (13, 40, 1, torch.float32), (13, 40, 39, torch.float32), (9, 300, 12, torch.float32),
    (7, 80, 70, torch.float32), (5, 300, 200, torch.float32), (0, 16, 3, torch.float32),
    pytest.param(13, 40, 7, torch.bfloat16, marks=smoke), (9, 301, 12, torch.bfloat16),
    (5, 300, 200, torch.float16)])
def test_to_dense_kernel_writes_whole_rows(num_rows, dim, k, dtype):
    # The output is never zero-filled: poison shows any entry left unwritten.
    # More rows than warps (each warp loads its next row ahead), and k=200:
    # slots beyond DENSIFY_AHEAD * 32 are loaded when their row is built.
    # Half rows of even width are stored as words of two entries, of odd
    # width one entry at a time.
    h = random_cbsr(num_rows, dim, k, seed=dim + k, dtype=dtype)
    values = h.values.clone().requires_grad_()
    poison_allocator()
    with pyg_maxk.use_backend("numba"):
        dense = h.with_values(values).to_dense()
    assert dense.shape == (num_rows, dim)
    torch.testing.assert_close(dense, dense_reference(h), rtol=0, atol=0)
    g = torch.randn(num_rows, dim).to(DEVICE, dtype)
    dense.backward(g)
    torch.testing.assert_close(values.grad, g.gather(1, h.long_indices()), rtol=0, atol=0)


def test_to_dense_too_wide_for_the_kernel_raises_when_forced():
    from pyg_maxk.kernels.maxk_select import DENSIFY_SHARED_BYTES, densify_fits
    dim = DENSIFY_SHARED_BYTES // 4 + 1
    assert not densify_fits(dim, 1) and not geometry.takes_densify(dim)
    h = random_cbsr(3, dim, 5)
    with pyg_maxk.use_backend("numba"), pytest.raises(pyg_maxk.BackendError,
                                                      match="densify kernel"):
        h.to_dense()
    torch.testing.assert_close(h.to_dense(), dense_reference(h), rtol=0, atol=0)  # auto


def _contract_case(kind, form):
    smoke_forms = {"sage": "edge_index", "gcn": "csr", "gin": "coo"}
    return pytest.param(kind, form, marks=smoke if smoke_forms[kind] == form else ())


@pytest.mark.parametrize("kind,form", [_contract_case(kind, form)
                                       for kind in ("sage", "gcn", "gin") for form in FORMS
                                       if form != "SparseTensor" or not ON_GPU])
def test_layer_contract_numba(linear_kernel_everywhere, kind, form):
    # Every adjacency form (SparseTensor on the CPU only: torch_sparse's CUDA
    # ops may be missing; tests/test_gpu.py covers it where they exist).
    ei = random_edge_index(14, 14, 50, seed=3).to(DEVICE)
    value = (torch.rand(ei.size(1)) + 0.1).to(DEVICE) if form not in ("edge_index",
                                                                       "EdgeIndex") else None
    adj = adjacency(form, ei, (14, 14), value)
    ours, stock = make_pair(kind)
    x = torch.randn(14, 24).to(DEVICE)
    if kind == "gcn" and form == "csc":  # as the stock GCNConv
        with pytest.raises(NotImplementedError):
            ours.to(DEVICE)(x, adj)
        return
    assert_same_as_stock(ours.to(DEVICE), stock.to(DEVICE), x, (adj,), 5, backend="numba")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("normalization,weighted", [pytest.param("mean", False, marks=smoke),
                                                    ("sum", True)])
def test_half_precision_kernels_against_float64(dtype, normalization, weighted):
    ei = random_edge_index(30, 30, 200, seed=9).to(DEVICE)
    w = (torch.rand(200) + 0.1).to(DEVICE) if weighted else None
    graph = CSRGraph.from_adj(ei, (30, 30), edge_weight=w, normalization=normalization)
    check_half_kernels(graph, dim=40, k=6, dtype=dtype, seed=9)


@pytest.mark.parametrize("k", range(1, 64))
def test_half_precision_kernels_every_k(monkeypatch, k):
    # Every k from 1 to dim - 1 at dim 64: 1, 2 and 4 slots per load, one
    # lane per slot and several, flat arrays and (value, index) pairs, a row
    # of 34 edges split over work items of 16.
    dtype, normalization, pairs = every_k_case(k)
    monkeypatch.setattr(pyg_maxk.graph.schedule, "PAIRS_PER_ITEM", 16 * k)
    if pairs:
        monkeypatch.setattr(numba_ops, "PAIRS_MIN_EDGES", 0)
    g = torch.Generator().manual_seed(k)
    src = torch.cat([torch.arange(34) % 20, torch.randint(0, 20, (12,), generator=g)])
    dst = torch.cat([torch.zeros(34, dtype=torch.long), torch.arange(12) % 5 + 1])
    w = torch.rand(46, generator=g) + 0.1
    graph = CSRGraph.from_adj(torch.stack([src, dst]).to(DEVICE), (20, 7),
                              edge_weight=w.to(DEVICE) if normalization == "sum" else None,
                              normalization=normalization)
    assert bool(split_items(graph, k).any())
    check_half_kernels(graph, 64, k, dtype, seed=k)


@pytest.mark.parametrize("dim,k,dtype", [(40, 8, torch.bfloat16), (80, 16, torch.float16),
                                         (80, 32, torch.bfloat16), (300, 32, torch.float16),
                                         (96, 64, torch.bfloat16)])
def test_half_precision_vector_loads(dim, k, dtype):
    # 2 or 4 half values per load (4 or 8 bytes) beside words of uint8 or
    # int16 indices, rows spanning several work items.
    h = random_cbsr(35, dim, k, seed=k, dtype=dtype)
    others = torch.randint(0, 35, (90,), generator=torch.Generator().manual_seed(k))
    src = torch.cat([torch.arange(300) % 35, others])
    dst = torch.cat([torch.zeros(300, dtype=torch.long), torch.arange(90) % 19 + 1])
    ei = torch.stack([src, dst]).to(DEVICE)
    w = (torch.rand(390) + 0.1).to(DEVICE)
    check_half_kernels(CSRGraph.from_adj(ei, (35, 20), edge_weight=w), dim, k, dtype, h=h)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim,k,normalization", [pytest.param(40, 8, "mean", marks=smoke),
                                                 (80, 16, "sum"),
                                                 (80, 32, "gcn"), (300, 24, "mean"),
                                                 (300, 64, "sum")])
def test_half_reductions_against_float64(monkeypatch, dim, k, normalization, dtype):
    # 8 slots per packed reduction: one, two, three or eight lanes per
    # neighbour (several groups per warp), uint8 indices (one word per lane)
    # and int16 ones (two words), a row scale, edge values, rows split over
    # work items.
    monkeypatch.setattr(pyg_maxk.graph.schedule, "PAIRS_PER_ITEM", 16 * k)
    others = torch.randint(0, 35, (90,), generator=torch.Generator().manual_seed(k))
    src = torch.cat([torch.arange(300) % 35, others])
    dst = torch.cat([torch.zeros(300, dtype=torch.long), torch.arange(90) % 19 + 1])
    w = (torch.rand(390) + 0.1).to(DEVICE) if normalization != "mean" else None
    graph = CSRGraph.from_adj(torch.stack([src, dst]).to(DEVICE), (35, 35), edge_weight=w,
                              normalization=normalization)
    assert bool(split_items(graph, k).any())
    check_half_reductions(monkeypatch, graph, dim, k, dtype, seed=k)


@pytest.mark.parametrize("k,dtype,reason", [
    (12, torch.bfloat16, "k not a multiple of 8"), (16, torch.float32, "float32 gradient")])
def test_half_reductions_only_where_they_apply(monkeypatch, k, dtype, reason):
    # Elsewhere the allowed switch changes nothing: float32 sums, as exact as
    # ever.
    monkeypatch.setattr(pyg_maxk.dispatch, "_half_reductions", True)
    half_grad = torch.zeros(4, 8, dtype=torch.float16, device=DEVICE)
    indices = torch.zeros(5, k, dtype=torch.uint8, device=DEVICE)
    assert not numba_ops._reduces_in_half(torch.zeros(4, 8, dtype=dtype, device=DEVICE),
                                          indices), reason
    buffer = torch.zeros(5 * 16 + 1, dtype=torch.uint8, device=DEVICE)
    assert numba_ops._reduces_in_half(half_grad, buffer[:80].view(5, 16))
    assert not numba_ops._reduces_in_half(half_grad, buffer[1:].view(5, 16))  # misaligned


def test_half_reductions_switch(monkeypatch):
    monkeypatch.setattr(pyg_maxk.dispatch, "_half_reductions", None)
    monkeypatch.delenv("PYG_MAXK_HALF_REDUCTIONS", raising=False)
    assert not pyg_maxk.half_reductions_allowed()  # off by default
    monkeypatch.setenv("PYG_MAXK_HALF_REDUCTIONS", "1")
    assert pyg_maxk.half_reductions_allowed()
    pyg_maxk.allow_half_reductions(False)          # the call wins over the environment
    assert not pyg_maxk.half_reductions_allowed()
    pyg_maxk.allow_half_reductions()
    assert pyg_maxk.half_reductions_allowed()


@pytest.mark.parametrize("dim,k,dtype", [(80, 1, torch.bfloat16), (80, 6, torch.float16),
                                         (300, 16, torch.bfloat16), (80, 32, torch.float16),
                                         (80, 33, torch.bfloat16)])
def test_half_precision_value_index_pairs(monkeypatch, dim, k, dtype):
    # Half values pack with their index into one 32-bit word, so a row of
    # pairs fits a cache line up to k=32 (one, two or four pairs per load);
    # k=33 is read from the flat arrays. Forced here on a small graph.
    from pyg_maxk.kernels.spgemm import reads_pairs
    monkeypatch.setattr(numba_ops, "PAIRS_MIN_EDGES", 0)
    monkeypatch.setattr(pyg_maxk.graph.schedule, "PAIRS_PER_ITEM", 16 * k)
    h = random_cbsr(35, dim, k, seed=k, dtype=dtype)
    pairs = numba_ops._spgemm_operands(h.values, h.indices, num_edges=1)
    assert pairs[4] == reads_pairs(k, half=True) == (k <= 32)
    if pairs[4]:
        words = pairs[0].view(35, k)
        assert torch.equal((words >> 16).to(h.indices.dtype), h.indices)
        assert torch.equal((words & 0xFFFF).to(torch.int16), h.values.view(torch.int16))
    ei = random_edge_index(35, 20, 300, seed=k).to(DEVICE)
    graph = CSRGraph.from_adj(ei, (35, 20), normalization="mean")
    assert bool(split_items(graph, k).any())
    check_half_kernels(graph, dim, k, dtype, h=h)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim,k", [(40, 1), (40, 9), (300, 12)])
def test_maxk_select_half_precision(dim, k, dtype):
    # The select kernel ranks half values by their float32 value and copies
    # them bit for bit; its backward (densify) writes half gradients.
    x = torch.randn(13, dim).to(DEVICE, dtype).requires_grad_()
    poison_allocator()
    h = kernel_maxk(x, k)
    assert h.values.dtype == dtype
    assert_same_selection(h, x.detach(), k, order="bank")
    g = torch.randn(h.values.shape).to(DEVICE, dtype)
    h.values.backward(g)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad, torch.zeros_like(x).scatter(1, h.indices.long(), g),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", HALF)
def test_maxk_select_half_precision_ties_nan_and_signed_zeros(dtype):
    x = few_valued_rows(7).to(DEVICE, dtype)
    h = kernel_maxk(x, 20)
    assert_same_selection(h, x, 20, order="bank")
    assert_ties_keep_lowest_columns(h, x)
    nan = torch.tensor([[1.0, 3.0, 3.0, float("nan"), 3.0, -1.0, float("-inf"), 0.0]] * 2)
    assert kernel_maxk(nan.to(DEVICE, dtype), 4).indices.long().cpu().tolist() == [[1, 2, 3, 4]] * 2


def test_layer_contract_numba_bipartite_sage(linear_kernel_everywhere):
    ei = random_edge_index(11, 7, 30, seed=4).to(DEVICE)
    ours, stock = make_pair("sage")
    x = (torch.randn(11, 24).to(DEVICE), torch.randn(7, 24).to(DEVICE))
    assert_same_as_stock(ours.to(DEVICE), stock.to(DEVICE), x, (ei, (11, 7)), 5,
                         backend="numba")


def test_maxk_uses_the_select_kernel_up_to_its_measured_width(monkeypatch):
    calls, original = [], numba_ops.maxk_select
    monkeypatch.setattr(numba_ops, "maxk_select", lambda x, k: calls.append(k) or original(x, k))
    x = torch.randn(5, 256).to(DEVICE)
    wide = torch.randn(3, pyg_maxk.dispatch.MAX_SELECT_DIM + 1).to(DEVICE)
    with pyg_maxk.use_backend("numba"):
        small, large = pyg_maxk.maxk(x, 8), pyg_maxk.maxk(x, 64)
        with pytest.raises(pyg_maxk.BackendError, match="rows up to 1024"):
            pyg_maxk.maxk(wide, 4)
    assert calls == [8, 64]
    assert_same_selection(small, x, 8, order="bank")
    assert_same_selection(large, x, 64, order="bank")
    if ON_GPU:  # auto: torch.topk beyond the kernel's width
        torch.testing.assert_close(pyg_maxk.maxk(wide, 4).values, wide.topk(4, dim=1).values)


@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 48), (torch.float16, 48),
                                       (torch.bfloat16, 45)])
@pytest.mark.parametrize("bounded", [False, True])
def test_half_aggregation_is_the_float32_sum_rounded_once(monkeypatch, dtype, dim, bounded):
    # A half-precision aggregation is stored by the kernel itself: each
    # float32 sum rounded once, bit for bit the float32 kernel's sum of the
    # same (widened) values rounded by torch; rows split over work items
    # (float32 partial sums, rounded once after the last) and rows without
    # edges (zeros) included; with the bounded schedule too (zeroed rows
    # padded with a scratch row below the half output).
    monkeypatch.setattr(pyg_maxk.graph.schedule, "PAIRS_PER_ITEM", 16 * 8)
    g = torch.Generator().manual_seed(5)
    src = torch.cat([torch.arange(60) % 30, torch.randint(0, 30, (80,), generator=g)])
    dst = torch.cat([torch.zeros(60, dtype=torch.long), torch.randint(2, 25, (80,), generator=g)])
    for normalization in ("mean", "sum"):
        graph = CSRGraph.from_adj(torch.stack([src, dst]).to(DEVICE), (30, 25),
                                  normalization=normalization, cache=False)
        if bounded:
            graph._build_operands(pyg_maxk.graph.max_edges_per_item(8), bounded=True)
        assert bool(split_items(graph, 8).any())
        h = random_cbsr(30, dim, 8, seed=6, dtype=dtype)
        with pyg_maxk.use_backend("numba"):
            poison_allocator()
            out = pyg_maxk.aggregate(graph, h)
            poison_allocator()
            wide = pyg_maxk.aggregate(graph, h.with_values(h.values.float()))
        assert out.dtype == dtype
        from pyg_maxk.graph import unpack
        zeroed = unpack(*graph.operands(8)).zeroed_rows
        assert bool((zeroed == 25).any()) == bounded  # the scratch row
        zeroed = zeroed[zeroed < 25]
        whole = torch.ones(25, dtype=torch.bool, device=DEVICE)
        whole[zeroed] = False
        assert bool(whole.any()) and zeroed.numel() >= 1
        torch.testing.assert_close(out[whole], wide[whole].to(dtype), rtol=0, atol=0)
        # Split rows: float32 atomics in any order, one rounding at the end.
        torch.testing.assert_close(out[zeroed].double(), wide[zeroed].double(),
                                   rtol=HALF_UNIT[dtype], atol=1e-6)
        assert bool((out[1] == 0).all())  # row 1 has no edges


#: Module-level name ``cuda`` (the simulator swaps exactly this global).
cuda = cuda_module()


def _narrowed(dtype, x):
    """``x`` (float32) rounded to ``dtype`` by the kernels' ``narrow``."""
    from pyg_maxk.kernels._half import narrow
    to_bits = narrow(numba_ops.half_kind(dtype))

    @cuda.jit
    def kernel(x, out):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = to_bits(x[i])

    out = torch.full(x.shape, 0x5555, dtype=torch.int16, device=DEVICE)
    # CUDA tensors go in as they are; the simulator takes numpy views.
    args = (x, out) if ON_GPU else (x.numpy(), out.numpy())
    kernel[(x.numel() + 31) // 32, 32](*args)
    return out


@pytest.mark.parametrize("dtype", HALF)
def test_kernels_round_to_half_as_torch(dtype):
    # Round to nearest even, ties both ways, overflow to infinity, signed
    # zeros, subnormals, infinities and NaN: the kernels' rounding of a
    # float32 to a half type is torch's, bit for bit.
    info = torch.finfo(dtype)
    lsb = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    special = torch.tensor([0.0, -0.0, 1.0, 1.0 + lsb, 1.0 + 3 * lsb, -(1.0 + lsb),
                            1.0 + lsb / 2, 1.0 + lsb * 1.5, info.max, -info.max,
                            info.max * 1.01, 3.0e38, info.tiny, info.tiny / 3, -info.tiny / 5,
                            float("inf"), float("-inf"), 1e-45])
    g = torch.Generator().manual_seed(0)
    x = torch.cat([special, torch.randn(4000, generator=g) * 10.0 ** torch.randint(
        -8, 8, (4000,), generator=g).float()]).to(DEVICE)
    expected = x.to(dtype).view(torch.int16)
    torch.testing.assert_close(_narrowed(dtype, x), expected, rtol=0, atol=0)
    nan = _narrowed(dtype, torch.tensor([float("nan"), -float("nan")], device=DEVICE))
    assert bool(torch.isnan(nan.view(dtype)).all())


@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
@pytest.mark.parametrize("num_rows,dim,k", [(37, 24, 5), (9, 300, 32), (0, 16, 4)])
def test_gather_at_the_cbsr_pattern(dtype, num_rows, dim, k):
    # The numba sampling of a dense matrix at a CBSR pattern (the CBSR linear
    # map's backward) reads uint8/int16 indices as stored: torch's gather,
    # bit for bit, every entry written over poison.
    h = random_cbsr(num_rows, dim, k, seed=dim)
    g = torch.Generator().manual_seed(k)
    dense = torch.randn(num_rows, dim, generator=g).to(DEVICE, dtype)
    poison_allocator()
    out = numba_ops.gather_at(dense, h.indices)
    assert out.dtype == dtype and out.shape == (num_rows, k)
    torch.testing.assert_close(out, dense.gather(1, h.long_indices()), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
@pytest.mark.parametrize("num_rows,columns", [(1, 6), (7, 3), (300, 40), (1000, 256), (0, 5)])
def test_column_sums_against_float64(dtype, num_rows, columns):
    # The bias gradient's column sums, in float32 whatever the storage: within
    # (n + 1) u32 sum|x| of the float64 sum before the result's one rounding
    # (fewer rows than the unroll, a remainder, one row slice and several).
    g = torch.Generator().manual_seed(num_rows + columns)
    x = (torch.randn(num_rows, columns, generator=g) + 0.3).to(DEVICE, dtype)
    out = numba_ops.column_sums(x)
    assert out.dtype == dtype and out.shape == (columns,)
    exact = x.double().sum(0)
    bound = (num_rows + 1) * 2.0 ** -24 * x.double().abs().sum(0)
    if dtype != torch.float32:
        bound += HALF_UNIT[dtype] * exact.abs()
    assert bool(((out.double() - exact).abs() <= bound + 1e-30).all())


@pytest.mark.parametrize("given", [
    pytest.param("agg", marks=smoke), "agg,values,dense", "values", "dense", "agg,dense",
    "agg,values,dense,scale"])
@pytest.mark.parametrize("size,dim,k", [((14, 11), 40, 5), ((9, 9), 64, 40)])
def test_features_gradient_fused_densify_against_float64(given, size, dim, k):
    # MaxK + aggregation's gradient w.r.t. the features: the SSpMM, then one
    # launch adding the kept values' gradients and the dense one sampled at
    # the pattern and writing whole rows (k below and beyond a warp's 32
    # slots); every entry of a poisoned output written, the first and the
    # prepared second launch alike, and the torch backend's steps matched.
    from pyg_maxk.graph import unpack
    from pyg_maxk.ops import _library as lib
    ei = random_edge_index(*size, 50, seed=2)
    graph = CSRGraph.from_adj(ei.to(DEVICE), size, edge_weight=torch.rand(50, device=DEVICE) + 0.1,
                              normalization="sum")
    h = random_cbsr(size[0], dim, k, seed=k)
    g = torch.Generator().manual_seed(3)
    grads = {"agg": torch.randn(size[1], dim, generator=g),
             "values": torch.randn(size[0], k, generator=g),
             "dense": torch.randn(size[0], dim, generator=g),
             "scale": torch.randint(0, 2, (size[0], k), generator=g).float() * 2}
    present = {name: grads[name].to(DEVICE) if name in given.split(",") else None
               for name in grads}
    a = graph.torch_csr(torch.float64).cpu()
    index = h.long_indices().cpu()
    kept = torch.zeros(size[0], k, dtype=torch.float64)
    if present["agg"] is not None:
        kept += torch.sparse.mm(a.t().to_sparse_csr(), grads["agg"].double()).gather(1, index)
    if present["values"] is not None:
        kept += grads["values"].double()
    if present["dense"] is not None:
        kept += grads["dense"].double().gather(1, index)
    if present["scale"] is not None:
        kept *= grads["scale"].double()
    ref = torch.zeros(size[0], dim, dtype=torch.float64).scatter_(1, index, kept)
    ops = unpack(*graph.operands(k))
    for _ in range(3):  # the third call takes the prepared launch
        poison_allocator()
        terms = [present[name] for name in ("agg", "values", "dense")]
        out = numba_ops.maxk_input_grad(ops, h.indices, *terms, dim, present["scale"])
        assert out.dtype == torch.float32 and out.shape == (size[0], dim)
        torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    packed = graph.operands(k)
    results = [lib.maxk_input_grad(*packed, h.indices, *present.values(), dim, torch.float32,
                                   backend) for backend in ("numba", "torch")]
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_dst,num_edges,max_edges", [
    pytest.param(6, 23, 3, marks=smoke), (5, 23, 1), (6, 23, 8), (40, 120, 16), (1, 0, 4),
    (3, 0, 2), (10, 200, 7), (0, 0, 3)])
@pytest.mark.parametrize("heavy", [False, True])
def test_bounded_schedule_kernels_match_the_torch_build(num_dst, num_edges, max_edges, heavy):
    # A new graph's bounded schedule by two kernels and a prefix sum: the
    # torch ops' items, padding and zeroed rows exactly (rows without edges,
    # split rows, no rows at all), from int32 row pointers.
    from pyg_maxk.graph.schedule import schedule_with_torch, work_schedule
    g = torch.Generator().manual_seed(num_edges + max_edges)
    dst = torch.randint(0, max(num_dst, 1), (num_edges,), generator=g)
    if heavy:
        dst[:num_edges // 2] = 0
    dst = torch.sort(dst).values
    rowptr = torch.searchsorted(dst, torch.arange(num_dst + 1)).to(DEVICE)
    expected = schedule_with_torch(rowptr.long(), num_edges, max_edges, True)
    poison_allocator()
    built = work_schedule(rowptr.int(), num_edges, max_edges, True)
    for name in ("row", "start", "end", "split", "zeroed_rows"):
        got, want = getattr(built, name), getattr(expected, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("normalization,weighted", [
    pytest.param("mean", False, marks=smoke), ("mean", True), ("sum", False), ("sum", True),
    ("gcn", True)])
@pytest.mark.parametrize("num_src,num_dst,num_edges", [(9, 7, 40), (5, 12, 0), (6, 1, 9)])
def test_new_graph_csr_kernel_matches_the_torch_build(normalization, weighted, num_src,
                                                      num_dst, num_edges):
    # A new GPU graph's CSR in one launch (row pointers by binary search,
    # int32 sources, the mean's 1/deg rounded once, the range check into a
    # flag): the torch build's arrays bit for bit, rows without edges too.
    ei = random_edge_index(num_src, num_dst, num_edges, seed=num_edges).to(DEVICE)
    w = (torch.rand(num_edges) + 0.1).to(DEVICE) if weighted else None
    src, (dst, perm) = ei[0], torch.sort(ei[1], stable=True)
    expected = CSRGraph.from_csr(torch.searchsorted(dst, torch.arange(num_dst + 1,
                                                                      device=DEVICE)),
                                 src[perm], None if w is None else w[perm],
                                 (num_src, num_dst), normalization)
    poison_allocator()
    graph = CSRGraph._from_sorted_with_kernels(src[perm], dst, perm, w, (num_src, num_dst),
                                               normalization)
    assert torch.equal(graph.edge_order, perm)
    for name in ("rowptr", "col", "weight", "row_scale"):
        got, want = getattr(graph, name), getattr(expected, name)
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.dtype == want.dtype and torch.equal(got, want), name


@pytest.mark.parametrize("bad", ["source", "target_high", "target_low"])
def test_new_graph_csr_kernel_flags_indices_out_of_range(bad):
    from pyg_maxk.ops.numba_ops import csr_of_sorted
    ei = torch.tensor([[0, 1, 2, 1], [0, 1, 1, 2]])
    if bad == "source":
        ei[0, 2] = 3
    elif bad == "target_high":
        ei[1, 3] = 3
    else:
        ei[1, 0] = -1
    ei = ei.to(DEVICE)
    *_, ok = csr_of_sorted(ei[0], ei[1], None, 3, 3, True)
    assert ok.tolist() == [0]
    *_, ok = csr_of_sorted(ei[0].clamp(0, 2), ei[1].clamp(0, 2), None, 3, 3, True)
    assert ok.tolist() == [1]


def _shuffled(ei: torch.Tensor, seed: int = 0) -> torch.Tensor:
    order = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(seed))
    return ei[:, order.to(ei.device)]


@pytest.mark.parametrize("normalization,weighted", [
    pytest.param("mean", False, marks=smoke), ("mean", True), ("sum", False), ("sum", True),
    ("gcn", True), ("gcn", False)])
def test_edge_list_kernels_against_float64(normalization, weighted):
    # A new graph's aggregation over its edge list in any order (atomics):
    # self-loops, multi-edges, targets without edges; the same sums as the
    # CSR graph of the edge list, forward and backward.
    ei = _shuffled(random_edge_index(30, 30, 150, seed=4)).to(DEVICE)
    w = (torch.rand(150) + 0.1).to(DEVICE) if weighted else None
    poison_allocator()
    graph = EdgeListGraph.from_edge_index(ei, (30, 30), edge_weight=w,
                                          normalization=normalization)
    csr = CSRGraph.from_adj(ei, (30, 30), edge_weight=w, normalization=normalization,
                            cache=False)
    assert (graph.row_scale is not None) == (normalization == "mean" and not weighted)
    check_kernels(graph, dim=40, k=6, reference=csr)


@pytest.mark.parametrize("with_dense", [False, True])
def test_edge_list_maxk_aggregate_matches_the_csr_graph(with_dense):
    # MaxK and the aggregation in one op, and its fused features' gradient.
    ei = _shuffled(random_edge_index(20, 16, 90, seed=5), seed=1).to(DEVICE)
    graphs = [EdgeListGraph.from_edge_index(ei, (20, 16), normalization="mean"),
              CSRGraph.from_adj(ei, (20, 16), normalization="mean", cache=False)]
    x = torch.randn(20, 24).to(DEVICE)
    outs, grads = [], []
    for graph in graphs:
        xg = x.clone().requires_grad_()
        with pyg_maxk.use_backend("numba"):
            agg, h, dense = pyg_maxk.ops.maxk_aggregate(xg, 5, graph, with_dense=with_dense)
            loss = (agg * torch.arange(24.0, device=DEVICE)).sum() + h.values.sum()
            if dense is not None:
                loss = loss + (dense * dense).sum()
            loss.backward()
        outs.append(agg)
        grads.append(xg.grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_dense,dropout,bounded,sums", [
    pytest.param(True, True, False, True, marks=smoke), (False, False, False, False),
    (True, False, True, True), (False, True, True, False)])
def test_maxk_aggregate_select_launch_takes_dropout_dense_and_zero_fill(
        monkeypatch, with_dense, dropout, bounded, sums):
    # One select launch scales the kept values (dropout), writes the dense
    # form, zeroes the split rows' float32 sums and the backward's SSpMM
    # sums: the results of the steps one at a time (select, the scale's
    # product, densify, the aggregation with its own zero-fill, the SSpMM
    # with its own), every output written (fresh tensors poisoned).
    from pyg_maxk.graph import unpack
    monkeypatch.setattr(pyg_maxk.graph.schedule, "PAIRS_PER_ITEM", 16 * 4)
    src = torch.arange(120) % 25
    dst = torch.cat([torch.zeros(90, dtype=torch.long), torch.arange(2, 32)])
    graph = CSRGraph.from_adj(torch.stack([src, dst]).to(DEVICE), (25, 32), cache=False)
    g = unpack(*(graph.operands_without_sync(4) if bounded else graph.operands(4)))
    assert g.zeroed_rows.numel() > 0
    x = torch.randn(25, 40).to(DEVICE)
    scale = ((torch.rand(25, 4) < 0.7).float() / 0.7).to(DEVICE) if dropout else None
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    ref_values, ref_indices = numba_ops.maxk_select(x, 4)
    if scale is not None:
        ref_values = ref_values * scale
    ref_agg = numba_ops.spgemm(g, ref_values, ref_indices, 32, 40)
    ref_dense = numba_ops.cbsr_to_dense(ref_values, ref_indices, 40)
    grad_agg = torch.randn(32, 40).to(DEVICE)
    ref_kept = numba_ops.sspmm(g, ref_indices, grad_agg, 25)
    monkeypatch.setattr(numba_ops.torch, "empty", poisoned)
    for _ in range(2):  # the first launches, then the prepared ones
        zeroed = poisoned(25, 4, device=DEVICE) if sums else None
        agg, values, indices, dense = numba_ops.maxk_aggregate(g, x, 4, 32, with_dense, scale,
                                                               zeroed)
        if sums:
            assert torch.equal(zeroed, torch.zeros_like(zeroed))
            kept = numba_ops.sspmm(g, indices, grad_agg, 25, zeroed)
            assert kept.data_ptr() == zeroed.data_ptr()
            torch.testing.assert_close(kept, ref_kept, rtol=1e-6, atol=1e-6)
        assert torch.equal(indices, ref_indices)
        assert torch.equal(values, ref_values)
        torch.testing.assert_close(agg, ref_agg, rtol=1e-6, atol=1e-6)
        if with_dense:
            assert torch.equal(dense, ref_dense)
        else:
            assert dense is None


@pytest.mark.parametrize("bad", ["source", "target_high", "target_low"])
def test_edge_list_kernel_flags_indices_out_of_range(bad):
    from pyg_maxk.ops.numba_ops import edge_list_values
    ei = torch.tensor([[0, 1, 2, 1], [0, 1, 1, 2]])
    ei[(0, 2) if bad == "source" else (1, 3) if bad == "target_high" else (1, 0)] = (
        -1 if bad == "target_low" else 3)
    ei = ei.to(DEVICE)
    for mean in (False, True):
        *_, ok = edge_list_values(ei[0], ei[1], None, 3, 3, mean)
        assert ok.tolist() == [0]
        *_, ok = edge_list_values(ei[0].clamp(0, 2), ei[1].clamp(0, 2), None, 3, 3, mean)
        assert ok.tolist() == [1]


@pytest.mark.parametrize("kind,form", [("sage", "edge_index"), ("gcn", "EdgeIndex"),
                                       pytest.param("gin", "edge_index", marks=smoke)])
def test_layer_contract_numba_on_an_edge_list(monkeypatch, linear_kernel_everywhere, kind, form):
    # The convs over the edge list a layer takes for a new GPU edge_index
    # (here on any device), against the stock convs.
    from pyg_maxk.graph import edge_list
    monkeypatch.setattr(edge_list, "takes_edge_list", lambda *args: True)
    ei = _shuffled(random_edge_index(14, 14, 50, seed=3)).to(DEVICE)
    adj = adjacency(form, ei, (14, 14))
    ours, stock = make_pair(kind)
    x = torch.randn(14, 24).to(DEVICE)
    assert isinstance(ours.to(DEVICE).graph_for(adj, x, x), EdgeListGraph)
    assert_same_as_stock(ours.to(DEVICE), stock.to(DEVICE), x, (adj,), 5, backend="numba")


@pytest.mark.parametrize("kind", ["sage", "gin"])
def test_bipartite_layer_contract_numba_on_an_edge_list(monkeypatch, linear_kernel_everywhere,
                                                         kind):
    # Source and target nodes apart (x = (x_src, x_dst)): the edge list's
    # range check and kernels take the two sizes, not one.
    from pyg_maxk.graph import edge_list
    monkeypatch.setattr(edge_list, "takes_edge_list", lambda *args: True)
    ei = _shuffled(random_edge_index(20, 12, 60, seed=4)).to(DEVICE)
    ours, stock = make_pair(kind)
    x = (torch.randn(20, 24).to(DEVICE), torch.randn(12, 24).to(DEVICE))
    assert isinstance(ours.to(DEVICE).graph_for(ei, *x), EdgeListGraph)
    out = assert_same_as_stock(ours.to(DEVICE), stock.to(DEVICE), x, (ei,), 5,
                               backend="numba")
    assert out.shape[0] == 12
