from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.nn.inits import reset
from torch_geometric.typing import Adj, Size

from ..dispatch import dense_root_pays, root_loops_pay
from ..graph import CSRGraph, is_torch_sparse
from .conv_base import Features, Graph, MaxKConv, PairFeatures, plain_linear

#: Host copies of CUDA tensors' values (:func:`host_value`), by ``id``:
#: ``[weak reference, (version, data pointer), value or pinned copy, event]``.
_HOST_VALUES: Dict[int, List[Any]] = {}


def host_value(t: Tensor) -> Optional[float]:
    """The value of the one-element tensor ``t`` on the host without a host
    sync: ``float(t)`` on the CPU; on a GPU, the value of an asynchronous
    copy that the first call (and the first after each in-place edit, which
    bumps the version counter) starts, None until that copy has landed or
    while a CUDA graph is being captured. An edit through ``.data`` bumps no
    version counter: callers that act on the value check it on the device
    (``torch._assert_async``)."""
    if t.device.type == "cpu":
        return float(t)
    key = (t._version, t.data_ptr())
    entry = _HOST_VALUES.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != key:
        if torch.cuda.is_current_stream_capturing():
            return None
        copy = t.detach().to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))  # the copy's stream
        ident = id(t)
        _HOST_VALUES[ident] = [weakref.ref(t, lambda _: _HOST_VALUES.pop(ident, None)),
                               key, copy, event]
        return None
    if entry[3] is not None:
        if torch.cuda.is_current_stream_capturing() or not entry[3].query():
            return None
        entry[2], entry[3] = float(entry[2]), None
    return entry[2]


_EPS_EDITED = ("MaxKGINConv ran its root term as self-loops, which needs eps = 0, but eps is "
               "not 0: eps changed through .data (which bumps no version counter; edit it in "
               "place under torch.no_grad() instead), or the conv got a graph built with "
               "root_loops")


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
    fixed, it is one more edge :math:`i \to i` per node of the CSR graph
    built from an ``edge_index`` instead (one sum, no root term at all; on a
    GPU, once the ``edge_index`` counts as a fixed graph: a new graph per
    batch is aggregated as its edge list). A GPU's :math:`\epsilon` is read
    without a host sync (:func:`host_value`) and checked on the device.

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
        with torch.no_grad():  # an edit that bumps eps's version (host_value)
            self.eps.fill_(self.initial_eps)

    def graph_options(self) -> dict:
        return {"normalization": "sum", "use_sparse_tensor_values": False}

    def adjacency_options(self, adj: Any, x_src: Features, x_dst: Optional[Features],
                          sizes: Tuple[int, int]) -> dict:
        """``root_loops`` where the root term can be one self-loop per node of
        the graph: ``x_src`` as ``x_dst`` on a square ``edge_index`` (or on
        a graph built so), ``eps = 0`` and not trained (as :func:`host_value`
        reads it: a GPU's from its second call on), outside autocast and
        compiled code, where :func:`~pyg_maxk.dispatch.root_loops_pay`."""
        if not (x_dst is x_src and isinstance(x_src, Tensor) and sizes[0] == sizes[1]):
            return {}
        if isinstance(adj, CSRGraph):
            if not adj.root_loops:
                return {}
        elif not isinstance(adj, Tensor) or is_torch_sparse(adj) or adj.dim() != 2:
            return {}
        eps = self.eps
        if (torch.compiler.is_compiling() or eps.requires_grad
                or torch.is_autocast_enabled(x_src.device.type) or not root_loops_pay(x_src)):
            return {}
        value = host_value(eps)
        if value is None and isinstance(adj, CSRGraph):
            value = 0.0  # a graph built with the loops: the forward checks eps on the device
        if value != 0.0:
            return {}
        return {"root_loops": True}

    def forward(self, x: Union[Features, PairFeatures], edge_index: Adj,
                size: Size = None) -> Tensor:
        if size is None:
            out = self.repeat_fused_call(x, edge_index)
            if out is not None:
                return out
        x_src, x_dst = self.split_features(x)
        graph = self.graph_for(edge_index, x_src, x_dst, size)
        # Remembered for plain-tensor features only (a pair's checks differ).
        adj = edge_index if x_src is x else None
        if graph.root_loops:  # the root term is among the edges
            self.root_scale_for(graph)  # checks eps
            if self.fuses_nn(x_src):
                return self.fused_call(x_src, graph, adj, (self.nn,))
            return self.nn(self.sparsify_and_aggregate(graph, x_src)[0])
        dense_root = x_dst is x_src and self.dense_root_pays(x_src)
        if dense_root and not self.eps.requires_grad and self.fuses_nn(x_src):
            return self.fused_call(x_src, graph, adj, (self.nn,), self.root_scale_for(graph))
        out, h_src, dense = self.sparsify_and_aggregate(graph, x_src, with_dense=dense_root)
        if dense_root:
            out = out.addcmul_(dense, 1 + self.eps)  # out is fresh
        elif x_dst is not None:
            h_dst = h_src if x_dst is x_src else self.sparsify(x_dst)
            out = h_dst.add_to(out, 1 + self.eps, inplace=True)  # out is fresh
        return self.nn(out)

    def fused_maps(self) -> tuple:
        return (self._modules["nn"],)

    def fused_conditions(self, x: Tensor) -> tuple:
        # eps decides between the root loops and the dense root term, and
        # the loops' check: its identity, version, storage and gradient (a
        # CPU eps by value, which an edit through .data changes unseen).
        eps = self.eps
        grad = eps.requires_grad
        return (id(eps), eps._version, eps.data_ptr(), grad, eps.dtype,
                float(eps) if eps.device.type == "cpu" and not grad else None)

    def root_scale_for(self, graph: Graph) -> Optional[Tensor]:
        """``1 + eps``, or None over a graph that holds the root term as
        self-loops, which needs ``eps = 0``: a GPU's is checked on the device
        (:func:`host_value` misses edits through ``.data``)."""
        if not graph.root_loops:
            return 1 + self.eps
        if self.eps.is_cuda:
            torch._assert_async(self.eps == 0, _EPS_EDITED)
        return None

    def fuses_nn(self, x: Features) -> bool:
        """Whether :math:`h_{\\mathbf{\\Theta}}` runs in one op with MaxK and
        the aggregation of ``x`` (:func:`pyg_maxk.ops.maxk_aggregate_linear`):
        for features that MaxK sparsifies here, outside autocast, with a
        network that is one plain linear map (:func:`.conv_base.plain_linear`)."""
        return (isinstance(x, Tensor) and self.k < x.size(1)
                and not torch.is_autocast_enabled(x.device.type) and plain_linear(self.nn, x.dtype))

    def dense_root_pays(self, x: Features) -> bool:
        """Whether the root term of ``x`` (``x_src`` as ``x_dst``) is added on
        its dense form (:func:`pyg_maxk.dispatch.dense_root_pays`); only for
        features of ``eps``'s dtype outside autocast, where the in-place sum
        keeps the aggregation's dtype as the scattered one does."""
        return (isinstance(x, Tensor) and x.dtype == self.eps.dtype
                and not torch.is_autocast_enabled(x.device.type) and dense_root_pays(x))

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(nn={self.nn}, {self._extra_repr_k()})"
