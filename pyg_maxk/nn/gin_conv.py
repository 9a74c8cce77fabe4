from __future__ import annotations

from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.nn.inits import reset
from torch_geometric.typing import Adj, Size

from ..dispatch import dense_root_pays, root_loops_pay
from ..graph import CSRGraph, is_torch_sparse
from .conv_base import Features, MaxKConv, PairFeatures


class MaxKGINConv(MaxKConv):
    r"""GIN with MaxK-sparsified inputs, equal to PyG's
    :class:`~torch_geometric.nn.conv.GINConv` applied to
    :math:`\mathrm{MaxK}_k(\mathbf{x})`:

    .. math::
        \mathbf{x}^{\prime}_i = h_{\mathbf{\Theta}} \left( (1 + \epsilon)
        \cdot \mathbf{h}_i + \sum_{j \in \mathcal{N}(i)} \mathbf{h}_j \right),
        \qquad \mathbf{h} = \mathrm{MaxK}_k(\mathbf{x})

    The root term :math:`(1 + \epsilon)\mathbf{h}_i` is added on the dense
    form of :math:`\mathbf{h}` (written with the aggregation, in one autograd
    node) on small graphs, whose steps are bound by launches and nodes;
    elsewhere it is scattered from the CBSR values straight into the
    aggregate, never densified. Where
    :func:`~pyg_maxk.dispatch.root_loops_pay` and :math:`\epsilon = 0` is
    fixed, it is one more edge :math:`i \to i` per node of the graph built
    from an ``edge_index`` instead (one sum, no root term at all).

    Args:
        nn (torch.nn.Module): the network :math:`h_{\mathbf{\Theta}}`.
        eps (float): (initial) :math:`\epsilon`.
        train_eps (bool): make :math:`\epsilon` trainable.
        k (int): features kept per node by MaxK. (default: ``32``)
        dropout (float): dropout on the kept values.
        **kwargs: of :class:`torch_geometric.nn.conv.MessagePassing`.

    Shapes:
        - **input:** node features :math:`(|\mathcal{V}|, F_{in})` or
          :math:`((|\mathcal{V_s}|, F_{s}), (|\mathcal{V_t}|, F_{t}))`, edge
          indices :math:`(2, |\mathcal{E}|)` or any sparse ``adj_t``
        - **output:** node features :math:`(|\mathcal{V}|, F_{out})` or
          :math:`(|\mathcal{V}_t|, F_{out})`
    """

    def __init__(self, nn: Callable, eps: float = 0., train_eps: bool = False,
                 *, k: int = 32, dropout: float = 0.0, **kwargs: Any) -> None:
        kwargs.setdefault("aggr", "add")
        super().__init__(k=k, dropout=dropout, **kwargs)
        self.nn = nn
        self.initial_eps = eps
        if train_eps:
            self.eps = torch.nn.Parameter(torch.empty(1))
        else:
            self.register_buffer("eps", torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        reset(self.nn)
        self.eps.data.fill_(self.initial_eps)

    def graph_options(self) -> dict:
        return {"normalization": "sum", "use_sparse_tensor_values": False}

    def adjacency_options(self, adj: Any, x_src: Features, x_dst: Optional[Features],
                          sizes: Tuple[int, int]) -> dict:
        """``root_loops`` where the root term can be one self-loop per node of
        the graph: ``x_src`` as ``x_dst`` on a square ``edge_index`` (or on
        a graph built so), ``eps = 0`` and not trained, outside
        autocast and compiled code, where
        :func:`~pyg_maxk.dispatch.root_loops_pay`."""
        if not (x_dst is x_src and isinstance(x_src, Tensor) and sizes[0] == sizes[1]):
            return {}
        if isinstance(adj, CSRGraph):
            if not adj.root_loops:
                return {}
        elif not isinstance(adj, Tensor) or is_torch_sparse(adj) or adj.dim() != 2:
            return {}
        eps = self.eps
        if (torch.compiler.is_compiling() or eps.requires_grad
                or torch.is_autocast_enabled(x_src.device.type) or not root_loops_pay(x_src)
                or eps.device.type != "cpu" or float(eps) != 0.0):  # a CPU read: no sync
            return {}
        return {"root_loops": True}

    def forward(self, x: Union[Features, PairFeatures], edge_index: Adj,
                size: Size = None) -> Tensor:
        x_src, x_dst = self.split_features(x)
        graph = self.graph_for(edge_index, x_src, x_dst, size)
        if graph.root_loops:  # the root term is among the edges
            return self.nn(self.sparsify_and_aggregate(graph, x_src)[0])
        dense_root = x_dst is x_src and self.dense_root_pays(x_src)
        out, h_src, dense = self.sparsify_and_aggregate(graph, x_src, with_dense=dense_root)
        if dense_root:
            out = out.addcmul_(dense, 1 + self.eps)  # out is fresh
        elif x_dst is not None:
            h_dst = h_src if x_dst is x_src else self.sparsify(x_dst)
            out = h_dst.add_to(out, 1 + self.eps, inplace=True)  # out is fresh
        return self.nn(out)

    def dense_root_pays(self, x: Features) -> bool:
        """Whether the root term of ``x`` (``x_src`` as ``x_dst``) is added on
        its dense form (:func:`pyg_maxk.dispatch.dense_root_pays`); only for
        features of ``eps``'s dtype outside autocast, where the in-place sum
        keeps the aggregation's dtype as the scattered one does."""
        return (isinstance(x, Tensor) and x.dtype == self.eps.dtype
                and not torch.is_autocast_enabled(x.device.type) and dense_root_pays(x))

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(nn={self.nn}, {self._extra_repr_k()})"
