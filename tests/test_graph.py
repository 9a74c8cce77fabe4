
import pytest
import torch

import pyg_maxk
from helpers import DEVICE, FORMS, ON_GPU, adjacency, random_edge_index
from pyg_maxk import CSRGraph
from pyg_maxk.graph.cache import _CACHE
from pyg_maxk.graph.operands import GraphOperands, pack, unpack


def _dense(graph):
    return graph.torch_csr(torch.float64).to_dense()


@pytest.mark.parametrize("form", FORMS)
def test_every_form_gives_the_same_graph(form):
    ei = random_edge_index(9, 6, 25, seed=1)
    value = torch.rand(25) + 0.5
    reference = torch.zeros(6, 9, dtype=torch.float64)
    reference.index_put_((ei[1], ei[0]), value.double(), accumulate=True)
    adj = adjacency(form, ei, (9, 6), value)
    weight = value if form in ("edge_index", "EdgeIndex") else None
    if form == "EdgeIndex":
        graph = CSRGraph.from_adj(adj.as_tensor(), (9, 6), edge_weight=weight)
    else:
        graph = CSRGraph.from_adj(adj, (9, 6), edge_weight=weight)
    assert graph.size == (9, 6) and graph.col.dtype == torch.int32
    torch.testing.assert_close(_dense(graph), reference, rtol=1e-6, atol=1e-6)


def test_mean_normalisation_counts_multi_edges():
    ei = torch.tensor([[0, 0, 1, 2], [1, 1, 1, 0]])
    graph = CSRGraph.from_adj(ei, (3, 3), normalization="mean")
    torch.testing.assert_close(_dense(graph)[1],
                               torch.tensor([2 / 3, 1 / 3, 0.0], dtype=torch.float64))
    assert graph.in_degree().tolist() == [1, 3, 0]


def test_mean_without_edge_values_factors_into_a_row_scale():
    ei = random_edge_index(12, 9, 60, seed=4)
    graph = CSRGraph.from_adj(ei, (12, 9), normalization="mean", cache=False)
    deg = graph.in_degree()
    # Every edge value of a row is that row's scale: 1 / in-degree.
    per_edge = torch.repeat_interleave(graph.row_scale, deg.long())
    assert torch.equal(per_edge, graph.weight)
    torch.testing.assert_close(graph.row_scale[deg > 0], 1.0 / deg[deg > 0].float())
    assert graph.to("meta").row_scale.device.type == "meta"
    # Edge values differ within a row, and sum/gcn weights are per edge: no scale.
    weighted = CSRGraph.from_adj(ei, (12, 9), edge_weight=torch.rand(60) + 0.5,
                                 normalization="mean", cache=False)
    assert weighted.row_scale is None
    assert CSRGraph.from_adj(ei, (12, 9), normalization="sum", cache=False).row_scale is None
    with pytest.raises(ValueError, match="row_scale"):
        CSRGraph(graph.rowptr, graph.col, None, graph.size, "mean", graph.row_scale)


def test_cache_reuses_and_never_goes_stale():
    ei = random_edge_index(8, 8, 20)
    a = CSRGraph.from_adj(ei, (8, 8))
    assert CSRGraph.from_adj(ei, (8, 8)) is a  # reused
    assert CSRGraph.from_adj(ei, (8, 8), normalization="mean") is not a
    assert CSRGraph.from_adj(ei.clone(), (8, 8)) is not a  # a new tensor
    ei[0, 0] = (ei[0, 0] + 1) % 8  # an in-place edit
    b = CSRGraph.from_adj(ei, (8, 8))
    assert b is not a and int(b.col.sum()) != int(a.col.sum()) or not torch.equal(b.col, a.col)
    w = torch.rand(20)
    c = CSRGraph.from_adj(ei, (8, 8), edge_weight=w)
    w.mul_(2)
    d = CSRGraph.from_adj(ei, (8, 8), edge_weight=w)
    assert d is not c
    torch.testing.assert_close(d.weight.sum(), 2 * c.weight.sum())


