"""A graph aggregated as its edge list (:class:`EdgeListGraph`): what a layer
uses (unless :data:`LAYERS_TAKE_EDGE_LISTS` is False) for a GPU
``edge_index`` it has not seen before, such as a new mini-batch's, instead
of sorting it into a :class:`CSRGraph`.

A CSR graph's build (a sort by target, the row pointers, the work schedule,
the packing) takes tens of launches, which a fixed graph pays once and a new
graph per batch on every step: on a small graph that costs more host time
than the step's aggregations. An edge list needs only a range check (and a
mean's in-degrees), and its kernels add each edge's messages with atomics
(:mod:`pyg_maxk.kernels.edge_list`). An ``edge_index`` that keeps coming
back is a fixed graph: after :data:`CSR_AFTER_HITS` cache hits its CSR graph
is built and cached (and serves from then on), whose kernels need no
atomics and balance the rows.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ..dispatch import choose_on
from .adjacency import (
    check_edge_index,
    check_normalization,
    is_sparse_tensor,
    is_torch_sparse,
    plain,
)
from .cache import _EDGE_LISTS, fingerprint, graph_params
from .operands import GraphOperands, PackedGraph, pack
from .schedule import numba_builds

#: Edges up to which a new GPU ``edge_index`` is aggregated as its edge list
#: (beyond, its atomics cost more device time than the CSR build saves).
EDGE_LIST_MAX_EDGES = 1 << 20
#: Whether layers take a new GPU ``edge_index`` as its edge list at all. Set
#: it False to have them build the CSR of every graph (as
#: :meth:`CSRGraph.from_adj` does), whose forward sums run in a fixed order
#: except on split rows: an edge list's atomics add in any order, as PyG's
#: scatter does on a GPU. Under :func:`torch.use_deterministic_algorithms`
#: the aggregation is torch's (:mod:`pyg_maxk.dispatch`), never an edge list.
LAYERS_TAKE_EDGE_LISTS = True
#: Cache hits after which an ``edge_index`` is taken for a fixed graph and
#: built as a :class:`CSRGraph`. A model resolves its graph once per forward
#: (a hit per step), a stack of convs once per conv: a new graph per batch
#: sees fewer hits than its model has layers.
CSR_AFTER_HITS = 8


class EdgeListGraph:
    r"""An adjacency ``[num_dst, num_src]`` as its edge list, in the list's
    order: ``out_i = sum over edges e = (j -> i) of a_e h_j``.

    Args:
        src, dst (torch.Tensor): each edge's source and target, ``[E]``.
        weight (torch.Tensor, optional): float32 edge values ``a_e`` with the
            normalisation applied, ``[E]``; None means all ones.
        size (tuple): ``(num_src, num_dst)``.
        normalization (str): what :obj:`weight` holds, as
            :class:`CSRGraph`'s.
        row_scale (torch.Tensor, optional): ``[num_dst]``, set when every
            edge value of a target equals its entry (a mean without edge
            values), as :class:`CSRGraph`'s.
        edge_index (torch.Tensor): the ``edge_index`` this is the graph of
            (with ``csr_options``, what :meth:`csr` builds from).

    Layers build one through :func:`edge_list_graph`; it serves the
    aggregation ops as a :class:`CSRGraph` does (:meth:`operands`, the same
    for every ``k``), and :meth:`csr` gives the CSR graph for the rest.
    """

    def __init__(self, src: Tensor, dst: Tensor, weight: Optional[Tensor],
                 size: Tuple[int, int], normalization: str, row_scale: Optional[Tensor],
                 edge_index: Tensor, csr_options: dict) -> None:
        self.num_src, self.num_dst = int(size[0]), int(size[1])
        self.normalization = normalization
        self.gcn_options: Optional[Tuple[bool, bool]] = None
        self.root_loops = False  # never built with GIN's root loops (edge_list_graph)
        self._edge_index, self._csr_options = edge_index, csr_options
        self._csr = None
        self._cache_hits = 0
        self._num_edges = src.numel()
        self._packed, views = pack(GraphOperands(
            None, src, weight, row_scale, None, None, None, None, None, None, None, None, dst))
        self.weight, self.row_scale = views.weight, views.row_scale

    @classmethod
    def from_edge_index(cls, edge_index: Tensor, size: Tuple[int, int], *,
                        edge_weight: Optional[Tensor] = None, normalization: str = "sum",
                        gcn_improved: bool = False, gcn_add_self_loops: bool = True
                        ) -> "EdgeListGraph":
        """The graph of ``edge_index`` ``[2, E]`` (any order) with
        :meth:`CSRGraph.from_adj`'s options, its values in float32. The
        range check runs on the device, without a host sync: an index out
        of range is a device-side assert, as in PyG's own index ops."""
        check_edge_index(edge_index)
        check_normalization(normalization)
        num_src, num_dst = int(size[0]), int(size[1])
        value = edge_weight
        edges = plain(edge_index)
        if normalization == "gcn":
            from .csr import gcn_norm_of_edge_list
            if num_src != num_dst:
                raise ValueError(f"gcn normalisation needs a square adjacency, got size={size}")
            edges, value = gcn_norm_of_edge_list(edges, edge_weight, num_src, gcn_improved,
                                                 gcn_add_self_loops, torch.float32)
        edges = edges.contiguous()
        src, dst = edges[0], edges[1]
        values = _numba_values if numba_builds(dst) else _torch_values
        weight, row_scale, ok = values(src, dst, value, num_src, num_dst,
                                       normalization == "mean")
        torch._assert_async(ok, "edge_index holds a node index outside [0, num_nodes)")
        options = dict(edge_weight=edge_weight, normalization=normalization,
                       gcn_improved=gcn_improved, gcn_add_self_loops=gcn_add_self_loops)
        graph = cls(src, dst, weight, (num_src, num_dst), normalization, row_scale,
                    edge_index, options)
        if normalization == "gcn":
            graph.gcn_options = (bool(gcn_improved), bool(gcn_add_self_loops))
        return graph

    @property
    def size(self) -> Tuple[int, int]:
        return (self.num_src, self.num_dst)

    @property
    def num_edges(self) -> int:
        return self._num_edges

    @property
    def device(self) -> torch.device:
        return self._packed.index.device

    def operands(self, k: int) -> PackedGraph:
        """The packed operands of the aggregation ops (any ``k``)."""
        return self._packed

    operands_without_sync = operands

    def has_operands(self, k: int) -> bool:
        return True

    def is_prepared(self, k: int) -> bool:
        return False

    def settle(self) -> None:
        """Nothing to settle (the graph cache's hook for CSR graphs)."""

    def csr(self) -> "CSRGraph":  # noqa: F821 (csr.py imports this module)
        """The :class:`CSRGraph` of the same ``edge_index`` and options
        (cached there; what a dense aggregation reads)."""
        if self._csr is None:
            from .csr import CSRGraph
            self._csr = CSRGraph.from_adj(self._edge_index, self.size, **self._csr_options)
        return self._csr

    def __repr__(self) -> str:
        return (f"EdgeListGraph(num_src={self.num_src}, num_dst={self.num_dst}, "
                f"num_edges={self.num_edges}, normalization='{self.normalization}', "
                f"weighted={self.weight is not None}, device={self.device})")


