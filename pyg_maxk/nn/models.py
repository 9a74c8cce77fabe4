"""Whole MaxK models in the shape of the MaxK-GNN paper's: an input linear
map, ``num_layers`` MaxK convs (MaxK where the stock model has ReLU), and an
output linear map. Built like PyG's :class:`~torch_geometric.nn.models.BasicGNN`:
a subclass only says how to make one conv.
"""
from __future__ import annotations

from typing import Any, Optional

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

    def forward(self, x: Tensor, edge_index: Adj, edge_weight: OptTensor = None) -> Tensor:
        """``x [N, in_channels]`` to ``[N, out_channels]``."""
        x = self.lin_in(x)
        for conv in self.convs:
            if not self.is_maxk:  # the stock baseline: ReLU + dropout
                x = F.dropout(x.relu(), p=self.dropout, training=self.training)
            if self.supports_edge_weight:
                x = conv(x, edge_index, edge_weight)
            else:
                x = conv(x, edge_index)
        if self.lin_out is not None:
            x = self.lin_out(x)
        return x

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