def test_a_cache_lookup_finds_what_from_adj_would_reuse_and_builds_nothing():
    pyg_maxk.clear_graph_cache()
    ei = random_edge_index(8, 8, 20)
    assert CSRGraph.cached(ei, (8, 8)) is None  # never built: no build here either
    assert len(_CACHE) == 0
    a = CSRGraph.from_adj(ei, (8, 8), normalization="mean")
    hits = a._cache_hits
    assert CSRGraph.cached(ei, (8, 8), normalization="mean") is a
    assert a._cache_hits == hits + 1  # counted as from_adj's hit is
    for other in ({"normalization": "sum"}, {"normalization": "mean", "root_loops": True}):
        assert CSRGraph.cached(ei, (8, 8), **other) is None  # another key
    assert CSRGraph.cached(ei, (8, 9), normalization="mean") is None
    assert CSRGraph.cached(ei.clone(), (8, 8), normalization="mean") is None
    assert CSRGraph.cached(a, (8, 8), normalization="mean") is None  # not an adjacency
    w = torch.rand(20)
    c = CSRGraph.from_adj(ei, (8, 8), edge_weight=w)
    assert CSRGraph.cached(ei, (8, 8), edge_weight=w) is c
    assert CSRGraph.cached(ei, (8, 8), edge_weight=w.requires_grad_()) is None  # per-call values
    ei[0, 0] = (ei[0, 0] + 1) % 8  # an in-place edit: stale
    assert CSRGraph.cached(ei, (8, 8), normalization="mean") is None
    pyg_maxk.clear_graph_cache()


def test_cache_entries_die_with_their_tensors():
    import gc
    live = random_edge_index(8, 8, 20, seed=0)
    dead = random_edge_index(8, 8, 20, seed=1)
    CSRGraph.from_adj(dead, (8, 8))
    del dead
    gc.collect()
    CSRGraph.from_adj(live, (8, 8))  # a put purges the entries of dead tensors
    # Two puts, far below the LRU's capacity: only the purge removes the first.
    assert len(_CACHE) == 1 < _CACHE.capacity
    hit = CSRGraph.from_adj(live, (8, 8))
    assert CSRGraph.from_adj(live, (8, 8)) is hit
    for _ in range(_CACHE.capacity + 3):  # live tensors: the LRU bounds the size
        keep = random_edge_index(8, 8, 20, seed=2)
        CSRGraph.from_adj(keep, (8, 8))
    assert len(_CACHE) <= _CACHE.capacity
    pyg_maxk.clear_graph_cache()
    assert len(_CACHE) == 0


def test_schedule_cuts_heavy_rows():
    ei = torch.stack([torch.arange(23) % 5, torch.tensor([0] * 20 + [2, 2, 4])])
    graph = CSRGraph.from_adj(ei, (5, 5))
    s = graph.schedule(max_edges=8)
    assert s.row.tolist() == [0, 0, 0, 1, 2, 3, 4]  # rows 1 and 3: no edges, one item
    assert s.start.tolist() == [0, 8, 16, 20, 20, 22, 22]
    assert s.end.tolist() == [8, 16, 20, 20, 22, 22, 23]
    assert s.split.tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert s.zeroed_rows.tolist() == [0]  # the split row
    assert not s.bounded
    assert graph.schedule(8) is s
    assert graph.schedule(8, bounded=True) is s  # an exact schedule serves both


