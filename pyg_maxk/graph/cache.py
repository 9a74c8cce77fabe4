"""The graph cache: a graph is built once per adjacency and reused by every
layer, the backward pass and later epochs, and never returned stale (keyed
on the identity and the in-place version counter of every tensor it was
built from)."""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Dict, Hashable, List, Optional, Tuple

import torch
from torch import Tensor

from .adjacency import is_sparse_tensor, is_torch_sparse

if TYPE_CHECKING:
    from .csr import CSRGraph


def fingerprint(adj: Any, edge_weight: Optional[Tensor]) -> Tuple[List[Any], Tuple[int, ...]]:
    """The objects a graph is built from (kept as weak references) and the
    version counters that change when any of them is edited in place."""
    if is_sparse_tensor(adj):
        storage = adj.storage
        tensors = [storage.rowptr(), storage.col()]
        if storage.has_value():
            tensors.append(storage.value())
        anchors = list(tensors)
    elif is_torch_sparse(adj):
        anchors = [adj]
        values = adj._values() if adj.layout == torch.sparse_coo else adj.values()
        tensors = [adj, values]
    else:
        anchors = [adj]
        tensors = [adj]
    if edge_weight is not None:
        anchors.append(edge_weight)
        tensors.append(edge_weight)
    return anchors, tuple(t._version for t in tensors)


def graph_params(normalization: str, use_sparse_tensor_values: bool, gcn_improved: bool,
                 gcn_add_self_loops: bool, dtype: torch.dtype, size,
                 root_loops: bool) -> Tuple:
    """The part of a graph's cache key that is not its source objects: the
    options of :meth:`~pyg_maxk.CSRGraph.from_adj` that change what is built."""
    return (normalization, use_sparse_tensor_values, gcn_improved, gcn_add_self_loops, dtype,
            tuple(size) if size is not None else None, root_loops)


#: Cache hits after which a graph gets exact work schedules
#: (:meth:`CSRGraph.settle`): a new graph per mini-batch is served once per
#: layer, a fixed one on every step.
SETTLE_AFTER_HITS = 16


class _GraphCache:
    """A small LRU of graphs keyed on the identity of their source objects;
    a graph it serves often is settled (:data:`SETTLE_AFTER_HITS`)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._entries: "OrderedDict[Hashable, Tuple[List[weakref.ref], Tuple[int, ...], CSRGraph]]"
        self._entries = OrderedDict()

    def _key(self, anchors: List[Any], params: Tuple) -> Hashable:
        return (tuple(id(a) for a in anchors), params)

    def get(self, anchors, versions, params) -> Optional[CSRGraph]:
        key = self._key(anchors, params)
        entry = self._entries.get(key)
        if entry is None:
            return None
        refs, cached_versions, graph = entry
        # A dead reference means the id was reused by a new object.
        if any(r() is not a for r, a in zip(refs, anchors)) or cached_versions != versions:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        graph._cache_hits += 1
        if graph._cache_hits == SETTLE_AFTER_HITS:
            graph.settle()
        return graph

    def drop(self, anchors, params) -> None:
        self._entries.pop(self._key(anchors, params), None)

    def put(self, anchors, versions, params, graph: CSRGraph) -> None:
        # Entries whose source objects died can never hit again.
        for key in [k for k, (refs, _, _) in self._entries.items()
                    if any(r() is None for r in refs)]:
            del self._entries[key]
        self._entries[self._key(anchors, params)] = (
            [weakref.ref(a) for a in anchors], versions, graph)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_CACHE = _GraphCache()


def clear_graph_cache() -> None:
    """Drop every cached graph (and its kernel schedules)."""
    _CACHE.clear()
    _STRUCTURES.clear()
    _SPARSE_STRUCTURES.clear()
    _EDGE_LISTS.clear()


_STRUCTURES = _GraphCache()
#: Edge-list graphs (:mod:`.edge_list`), keyed as graphs are.
_EDGE_LISTS = _GraphCache()
_SPARSE_STRUCTURES: Dict[Hashable, CSRGraph] = {}