def takes_edge_list(adj: Any, edge_weight: Optional[Tensor], dtype: torch.dtype) -> bool:
    """Whether :func:`edge_list_graph` serves ``adj`` (never where
    :data:`LAYERS_TAKE_EDGE_LISTS` is False): a GPU ``edge_index``
    (not a sparse adjacency) of at most :data:`EDGE_LIST_MAX_EDGES` edges,
    float32 edge values, no edge weights that need a gradient, and the Numba
    kernels to aggregate it."""
    if not LAYERS_TAKE_EDGE_LISTS:
        return False
    if not isinstance(adj, Tensor) or is_sparse_tensor(adj) or is_torch_sparse(adj):
        return False
    if not adj.is_cuda or dtype != torch.float32 or adj.dim() != 2:
        return False
    if adj.size(1) > EDGE_LIST_MAX_EDGES:
        return False
    if edge_weight is not None and edge_weight.requires_grad and torch.is_grad_enabled():
        return False
    return choose_on("aggregate", "cuda", dtype, dim=32, k=8) == "numba"


def edge_list_graph(adj: Any, size: Tuple[int, int], *, edge_weight: Optional[Tensor] = None,
                    normalization: str = "sum", use_sparse_tensor_values: bool = True,
                    gcn_improved: bool = False, gcn_add_self_loops: bool = True,
                    dtype: torch.dtype = torch.float32,
                    root_loops: bool = False) -> Optional[EdgeListGraph]:
    """The :class:`EdgeListGraph` of a GPU ``edge_index`` (with
    :meth:`CSRGraph.from_adj`'s options) whose CSR graph is not cached (the
    caller has looked it up: :meth:`CSRGraph.cached`), cached as graphs
    are; None where its :class:`CSRGraph` serves instead: where
    :func:`takes_edge_list` does not hold, and for an ``edge_index`` seen
    :data:`CSR_AFTER_HITS` times (a fixed graph). With GIN's ``root_loops``
    the edge list holds no loops (its conv adds the root term itself): only
    a fixed graph's CSR is worth building with them."""
    if not takes_edge_list(adj, edge_weight, dtype):
        return None
    return taken_edge_list(adj, size, edge_weight=edge_weight, normalization=normalization,
                           use_sparse_tensor_values=use_sparse_tensor_values,
                           gcn_improved=gcn_improved, gcn_add_self_loops=gcn_add_self_loops,
                           dtype=dtype)


