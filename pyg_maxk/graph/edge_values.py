"""Edge values recomputed on every call (learnable edge weights, PyG's
explain masks), differentiably, on a cached structure."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from .adjacency import (
    as_sparse_csr,
    check_edge_index,
    is_sparse_tensor,
    is_torch_sparse,
    plain,
    sparse_size,
)
from .cache import _SPARSE_STRUCTURES, _STRUCTURES, fingerprint
from .csr import CSRGraph, gcn_norm_of_edge_list


def edge_structure(edge_index: Tensor, size: Tuple[int, int], gcn_self_loops: bool,
                   dtype: torch.dtype = torch.float32) -> CSRGraph:
    """The unweighted CSR structure of an ``edge_index`` (with one self-loop
    per node after the edges when ``gcn_self_loops``, as
    :func:`~pyg_maxk.graph.csr.gcn_norm_of_edge_list` returns them: existing
    loops stay), cached like :meth:`CSRGraph.from_adj`'s graphs: edge values
    computed per call go on it with :meth:`CSRGraph.with_weight`, in the
    order of :attr:`CSRGraph.edge_order` (positions in that edge list)."""
    check_edge_index(edge_index)
    anchors, versions = fingerprint(edge_index, None)
    params = ("structure", bool(gcn_self_loops), dtype, tuple(size))
    hit = _STRUCTURES.get(anchors, versions, params)
    if hit is not None:
        return hit
    edges = plain(edge_index)
    if gcn_self_loops:  # no boolean mask: no host sync on a new graph
        nodes = torch.arange(size[0], dtype=edges.dtype, device=edges.device)
        edges = torch.cat([edges, nodes.expand(2, -1)], dim=1)
    graph = CSRGraph.from_edge_index(edges, None, size, "sum", dtype)
    if graph.edge_order is None:
        graph.edge_order = torch.arange(graph.num_edges, device=graph.device)
    _STRUCTURES.put(anchors, versions, params, graph)
    return graph


def graph_with_edge_values(adj: Any, size: Optional[Tuple[Optional[int], Optional[int]]],
                           edge_weight: Optional[Tensor], edge_mask: Optional[Tensor],
                           normalization: str, gcn_improved: bool = False,
                           gcn_add_self_loops: bool = True,
                           dtype: torch.dtype = torch.float32,
                           k: Optional[int] = None,
                           loop_mask: Optional[Tensor] = None) -> CSRGraph:
    """The graph of an adjacency whose edge values are recomputed on every
    call, differentiably, from ``edge_weight`` and ``edge_mask`` (either may
    need a gradient): PyG's semantics, in the order of the edge list (of an
    ``edge_index``) or of the stored entries (of a sparse ``adj_t``, whose
    learnable values play ``edge_weight``'s part).

    * ``"gcn"``: ``gcn_norm(edge_index, edge_weight)``'s values (self-loops
      added after the edges; existing loops kept at weight 0, as
      :func:`~pyg_maxk.graph.csr.gcn_norm_of_edge_list` gives them), each
      times the mask. A mask of one entry per input edge covers the edges;
      the loops added get 1 (what PyG's ``explain_message`` does).
    * ``"sum"``: ``edge_weight`` (or ones) times the mask.
    * ``"mean"``: the mask over the in-degree (PyG's mean counts every
      message, masked or not).
    * With a mask, SAGE and GIN ignore a sparse ``adj_t``'s values (PyG's
      explained ``propagate`` sends plain messages); GCN's normalised sparse
      matrix has its self-loops in place, and the mask is extended as PyG
      extends it: its entries at ``loop_mask`` (PyG's explainers set it),
      then ones.

    The structure and its work schedules (built for ``k`` when given) come
    from :func:`edge_structure` (cached); only the ``[E]`` values are new per
    call.
    """
    if is_sparse_tensor(adj) or is_torch_sparse(adj):
        return _sparse_graph_with_values(adj, normalization, gcn_improved,
                                         gcn_add_self_loops, dtype, k, edge_mask, loop_mask)
    if size is None or size[0] is None or size[1] is None:
        raise ValueError("Building a CSRGraph from an edge_index needs size=(num_src, num_dst)")
    sizes = (int(size[0]), int(size[1]))
    edge_index = plain(adj)
    check_edge_index(edge_index)
    gcn = normalization == "gcn"
    if gcn and sizes[0] != sizes[1]:
        raise ValueError(f"gcn normalisation needs a square adjacency, got size={sizes}")
    structure = edge_structure(edge_index, sizes, gcn and gcn_add_self_loops, dtype)
    if k is not None:
        structure.operands_without_sync(k)
    num_edges = edge_index.size(1)
    if gcn:
        _, values = gcn_norm_of_edge_list(edge_index, edge_weight, sizes[0], gcn_improved,
                                          gcn_add_self_loops, dtype)
    elif edge_weight is not None and normalization == "sum":
        values = edge_weight.to(dtype)
    else:
        values = torch.ones(num_edges, dtype=dtype, device=edge_index.device)
    if edge_mask is not None:
        if edge_mask.numel() != num_edges:
            raise ValueError(f"The edge mask has {edge_mask.numel()} entries for "
                             f"{num_edges} edges")
        if values.numel() != num_edges:
            # The loops added per node: 1 (the existing ones weigh 0 there).
            edge_mask = torch.cat([edge_mask, edge_mask.new_ones(values.numel() - num_edges)])
        values = values * edge_mask.to(dtype)
    # index_select, not indexing: its backward is an index_add (a
    # permutation: one add per entry), where indexing's sorts on CUDA.
    values = values.index_select(0, structure.edge_order)
    if normalization == "mean":
        values = values * _inverse_degree_per_edge(structure).to(values.dtype)
    return structure.with_weight(values.contiguous(), normalization)


def _sparse_graph_with_values(adj: Any, normalization: str, gcn_improved: bool,
                              gcn_add_self_loops: bool, dtype: torch.dtype, k: Optional[int],
                              edge_mask: Optional[Tensor],
                              loop_mask: Optional[Tensor]) -> CSRGraph:
    """:func:`graph_with_edge_values` of a sparse ``adj_t``: PyG's
    ``gcn_norm`` of it (differentiable in the values), times the mask, on
    the cached structure."""
    if normalization == "mean" and edge_mask is None:
        raise NotImplementedError("pyg_maxk's mean aggregation ignores the sparse values")
    sizes = sparse_size(adj)
    if normalization == "gcn":
        from torch_geometric.nn.conv.gcn_conv import gcn_norm
        adj = gcn_norm(adj, None, sizes[0], gcn_improved, gcn_add_self_loops,
                       "source_to_target", dtype)
        adj = adj[0] if isinstance(adj, tuple) else adj
    if is_sparse_tensor(adj):
        rowptr, col, values = adj.csr()
    else:
        csr = as_sparse_csr(adj)
        rowptr, col, values = csr.crow_indices(), csr.col_indices(), csr.values()
    # The normalised tensor is new on every call: its structure is looked up
    # by shape and checked equal (one pass over the indices), never assumed.
    key = (sizes, col.numel(), col.device, rowptr.dtype, col.dtype)
    structure = _SPARSE_STRUCTURES.get(key)
    if structure is None or not (torch.equal(structure.rowptr, rowptr)
                                 and torch.equal(structure.col, col)):
        structure = CSRGraph.from_csr(rowptr, col, None, sizes, "sum", dtype)
        _SPARSE_STRUCTURES[key] = structure
        while len(_SPARSE_STRUCTURES) > _STRUCTURES.capacity:
            _SPARSE_STRUCTURES.pop(next(iter(_SPARSE_STRUCTURES)))
    if k is not None:
        structure.operands_without_sync(k)
    if edge_mask is not None:
        if normalization != "gcn":  # plain messages: the stored values do not count
            values = torch.ones(col.numel(), dtype=dtype, device=col.device)
        if edge_mask.numel() != values.numel() and loop_mask is not None:
            edge_mask = edge_mask[loop_mask]
            edge_mask = torch.cat([edge_mask, edge_mask.new_ones(values.numel()
                                                                 - edge_mask.numel())])
        if edge_mask.numel() != values.numel():
            raise ValueError(f"The edge mask has {edge_mask.numel()} entries for "
                             f"{values.numel()} edges")
        values = values.to(dtype) * edge_mask.to(dtype)
        if normalization == "mean":
            values = values * _inverse_degree_per_edge(structure).to(dtype)
    return structure.with_weight(values.to(dtype).contiguous(), normalization)


def _inverse_degree_per_edge(graph: CSRGraph) -> Tensor:
    """``1 / in-degree`` of every edge's target (cached on the structure)."""
    cached = getattr(graph, "_inverse_degree", None)
    if cached is None:
        deg = graph.in_degree()
        inv = 1.0 / deg.to(torch.float64).clamp(min=1)
        cached = torch.repeat_interleave(inv, deg.long(), output_size=graph.num_edges)
        graph._inverse_degree = cached
    return cached