@pytest.mark.parametrize("max_edges", [1, 3, 8, 40])
def test_bounded_schedule_has_sizes_known_from_the_shape(max_edges):
    # num_dst + E // max_edges items and min(num_dst, E // (max_edges + 1))
    # zeroed rows, whatever the degrees: the exact schedule's items first,
    # then padding items without edges (split > 0: they write nothing); the
    # exact zeroed rows first, then the scratch row num_dst.
    ei = torch.stack([torch.arange(23) % 5, torch.tensor([0] * 20 + [2, 2, 4])])
    exact = CSRGraph.from_adj(ei, (5, 6), cache=False).schedule(max_edges)
    s = CSRGraph.from_adj(ei, (5, 6), cache=False).schedule(max_edges, bounded=True)
    assert s.bounded
    assert s.num_items == 6 + 23 // max_edges
    real = exact.num_items
    for name in ("row", "start", "end", "split"):
        assert getattr(s, name)[:real].tolist() == getattr(exact, name).tolist()
    assert (s.start[real:] == s.end[real:]).all() and (s.split[real:] > 0).all()
    zeroed = exact.zeroed_rows.tolist()
    assert s.zeroed_rows.tolist() == zeroed + [6] * (min(6, 23 // (max_edges + 1)) - len(zeroed))


def test_transposed_graph_groups_edges_by_source_in_csr_order():
    # Multi-edges, sources without edges, and edge values follow their edges.
    ei = torch.cat([random_edge_index(30, 20, 150, seed=5), torch.tensor([[3, 3], [7, 7]])], 1)
    weight = torch.rand(ei.size(1)) + 0.1
    graph = CSRGraph.from_adj(ei, (30, 20), edge_weight=weight, normalization="sum",
                              cache=False)
    colptr, row, weight_t = graph.transposed()
    order = torch.sort(graph.col, stable=True).indices
    rows = torch.repeat_interleave(torch.arange(20), graph.in_degree().long())
    assert torch.equal(colptr.long(), torch.cat([torch.zeros(1, dtype=torch.long),
                                                 torch.bincount(graph.col.long(), minlength=30)
                                                 .cumsum(0)]))
    assert torch.equal(row.long(), rows[order]) and torch.equal(weight_t, graph.weight[order])
    bad = CSRGraph.from_csr(graph.rowptr, graph.col.clone().index_fill_(0, torch.tensor([9]), 30),
                            None, (30, 20))
    with pytest.raises(ValueError, match="source node 30, outside"):
        bad.transposed()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("order", ["shuffled", "sorted", "empty"])
def test_cpu_build_matches_the_sort_and_searches(order, dtype):
    # A CPU edge list is grouped by target in one counting-sort pass: the
    # CSR, the edge order and the mean's edge values of a stable torch.sort,
    # torch.searchsorted and torch's float division, bit for bit.
    ei = random_edge_index(11, 8, 0 if order == "empty" else 70, seed=6)
    ei = torch.cat([ei, ei[:, :5]], dim=1)  # multi-edges
    if order == "sorted":
        ei = ei[:, ei[1].argsort(stable=True)]
    weight = torch.rand(ei.size(1), dtype=dtype) + 0.5
    dst, perm = torch.sort(ei[1], stable=True)
    rowptr = torch.searchsorted(dst, torch.arange(9))
    deg = (rowptr[1:] - rowptr[:-1]).to(dtype)
    inverse = 1.0 / deg.clamp(min=1)
    per_edge = torch.repeat_interleave(inverse, (rowptr[1:] - rowptr[:-1]))
    for edge_weight in (None, weight):
        graph = CSRGraph.from_adj(ei, (11, 8), edge_weight=edge_weight, normalization="mean",
                                  dtype=dtype, cache=False)
        assert torch.equal(graph.rowptr, rowptr.int())
        assert torch.equal(graph.col, ei[0, perm].int())
        if order != "shuffled":  # already grouped: no order to keep
            assert graph.edge_order is None
        else:
            assert torch.equal(graph.edge_order, perm)
        expected = per_edge if edge_weight is None else weight[perm] * per_edge
        assert graph.weight.dtype == dtype and torch.equal(graph.weight, expected)
        if edge_weight is None:
            assert torch.equal(graph.row_scale, inverse)
        # Grouped by source as the CSR's own transpose groups it.
        reference = CSRGraph.from_csr(graph.rowptr.clone(), graph.col.clone(),
                                      graph.weight.clone(), (11, 8), dtype=dtype)
        for got, want in zip(graph.transposed(), reference.transposed()):
            assert torch.equal(got, want)
        assert torch.equal(graph._transpose_order, reference._transpose_order)


@pytest.mark.parametrize("normalization", ["sum", "mean", "gcn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_cpu_graph_writes_its_arrays_into_operands_all_ks_share(normalization, weighted,
                                                                    monkeypatch):
    # A CPU edge list's build writes the graph's arrays in place into the
    # packed buffer that the ops read (no copy), and every k shares it (the
    # CPU kernels read no work schedule, unless the simulator runs the CUDA
    # kernels, as in this suite without a GPU); it equals packing the arrays.
    from pyg_maxk.graph import csr
    monkeypatch.setattr(csr, "_simulated_kernels", lambda: False)
    sizes = (12, 12) if normalization == "gcn" else (12, 9)
    ei = random_edge_index(*sizes, 60, seed=8)
    weight = torch.rand(ei.size(1)) + 0.5 if weighted else None
    graph = CSRGraph.from_adj(ei, sizes, edge_weight=weight, normalization=normalization,
                              cache=False)
    packed = graph.operands(4)
    assert graph.operands(64) is packed and graph.has_operands(64)
    views = unpack(*packed)
    start = packed.index.data_ptr()
    end = start + packed.index.numel()
    for name in ("rowptr", "col", "weight", "row_scale"):
        mine = getattr(graph, name)
        assert (mine is None) == (getattr(views, name) is None), name
        if mine is not None:  # the buffer's memory
            assert start <= mine.data_ptr() and mine.data_ptr() + mine.nbytes <= end, name
    reference, _ = pack(GraphOperands(graph.rowptr.clone(), graph.col.clone(),
                                      _clone(graph.weight), _clone(graph.row_scale),
                                      *[None] * 5, *map(_clone, graph.transposed())))
    assert packed.layout == reference.layout
    for got, want in zip(views, unpack(*reference)):
        assert (got is None and want is None) or torch.equal(got, want)


def _clone(t):
    return None if t is None else t.clone()


@pytest.mark.parametrize("edges", ["unsorted", "sorted", "none", "all into 0"])
def test_a_cpu_build_appends_gin_root_loops_as_appending_them_to_the_edge_index(edges):
    # The CPU build's kernel appends one loop i -> i per node itself; the
    # graph (CSR, transposed graph, each edge's position in the list) equals
    # the one built from the edge_index with the loops appended to it.
    n = 9
    ei = random_edge_index(n, n, 40, seed=3)
    if edges == "sorted":
        ei = ei[:, ei[1].argsort(stable=True)]
    elif edges == "none":
        ei = ei[:, :0]
    elif edges == "all into 0":
        ei[1] = 0
    with_loops = torch.cat([ei, torch.arange(n).expand(2, n)], dim=1)
    graph = CSRGraph.from_adj(ei, (n, n), root_loops=True, cache=False)
    want = CSRGraph.from_adj(with_loops, (n, n), cache=False)
    assert graph.root_loops and graph.num_edges == ei.size(1) + n
    for got, expected in [(graph.rowptr, want.rowptr), (graph.col, want.col),
                          *zip(graph.transposed(), want.transposed())]:
        assert (got is None and expected is None) or torch.equal(got, expected)
    order = torch.arange(graph.num_edges) if graph.edge_order is None else graph.edge_order
    expected_order = (torch.arange(want.num_edges) if want.edge_order is None
                      else want.edge_order)
    assert torch.equal(order, expected_order)
    with pytest.raises(IndexError, match="source node 9"):
        bad = ei.clone() if ei.numel() else torch.tensor([[0], [0]])
        bad[0, -1] = n
        CSRGraph.from_adj(bad, (n, n), root_loops=True, cache=False)


def test_cpu_build_names_the_first_node_out_of_range():
    with pytest.raises(IndexError, match="source node 7, outside \\[0, 3\\)"):
        CSRGraph.from_adj(torch.tensor([[0, 7, 9], [1, 1, 1]]), (3, 3), cache=False)
    with pytest.raises(IndexError, match="target node -1, outside \\[0, 2\\)"):
        CSRGraph.from_adj(torch.tensor([[0, 1], [1, -1]]), (3, 2), cache=False)


def test_errors():
    with pytest.raises(ValueError, match="integer"):
        CSRGraph.from_adj(torch.zeros(2, 3), (3, 3))
    with pytest.raises(ValueError, match="shape"):
        CSRGraph.from_adj(torch.zeros(3, 3, dtype=torch.long), (3, 3))
    with pytest.raises(ValueError, match="size"):
        CSRGraph.from_adj(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(IndexError):
        CSRGraph.from_adj(torch.tensor([[0, 5], [1, 1]]), (3, 3))
    with pytest.raises(TypeError):
        CSRGraph.from_adj([[0, 1], [1, 0]], (2, 2))
    with pytest.raises(ValueError, match="normalization"):
        CSRGraph.from_adj(torch.zeros(2, 1, dtype=torch.long), (1, 1), normalization="max")
    with pytest.raises(ValueError, match="edge_weight is on meta"):
        CSRGraph.from_adj(torch.zeros(2, 1, dtype=torch.long), (1, 1),
                          edge_weight=torch.ones(1, device="meta"))


def test_million_edge_graph_and_its_schedule():
    """A 1M-edge graph with hub rows: the CSR holds every edge once, under
    its target, and the schedule's items cover each row's edges exactly once
    in pieces of at most ``max_edges``, splitting the rows it lists as
    zeroed. (Its build time is a benchmark: ``benchmarks/kernels.py``.)"""
    g = torch.Generator().manual_seed(0)
    n = 100_000
    ei = torch.randint(0, n, (2, 1_000_000), generator=g)
    ei[1, :5_000] = 7  # a hub row of more than max_edges edges
    graph = CSRGraph.from_adj(ei, (n, n), normalization="mean", cache=False)
    assert graph.num_edges == 1_000_000
    deg = torch.bincount(ei[1], minlength=n)
    assert torch.equal(graph.in_degree().long(), deg)
    row_of_edge = torch.repeat_interleave(torch.arange(n), deg)

    def edges(dst, src):
        return (dst * n + src).sort().values

    assert torch.equal(edges(row_of_edge, graph.col.long()), edges(ei[1], ei[0]))
    schedule = graph.schedule(512)
    start, end, row = schedule.start.long(), schedule.end.long(), schedule.row.long()
    assert bool((end >= start).all()) and int((end - start).max()) <= 512
    assert torch.equal((end == start).nonzero().view(-1), (deg[row] == 0).nonzero().view(-1))
    assert torch.equal(torch.bincount(row, weights=(end - start).double(), minlength=n).long(),
                       deg)
    covered = torch.zeros(graph.num_edges, dtype=torch.long)
    for lo, hi in ((int(a), int(b)) for a, b in zip(start[row == 7], end[row == 7])):
        covered[lo:hi] += 1
    hub = slice(int(graph.rowptr[7]), int(graph.rowptr[8]))
    assert bool((covered[hub] == 1).all())
    split_rows = torch.unique(row[schedule.split > 0])
    assert 7 in split_rows.tolist()
    assert set(split_rows.tolist()) <= set(schedule.zeroed_rows.tolist())


def test_a_graph_the_cache_serves_often_gets_the_exact_schedule():
    # A new graph per mini-batch keeps the bounded schedule it was built
    # with (no sync); one that the cache keeps serving (a fixed graph) is
    # settled with the exact one.
    from pyg_maxk.graph import SETTLE_AFTER_HITS, max_edges_per_item
    ei = random_edge_index(8, 8, 20, seed=3)
    graph = CSRGraph.from_adj(ei, (8, 8))
    graph._build_operands(max_edges_per_item(4), bounded=True)
    assert not graph.is_prepared(4)
    for _ in range(SETTLE_AFTER_HITS - 1):
        assert CSRGraph.from_adj(ei, (8, 8)) is graph
    assert not graph.is_prepared(4)
    assert CSRGraph.from_adj(ei, (8, 8)) is graph
    assert graph.is_prepared(4)
    assert not graph.schedule(max_edges_per_item(4)).bounded


@pytest.mark.parametrize("every_field", [True, False])
def test_packed_operands_come_back_from_the_bytes_and_six_integers(every_field):
    # What a compiled call unpacks: a buffer that is not a live graph's own
    # (no views to find), read through its layout alone.
    from pyg_maxk.graph import (
        GRAPH_FIELDS,
        GraphOperands,
        layout_dtype,
        layout_numel,
        pack,
        unpack,
        without_weights,
    )
    gen = torch.Generator().manual_seed(0)

    def ints(n, dtype=torch.int32):
        return torch.randint(0, 50, (n,), dtype=dtype, generator=gen)

    num_dst, num_src, num_edges, num_items, num_zeroed = 5, 7, 11, 3, 2
    schedule = [ints(num_items) for _ in range(4)] + [ints(num_zeroed, torch.int64)]
    g = GraphOperands(ints(num_dst + 1, torch.int64), ints(num_edges),
                      torch.rand(num_edges, dtype=torch.float64, generator=gen),
                      torch.rand(num_dst, generator=gen).bfloat16(), *schedule,
                      ints(num_src + 1), ints(num_edges), torch.rand(num_edges, generator=gen))
    if not every_field:  # absent fields between present ones shift no offset
        g = g._replace(weight=None, item_row=None, item_start=None, item_end=None,
                       item_split=None, zeroed_rows=None, colptr=None)
    packed, views = pack(g)
    assert len(packed.layout) == 6
    copy = packed.index.clone()
    for got in (views, unpack(copy, None, None, packed.layout)):
        for name, want, have in zip(GRAPH_FIELDS, g, got):
            if want is None:
                assert have is None, name
            else:
                assert have.dtype == want.dtype and torch.equal(have, want), name
    assert layout_dtype(packed.layout, "row_scale") == torch.bfloat16
    assert layout_numel(packed.layout, "col") == num_edges
    assert layout_numel(packed.layout, "colptr") == (num_src + 1 if every_field else -1)
    light = unpack(copy, None, None, without_weights(packed.layout))
    assert light.weight is None and light.row_scale is None and light.weight_t is None
    assert torch.equal(light.row_t, g.row_t) and torch.equal(light.col, g.col)


def test_packing_keeps_edge_values_that_need_a_gradient_apart():
    from pyg_maxk.graph import GraphOperands, pack, unpack
    weight = torch.rand(4, requires_grad=True)
    g = GraphOperands(torch.tensor([0, 1, 4], dtype=torch.int32),
                      torch.tensor([0, 1, 2, 0], dtype=torch.int32), weight, *[None] * 9)
    packed, _ = pack(g)
    assert packed.weight is weight
    got = unpack(packed.index.clone(), packed.weight, None, packed.layout)
    assert got.weight is weight and torch.equal(got.col, g.col)


@pytest.mark.parametrize("normalization", ["sum", "mean", "gcn"])
def test_a_prepared_graph_survives_torch_save_and_deepcopy(normalization, tmp_path):
    # Its arrays are views of one packed byte buffer, which torch.save
    # cannot store beside them; a Data holding it (ToCSRGraph as a dataset's
    # pre_transform, which PyG saves) must still save and load.
    import copy

    from torch_geometric.data import Data
    ei = random_edge_index(40, 40, 200, seed=5)
    data = pyg_maxk.ToCSRGraph(normalization, k=4)(Data(edge_index=ei, num_nodes=40))
    graph = data.adj_t
    x = torch.randn(40, 16)
    h = pyg_maxk.maxk(x, 4)
    expected = pyg_maxk.aggregate(graph, h)
    torch.save(data, tmp_path / "data.pt")
    loaded = torch.load(tmp_path / "data.pt", weights_only=False).adj_t
    for other in (loaded, copy.deepcopy(graph)):
        assert other is not graph and other.is_prepared(4)
        assert other.size == graph.size and other.normalization == graph.normalization
        assert torch.equal(pyg_maxk.aggregate(other, h), expected)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("improved", [False, True])
@pytest.mark.parametrize("self_loops", [False, True])
def test_gcn_norm_of_an_edge_list_is_pygs(weighted, improved, self_loops):
    # The same adjacency as PyG's gcn_norm on a CPU (which drops existing
    # self-loops before it adds one per node; a node with two loops keeps
    # the last one's weight), with existing loops kept at weight 0 instead of
    # removed, on every device.
    from torch_geometric.nn.conv.gcn_conv import gcn_norm
    from torch_geometric.utils import to_dense_adj

    from pyg_maxk.graph.csr import gcn_norm_of_edge_list
    n = 40
    ei = random_edge_index(n, n, 300, seed=11)
    ei[:, :4] = torch.tensor([[1, 5, 9, 9], [1, 5, 9, 9]])
    weight = torch.rand(ei.size(1), generator=torch.Generator().manual_seed(3)) + 0.5 \
        if weighted else None
    expected = gcn_norm(ei, weight, n, improved, self_loops, "source_to_target",
                        torch.float32)
    on_device = (ei.to(DEVICE), None if weight is None else weight.to(DEVICE))
    actual = gcn_norm_of_edge_list(*on_device, n, improved, self_loops, torch.float32)
    actual = tuple(t.cpu() for t in actual)
    dense = [to_dense_adj(e, edge_attr=w, max_num_nodes=n) for e, w in (expected, actual)]
    torch.testing.assert_close(dense[1], dense[0], rtol=1e-6, atol=0)


# ------------------------------------------------------ edge-list graphs
def _edge_list_case(normalization, weighted, seed=0):
    from pyg_maxk.graph import EdgeListGraph
    ei = random_edge_index(12, 12, 60, seed=seed)
    ei = ei[:, torch.randperm(60, generator=torch.Generator().manual_seed(seed))].to(DEVICE)
    w = torch.rand(60).to(DEVICE) + 0.1 if weighted else None
    return (EdgeListGraph.from_edge_index(ei, (12, 12), edge_weight=w,
                                          normalization=normalization),
            CSRGraph.from_adj(ei, (12, 12), edge_weight=w, normalization=normalization,
                              cache=False))


@pytest.mark.parametrize("backend", ["torch", "numba" if ON_GPU else "cpu"])
@pytest.mark.parametrize("normalization,weighted", [("mean", False), ("mean", True),
                                                    ("sum", True), ("gcn", False)])
def test_an_edge_list_aggregates_as_its_csr_graph(backend, normalization, weighted):
    # Every backend takes an edge list (the torch and cpu backends in
    # torch's index ops), forward, backward and the fused features' gradient.
    from helpers import check_kernels
    graph, csr = _edge_list_case(normalization, weighted)
    check_kernels(graph, dim=16, k=4, reference=csr, backend=backend)
    x = torch.randn(12, 16, dtype=torch.float32, device=DEVICE)
    results = []
    for g in (graph, csr):
        xg = x.clone().requires_grad_()
        with pyg_maxk.use_backend(backend):
            agg, h, dense = pyg_maxk.ops.maxk_aggregate(xg, 4, g, with_dense=True)
            ((agg * agg).sum() + h.values.sum() + dense.sum()).backward()
        results.append((agg, xg.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    dense = torch.randn(12, 5, device=DEVICE)  # every column kept: the CSR graph's product
    with pyg_maxk.use_backend(backend):
        torch.testing.assert_close(pyg_maxk.aggregate(graph, dense),
                                   pyg_maxk.aggregate(csr, dense))


def test_a_layer_takes_a_new_edge_index_as_its_edge_list_until_it_comes_back(monkeypatch):
    # A GPU edge_index seen for the first time is aggregated as its edge
    # list; one that keeps coming back (a fixed graph) gets its CSR graph
    # after CSR_AFTER_HITS hits; a new or edited edge_index starts over.
    from helpers import dense_maxk, make_pair
    from pyg_maxk.graph import CSR_AFTER_HITS, EdgeListGraph, edge_list
    monkeypatch.setattr(edge_list, "takes_edge_list", lambda *args: True)
    pyg_maxk.clear_graph_cache()
    ours, stock = make_pair("sage")
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(12, 24)
    ei = random_edge_index(12, 12, 50, seed=2)

    def kind_and_check(edge_index):
        graph = ours.graph_for(edge_index, x, x)
        with pyg_maxk.use_backend("torch"):
            torch.testing.assert_close(ours(x, edge_index),
                                       stock(dense_maxk(x, ours.k), edge_index))
        return type(graph)

    kinds = [kind_and_check(ei) for _ in range(CSR_AFTER_HITS + 1)]
    assert set(kinds[:CSR_AFTER_HITS // 2]) == {EdgeListGraph}
    assert kinds[-1] is CSRGraph
    assert kind_and_check(ei.clone()) is EdgeListGraph
    ei[0, 0] = (ei[0, 0] + 1) % 12  # edited in place: a new graph
    assert kind_and_check(ei) is EdgeListGraph
    pyg_maxk.clear_graph_cache()
