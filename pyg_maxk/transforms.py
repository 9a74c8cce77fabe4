"""PyG transforms of pyg-maxk."""
from __future__ import annotations

from typing import Iterable, Optional, Union

import torch
from torch_geometric.data import Data
from torch_geometric.transforms import BaseTransform

from .graph import CSRGraph, check_normalization


class ToCSRGraph(BaseTransform):
    r"""Builds the :class:`~pyg_maxk.CSRGraph` that the MaxK convs aggregate
    over, once, outside the model, and stores it as ``data[attr]``
    (``adj_t``, as :class:`torch_geometric.transforms.ToSparseTensor` does).

    Passed where ``edge_index`` goes, a prepared graph lets
    ``torch.compile(model, fullgraph=True)`` compile the whole model with no
    graph break and no host synchronisation, which CUDA graphs
    (``mode="reduce-overhead"``) need.

    .. code-block:: python

        data = ToCSRGraph(normalization="mean", k=32)(data)  # MaxKSAGEConv
        model = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        out = model(data.x, data.adj_t)

    Args:
        normalization (str): the conv's: ``"mean"`` (:class:`MaxKSAGEConv`,
            the default ``aggr``), ``"gcn"`` (:class:`MaxKGCNConv` with
            ``normalize=True``), ``"sum"`` (:class:`MaxKGINConv`, SAGE with
            ``aggr="sum"``, GCN with ``normalize=False``).
        k (int or iterable of int): the convs' ``k``; the kernels' work
            schedule for each is built here. (default: ``32``)
        attr (str, optional): the edge attribute used as edge values
            (``"edge_weight"``), only with ``normalization`` ``"gcn"`` or
            ``"sum"``; SAGE and GIN ignore edge values as PyG's do.
        gcn_improved (bool), gcn_add_self_loops (bool): the GCN conv's
            ``improved`` and ``add_self_loops``.
        remove_edge_index (bool): drop ``edge_index`` (and ``attr``) from the
            data. (default: :obj:`True`)
        out_attr (str): where the graph is stored. (default: ``"adj_t"``)

    The graph's tensors move with ``data.to(device)``. It is built for the
    graph's node count, so it is meant for full-batch (transductive)
    training; mini-batches of a loader build their own graphs.
    """

    def __init__(self, normalization: str = "mean", k: Union[int, Iterable[int]] = 32,
                 attr: Optional[str] = "edge_weight", gcn_improved: bool = False,
                 gcn_add_self_loops: bool = True, remove_edge_index: bool = True,
                 out_attr: str = "adj_t") -> None:
        check_normalization(normalization)
        self.normalization = normalization
        self.ks = (k,) if isinstance(k, int) else tuple(k)
        self.attr = attr
        self.gcn_improved = gcn_improved
        self.gcn_add_self_loops = gcn_add_self_loops
        self.remove_edge_index = remove_edge_index
        self.out_attr = out_attr

    def forward(self, data: Data) -> Data:
        if data.edge_index is None:
            raise ValueError("ToCSRGraph needs data.edge_index")
        weight = None
        if self.attr is not None and self.normalization != "mean" and self.attr in data:
            weight = data[self.attr]
        num_nodes = data.num_nodes
        # Edge values in float64 for float64 features, else float32 (as the convs build).
        x = data.x if isinstance(data.x, torch.Tensor) else None
        dtype = torch.float64 if x is not None and x.dtype == torch.float64 else torch.float32
        graph = CSRGraph.from_adj(
            data.edge_index, (num_nodes, num_nodes), edge_weight=weight,
            normalization=self.normalization, gcn_improved=self.gcn_improved,
            gcn_add_self_loops=self.gcn_add_self_loops, dtype=dtype, cache=False)
        data[self.out_attr] = graph.prepare(*self.ks)
        if self.remove_edge_index:
            del data.edge_index
            if self.attr is not None and self.attr in data:
                del data[self.attr]
        return data

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(normalization='{self.normalization}', "
                f"k={self.ks if len(self.ks) > 1 else self.ks[0]})")