def taken_edge_list(adj: Tensor, size: Tuple[int, int], *, edge_weight: Optional[Tensor] = None,
                    normalization: str = "sum", use_sparse_tensor_values: bool = True,
                    gcn_improved: bool = False, gcn_add_self_loops: bool = True,
                    dtype: torch.dtype = torch.float32,
                    root_loops: bool = False) -> Optional[EdgeListGraph]:
    """:func:`edge_list_graph` for an ``adj`` for which the caller has found
    that :func:`takes_edge_list` holds: a new mini-batch's graph pays for
    that check once."""
    anchors, versions = fingerprint(adj, edge_weight)
    params = graph_params(normalization, use_sparse_tensor_values, gcn_improved,
                          gcn_add_self_loops, dtype, size, False)  # an edge list has no loops
    graph = _EDGE_LISTS.get(anchors, versions, params)
    if graph is not None:
        if graph._cache_hits < CSR_AFTER_HITS:
            return graph
        _EDGE_LISTS.drop(anchors, params)
        return None
    graph = EdgeListGraph.from_edge_index(adj, size, edge_weight=edge_weight,
                                          normalization=normalization,
                                          gcn_improved=gcn_improved,
                                          gcn_add_self_loops=gcn_add_self_loops)
    _EDGE_LISTS.put(anchors, versions, params, graph)
    return graph


def _numba_values(*args):
    from ..ops.numba_ops import edge_list_values
    return edge_list_values(*args)


def _torch_values(src: Tensor, dst: Tensor, value: Optional[Tensor], num_src: int,
                  num_dst: int, mean: bool
                  ) -> Tuple[Optional[Tensor], Optional[Tensor], Tensor]:
    """:func:`~pyg_maxk.ops.numba_ops.edge_list_values` in torch ops."""
    ok = ((src >= 0) & (src < num_src) & (dst >= 0) & (dst < num_dst)).all()
    value = None if value is None else value.detach().to(torch.float32)
    if not mean:
        return value, None, ok
    target = dst.clamp(0, max(num_dst - 1, 0))
    degree = torch.zeros(num_dst, dtype=torch.float32, device=dst.device)
    degree.index_add_(0, target, torch.ones_like(target, dtype=torch.float32))
    scale = degree.clamp_(min=1).reciprocal_()
    weight = scale[target] if value is None else value * scale[target]
    return weight, (scale if value is None else None), ok
