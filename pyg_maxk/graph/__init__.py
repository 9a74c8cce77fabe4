"""The CSR graph that every MaxK aggregation runs on, with its cached kernel
work schedule.

Rows are target nodes, columns source nodes, so that row ``i`` lists the
neighbours whose messages node ``i`` aggregates:

.. math::
    \\mathbf{out}_i = \\sum_{e = (j \\rightarrow i)} a_e \\, \\mathbf{x}_j

The edge values ``a_e`` carry the layer's normalisation (``"sum"``: the
adjacency's own values or 1, ``"mean"``: divided by the in-degree, ``"gcn"``:
the symmetric normalisation of :func:`torch_geometric.nn.conv.gcn_conv.gcn_norm`).

A graph is built from any adjacency form that PyG's stock convs accept and is
cached, so that every layer, the backward pass and later epochs reuse it. The
cache never returns a stale graph: it is keyed on the identity *and* the
in-place version counter of every tensor the graph was built from.
"""
from .adjacency import (
    NORMALIZATIONS,
    check_normalization,
    is_edge_index_type,
    is_sparse_tensor,
    is_torch_sparse,
)
from .cache import SETTLE_AFTER_HITS, clear_graph_cache
from .csr import BOUNDED_MAX_EDGES, INT32_MAX, CSRGraph
from .edge_list import CSR_AFTER_HITS, EDGE_LIST_MAX_EDGES, EdgeListGraph, edge_list_graph
from .edge_values import edge_structure, graph_with_edge_values
from .operands import (
    GRAPH_FIELDS,
    LAYOUT_SIZES,
    PACK_ALIGN,
    GraphOperands,
    PackedGraph,
    layout_dtype,
    layout_numel,
    pack,
    unpack,
    without_weights,
)
from .schedule import PAIRS_PER_ITEM, WorkSchedule, max_edges_per_item

__all__ = [
    "CSRGraph", "EdgeListGraph", "GraphOperands", "PackedGraph", "WorkSchedule",
    "BOUNDED_MAX_EDGES", "CSR_AFTER_HITS", "EDGE_LIST_MAX_EDGES", "edge_list_graph",
    "GRAPH_FIELDS", "INT32_MAX", "LAYOUT_SIZES", "NORMALIZATIONS", "PACK_ALIGN",
    "PAIRS_PER_ITEM", "SETTLE_AFTER_HITS", "check_normalization", "clear_graph_cache",
    "edge_structure", "graph_with_edge_values", "is_edge_index_type", "is_sparse_tensor",
    "is_torch_sparse", "layout_dtype", "layout_numel", "max_edges_per_item", "pack", "unpack",
    "without_weights",
]
