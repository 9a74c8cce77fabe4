from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Parameter
from torch_geometric.nn.dense.linear import Linear, is_uninitialized_parameter
from torch_geometric.nn.inits import zeros
from torch_geometric.typing import Adj, OptTensor

from ..ops import aggregation_dtype, dtype_of
from .conv_base import Features, MaxKConv


class MaxKGCNConv(MaxKConv):
    r"""GCN with MaxK-sparsified inputs, equal to PyG's
    :class:`~torch_geometric.nn.conv.GCNConv` applied to
    :math:`\mathrm{MaxK}_k(\mathbf{x})`:

    .. math::
        \mathbf{X}^{\prime} = \left(\mathbf{\hat{D}}^{-1/2} \mathbf{\hat{A}}
        \mathbf{\hat{D}}^{-1/2} \, \mathrm{MaxK}_k(\mathbf{X})\right)
        \mathbf{\Theta} + \mathbf{b}

    Since :math:`\mathbf{\hat{A}}(\mathbf{H}\mathbf{\Theta}) =
    (\mathbf{\hat{A}}\mathbf{H})\mathbf{\Theta}`, the sparse features are
    aggregated first (a CSR x CBSR product) and transformed afterwards. The
    normalised adjacency is computed by PyG's own ``gcn_norm`` and cached, so
    ``cached`` is accepted for compatibility and never returns a stale graph.

    Args:
        in_channels (int): size of each input sample, or ``-1`` (lazy).
        out_channels (int): size of each output sample.
        improved (bool): :math:`\mathbf{\hat{A}} = \mathbf{A} + 2\mathbf{I}`.
        cached (bool): accepted for compatibility (graphs are always cached).
        add_self_loops (bool, optional): add self-loops (default:
            :obj:`normalize`).
        normalize (bool): apply the symmetric normalisation.
        bias (bool): learn an additive bias.
        k (int): features kept per node by MaxK. (default: ``32``)
        dropout (float): dropout on the kept values.
        **kwargs: of :class:`torch_geometric.nn.conv.MessagePassing`.

    Shapes:
        - **input:** node features :math:`(|\mathcal{V}|, F_{in})`, edge
          indices :math:`(2, |\mathcal{E}|)` or a sparse ``adj_t``, edge
          weights :math:`(|\mathcal{E}|)` *(optional)*
        - **output:** node features :math:`(|\mathcal{V}|, F_{out})`
    """

    def __init__(self, in_channels: int, out_channels: int, improved: bool = False,
                 cached: bool = False, add_self_loops: Optional[bool] = None,
                 normalize: bool = True, bias: bool = True, *, k: int = 32,
                 dropout: float = 0.0, **kwargs: Any) -> None:
        kwargs.setdefault("aggr", "add")
        super().__init__(k=k, dropout=dropout, **kwargs)
        if add_self_loops is None:
            add_self_loops = normalize
        if add_self_loops and not normalize:
            raise ValueError(f"'{self.__class__.__name__}' does not support "
                             f"adding self-loops to the graph when no "
                             f"on-the-fly normalization is applied")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.improved = improved
        self.cached = cached
        self.add_self_loops = add_self_loops
        self.normalize = normalize

        self.lin = Linear(in_channels, out_channels, bias=False,
                          weight_initializer="glorot")
        if bias:
            self.bias = Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.lin.reset_parameters()
        zeros(self.bias)

    def fused_maps(self) -> tuple:
        return (self._modules["lin"],)

    def fused_weights(self, maps: tuple) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        # The bias is the conv's own, added after the aggregation as PyG's.
        return maps[0].weight, self.bias, None

    def graph_options(self) -> dict:
        return {"normalization": "gcn" if self.normalize else "sum",
                "gcn_improved": self.improved, "gcn_add_self_loops": self.add_self_loops}

    def forward(self, x: Features, edge_index: Adj, edge_weight: OptTensor = None) -> Tensor:
        if isinstance(x, (tuple, list)):
            raise ValueError(f"'{self.__class__.__name__}' received a tuple "
                             f"of node features as input while this layer "
                             f"does not support bipartite message passing. "
                             f"Please try other layers such as 'MaxKSAGEConv' "
                             f"instead")
        if edge_weight is None:
            out = self.repeat_fused_call(x, edge_index)
            if out is not None:
                return out
        x, _ = self.split_features(x)
        graph = self.graph_for(edge_index, x, x, None, edge_weight=edge_weight)
        if (isinstance(x, Tensor) and self.k < x.size(1) and x.dtype == self.lin.weight.dtype
                and not is_uninitialized_parameter(self.lin.weight)
                and not torch.is_autocast_enabled(x.device.type)):
            # MaxK, the aggregation and the linear map in one autograd node
            # (the bias in the GEMM's epilogue), as below.
            return self.fused_call(x, graph, edge_index if edge_weight is None else None,
                                   self.fused_maps())
        agg = self.sparsify_and_aggregate(graph, x)[0]  # [N, F_in]
        if is_uninitialized_parameter(self.lin.weight):  # lazy in_channels=-1
            out = self.lin(agg)
            return out if self.bias is None else out + self.bias
        if torch.is_autocast_enabled(agg.device.type):
            # Stock GCNConv aggregates its (autocast) linear output with the
            # edge values and then adds the bias, each in torch's promoted
            # type: the same result type here.
            out = F.linear(agg, self.lin.weight)
            out = out.to(aggregation_dtype(out.dtype, dtype_of(graph.weight),
                                           dtype_of(graph.row_scale)))
            return out if self.bias is None else out + self.bias
        # The bias in the GEMM's epilogue: no separate pass over [N, F_out].
        return F.linear(agg, self.lin.weight, self.bias)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, "
                f"{self.out_channels}, {self._extra_repr_k()})")
