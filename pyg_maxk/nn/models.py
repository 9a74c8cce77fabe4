"""Whole MaxK models in the shape of the MaxK-GNN paper's: an input linear
map, ``num_layers`` MaxK convs (MaxK where the stock model has ReLU), and an
output linear map. Built like PyG's :class:`~torch_geometric.nn.models.BasicGNN`:
a subclass only says how to make one conv.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.nn import GCNConv, GINConv, SAGEConv
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.typing import Adj, OptTensor

from .gcn_conv import MaxKGCNConv
from .gin_conv import MaxKGINConv
from .sage_conv import MaxKSAGEConv


class MaxKBasicGNN(torch.nn.Module):
    r"""Base of the MaxK models:

    .. math::
        \mathbf{h}^{(0)} = \mathbf{x}\mathbf{W}_{in}, \quad
        \mathbf{h}^{(l)} = \mathrm{Conv}_l\!\left(\mathrm{MaxK}_k(\mathbf{h}^{(l-1)})\right),
        \quad \mathbf{y} = \mathbf{h}^{(L)}\mathbf{W}_{out}

    Args:
        in_channels (int): input features per node (``-1``: lazy).
        hidden_channels (int): width of every conv.
        num_layers (int): number of convs.
        out_channels (int, optional): output size; :obj:`None` leaves out the
            output map (the output then has ``hidden_channels``).
        k (int, optional): MaxK's ``k``; :obj:`None` builds the *stock* model
            instead (PyG's own convs, ReLU in place of MaxK), the baseline
            that MaxK is compared against.
        dropout (float): feature dropout (on the kept values with MaxK, after
            ReLU in the stock model).
        **kwargs: passed to every conv.
    """
    supports_edge_weight: bool = False

    def __init__(self, in_channels: int, hidden_channels: int, num_layers: int,
                 out_channels: Optional[int] = None, k: Optional[int] = 32,
                 dropout: float = 0.0, **kwargs: Any) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError("num_layers must be at least 1")
        self.in_channels = in_channels
        self.hidden_channels = hidden_channels
        self.num_layers = num_layers
        self.out_channels = out_channels if out_channels is not None else hidden_channels
        self.k = k
        self.dropout = float(dropout)
        self.lin_in = Linear(in_channels, hidden_channels)
        self.convs = torch.nn.ModuleList(
            self.init_conv(hidden_channels, hidden_channels, **kwargs)
            for _ in range(num_layers))
        self.lin_out = (Linear(hidden_channels, out_channels)
                        if out_channels is not None else None)

    @property
    def is_maxk(self) -> bool:
        return self.k is not None

    def conv_kwargs(self) -> dict:
        """Extra conv arguments: ``k`` and ``dropout`` for MaxK convs."""
        return {"k": self.k, "dropout": self.dropout} if self.is_maxk else {}

    def init_conv(self, in_channels: int, out_channels: int, **kwargs: Any) -> torch.nn.Module:
        raise NotImplementedError

    def reset_parameters(self) -> None:
        self.lin_in.reset_parameters()
        for conv in self.convs:
            conv.reset_parameters()
        if self.lin_out is not None:
            self.lin_out.reset_parameters()

    def forward(self, x: Tensor, edge_index: Adj, edge_weight: OptTensor = None, *,
                num_sampled_nodes_per_hop: Optional[List[int]] = None,
                num_sampled_edges_per_hop: Optional[List[int]] = None) -> Tensor:
        """``x [N, in_channels]`` to ``[N, out_channels]``.

        With the per-hop counts of a :class:`~torch_geometric.loader.NeighborLoader`
        batch (``batch.num_sampled_nodes``/``batch.num_sampled_edges``; needs
        an ``edge_index`` tensor), layer ``l`` only computes the nodes that
        later layers still need: its targets are the nodes of the first
        ``L - l`` hops, its sources one hop more, and the last layer's
        targets are the seed nodes alone: the output then has
        ``batch_size`` rows (GCN: see :attr:`trims_to_hops`).
        """
        trim = num_sampled_nodes_per_hop is not None and self.trims_to_hops
        if trim and num_sampled_edges_per_hop is None:
            raise ValueError("num_sampled_edges_per_hop is needed with num_sampled_nodes_per_hop")
        x = self.lin_in(x)
        if self.is_maxk and not trim and not any(
                conv.explain_edge_mask() is not None for conv in self.convs):
            # Every conv aggregates over the same graph: resolve it once (one
            # graph break under torch.compile for a raw adjacency, none for a
            # CSRGraph), not once per conv.
            graph = self.convs[0].graph_for(
                edge_index, x, x, edge_weight=edge_weight if self.supports_edge_weight else None)
            # A graph that holds GIN's root term serves convs that fold it.
            # (Iterated, not sliced: a slice of a ModuleList builds a module.)
            if not graph.root_loops or all(
                    conv.adjacency_options(graph, x, x, (graph.num_src, graph.num_dst))
                    for i, conv in enumerate(self.convs) if i > 0):
                edge_index, edge_weight = graph, None
        for layer, conv in enumerate(self.convs):
            if not self.is_maxk:  # the stock baseline: ReLU + dropout
                x = F.dropout(x.relu(), p=self.dropout, training=self.training)
            if trim:
                x, adj, weight, num_dst = self._hop_slice(
                    layer, x, edge_index, edge_weight, num_sampled_nodes_per_hop,
                    num_sampled_edges_per_hop)
                x = self._conv(conv, (x, x[:num_dst]), adj, weight, (x.size(0), num_dst))
            else:
                x = self._conv(conv, x, edge_index, edge_weight, None)
        if self.lin_out is not None:
            x = self.lin_out(x)
        return x

    #: Whether per-hop counts shrink the layers. GCN ignores them: its edge
    #: normalisation needs every source's degree in the whole sampled graph,
    #: which the trimmed graph of a layer no longer has.
    trims_to_hops: bool = True

    def _conv(self, conv, x, adj, edge_weight, size):
        args = (x, adj, edge_weight) if self.supports_edge_weight else (x, adj)
        return conv(*args) if size is None else conv(*args, size=size)

    def _hop_slice(self, layer, x, edge_index, edge_weight, nodes, edges):
        """The sources, edges and target count of layer ``layer`` of a sampled
        batch (nodes and edges are ordered by hop)."""
        if not isinstance(edge_index, Tensor) or edge_index.is_sparse:
            raise ValueError("per-hop trimming needs edge_index as a [2, E] tensor")
        hops = self.num_layers - layer          # hops of sources this layer reads
        num_src = sum(nodes[:hops + 1])
        num_dst = sum(nodes[:hops])
        num_edges = sum(edges[:hops])
        weight = edge_weight[:num_edges] if edge_weight is not None else None
        return x[:num_src], edge_index[:, :num_edges], weight, num_dst

    def __repr__(self) -> str:
        kind = f"k={self.k}" if self.is_maxk else "stock ReLU"
        return (f"{self.__class__.__name__}({self.in_channels}, "
                f"{self.out_channels}, num_layers={self.num_layers}, {kind})")


class MaxKGraphSAGE(MaxKBasicGNN):
    """GraphSAGE with MaxK (:class:`MaxKSAGEConv`); see :class:`MaxKBasicGNN`."""

    def init_conv(self, in_channels: int, out_channels: int, **kwargs: Any) -> torch.nn.Module:
        if self.is_maxk:
            return MaxKSAGEConv(in_channels, out_channels, **self.conv_kwargs(), **kwargs)
        return SAGEConv(in_channels, out_channels, **kwargs)


class MaxKGCN(MaxKBasicGNN):
    """GCN with MaxK (:class:`MaxKGCNConv`); see :class:`MaxKBasicGNN`."""
    supports_edge_weight = True
    trims_to_hops = False

    def init_conv(self, in_channels: int, out_channels: int, **kwargs: Any) -> torch.nn.Module:
        if self.is_maxk:
            return MaxKGCNConv(in_channels, out_channels, **self.conv_kwargs(), **kwargs)
        return GCNConv(in_channels, out_channels, **kwargs)


class MaxKGIN(MaxKBasicGNN):
    """GIN with MaxK (:class:`MaxKGINConv`, a linear map as :math:`h_\\Theta`);
    see :class:`MaxKBasicGNN`."""

    def init_conv(self, in_channels: int, out_channels: int, **kwargs: Any) -> torch.nn.Module:
        mlp = Linear(in_channels, out_channels)
        if self.is_maxk:
            return MaxKGINConv(mlp, **self.conv_kwargs(), **kwargs)
        return GINConv(mlp, **kwargs)
