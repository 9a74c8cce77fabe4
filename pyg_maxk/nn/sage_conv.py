from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.nn.dense.linear import Linear, is_uninitialized_parameter
from torch_geometric.typing import Adj, Size

from ..cbsr import CBSR
from ..dispatch import cbsr_linear_pays
from ..ops import cbsr_linear, to_dense
from .conv_base import Features, MaxKConv, PairFeatures, plain_linear


class MaxKSAGEConv(MaxKConv):
    r"""GraphSAGE with MaxK-sparsified inputs, equal to PyG's
    :class:`~torch_geometric.nn.conv.SAGEConv` applied to
    :math:`\mathrm{MaxK}_k(\mathbf{x})`:

    .. math::
        \mathbf{x}^{\prime}_i = \mathbf{W}_1 \mathbf{h}_i + \mathbf{W}_2 \cdot
        \mathrm{mean}_{j \in \mathcal{N}(i)} \mathbf{h}_j, \qquad
        \mathbf{h} = \mathrm{MaxK}_k(\mathbf{x})

    The neighbour aggregation runs on the CBSR form of :math:`\mathbf{h}`
    (``k`` non-zeros per row) as one sparse-sparse product.

    Args:
        in_channels (int or tuple): size of each input sample, or ``-1`` for
            lazy initialisation; a tuple for bipartite graphs.
        out_channels (int): size of each output sample.
        aggr (str): ``"mean"`` (default) or ``"sum"``/``"add"``; other
            aggregations raise.
        normalize (bool): :math:`\ell_2`-normalise the output.
        root_weight (bool): add the transformed root node features.
        project (bool): not supported (the projection would make the
            aggregated features dense again); must be :obj:`False`.
        bias (bool): learn an additive bias.
        k (int): features kept per node by MaxK. (default: ``32``)
        dropout (float): dropout on the kept values.
        **kwargs: of :class:`torch_geometric.nn.conv.MessagePassing`.

    Shapes:
        - **input:** node features :math:`(|\mathcal{V}|, F_{in})` or
          :math:`((|\mathcal{V_s}|, F_{s}), (|\mathcal{V_t}|, F_{t}))`, edge
          indices :math:`(2, |\mathcal{E}|)` or any sparse ``adj_t``
        - **output:** node features :math:`(|\mathcal{V}|, F_{out})` or
          :math:`(|\mathcal{V_t}|, F_{out})`
    """
    SUPPORTED_AGGRS = ("mean", "sum", "add")

    def __init__(self, in_channels: Union[int, Tuple[int, int]], out_channels: int,
                 aggr: Optional[Union[str, List[str]]] = "mean", normalize: bool = False,
                 root_weight: bool = True, project: bool = False, bias: bool = True,
                 *, k: int = 32, dropout: float = 0.0, **kwargs: Any) -> None:
        if project:
            raise ValueError(
                "MaxKSAGEConv does not support project=True: the projection "
                "makes the aggregated features dense again, which undoes MaxK. "
                "Use the stock SAGEConv for it.")
        super().__init__(k=k, dropout=dropout, aggr=aggr, **kwargs)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.normalize = normalize
        self.root_weight = root_weight
        self.project = project

        if isinstance(in_channels, int):
            in_channels = (in_channels, in_channels)
        self.lin_l = Linear(in_channels[0], out_channels, bias=bias)
        if self.root_weight:
            self.lin_r = Linear(in_channels[1], out_channels, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.lin_l.reset_parameters()
        if self.root_weight:
            self.lin_r.reset_parameters()

    def graph_options(self) -> dict:
        return {"normalization": "mean" if self.aggr == "mean" else "sum",
                "use_sparse_tensor_values": False}

    def forward(self, x: Union[Features, PairFeatures], edge_index: Adj,
                size: Size = None) -> Tensor:
        if size is None:
            out = self.repeat_fused_call(x, edge_index)
            if out is not None:
                return F.normalize(out, p=2., dim=-1) if self.normalize else out
        x_src, x_dst = self.split_features(x)
        graph = self.graph_for(edge_index, x_src, x_dst, size)
        root = self.root_weight and x_dst is not None
        # On a small graph on a GPU the root term is stock's dense linear map:
        # its [N, F_in] input is small, and a step there is bound by host time,
        # which torch's own autograd nodes spend less of than a CBSR linear op.
        dense_root = root and x_dst is x_src and not self.cbsr_root_pays(x_src)
        if (dense_root or not root) and self.fuses_linears(x_src):
            # MaxK, the aggregation and both linear maps in one autograd node.
            maps = (self.lin_l, self.lin_r) if root else (self.lin_l,)
            # Remembered for plain-tensor features only (a pair's checks differ).
            out = self.fused_call(x_src, graph, edge_index if x_src is x else None, maps)
            return F.normalize(out, p=2., dim=-1) if self.normalize else out
        agg, h_src, dense = self.sparsify_and_aggregate(graph, x_src, with_dense=dense_root)

        if dense_root:
            out = self.dense_sum_of_linears(agg, dense)
        elif root:
            h_dst = h_src if x_dst is x_src else self.sparsify(x_dst)
            out = self.sum_of_linears(agg, h_dst)
        else:
            out = self.lin_l(agg)

        if self.normalize:
            out = F.normalize(out, p=2., dim=-1)
        return out

    def fused_maps(self) -> tuple:
        modules = self._modules
        return ((modules["lin_l"], modules["lin_r"]) if self.root_weight
                else (modules["lin_l"],))

    def cbsr_root_pays(self, x: Features) -> bool:
        """Whether the root term of ``x`` (``x_src`` as ``x_dst``) runs as a
        CBSR linear op (:func:`pyg_maxk.dispatch.cbsr_linear_pays`)."""
        out = self.out_channels
        if isinstance(x, CBSR):
            return cbsr_linear_pays(x.values, x.dim, x.k, out)
        return cbsr_linear_pays(x, x.size(1), min(self.k, x.size(1)), out)

    def fuses_linears(self, x: Features) -> bool:
        """Whether this conv's linear maps run in one op with MaxK and the
        aggregation of ``x`` (:func:`pyg_maxk.ops.maxk_aggregate_linear`):
        for features that MaxK sparsifies here, outside autocast, with
        linear maps that are plain GEMMs (:func:`.conv_base.plain_linear`)."""
        if not isinstance(x, Tensor) or self.k >= x.size(1):
            return False
        modules = (self.lin_l, self.lin_r) if self.root_weight else (self.lin_l,)
        return not torch.is_autocast_enabled(x.device.type) and all(
            plain_linear(m, x.dtype) for m in modules)

    def dense_sum_of_linears(self, agg: Tensor, dense: Tensor) -> Tensor:
        """``lin_l(agg) + lin_r(dense)``, shape ``[N, F_out]``: ``lin_r``'s
        product accumulated in place into ``lin_l``'s fresh output (a GEMM
        with ``beta = 1``; ``lin_r`` has no bias), one pass over the result
        and one autograd node fewer than the sum. Through the modules (their
        hooks, autocast's casts, lazy weights) otherwise."""
        out = self.lin_l(agg)
        if (torch.is_autocast_enabled(out.device.type) or out.dtype != dense.dtype
                or not (plain_linear(self.lin_l, agg.dtype)
                        and plain_linear(self.lin_r, dense.dtype))):
            return out + self.lin_r(dense)
        return out.addmm_(dense, self.lin_r.weight.t())

    def sum_of_linears(self, agg: Tensor, h: CBSR) -> Tensor:
        """``lin_l(agg) + lin_r(h)``, shape ``[N_dst, F_out]``.

        ``lin_r`` keeps only the CBSR of ``h`` for the backward (the dense
        ``[N, dim]`` input would otherwise stay alive) and adds ``lin_l``'s
        bias; ``lin_l``'s GEMM then accumulates into that result in place
        (cuBLAS's ``beta = 1``): two passes over ``[N_dst, F_out]`` fewer
        than a GEMM and an add. One op does both
        (:func:`pyg_maxk.ops.cbsr_linear`), so compiled code keeps the
        in-place accumulation (an out-of-place addmm copies its addend first).
        """
        w_l, w_r = self.lin_l.weight, self.lin_r.weight
        if is_uninitialized_parameter(w_l) or is_uninitialized_parameter(w_r):
            # Lazy in_channels=-1: the Linear modules size their weights here.
            return self.lin_l(agg) + self.lin_r(to_dense(h))
        return cbsr_linear(h, w_r, self.lin_l.bias, dense=agg, dense_weight=w_l)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.in_channels}, "
                f"{self.out_channels}, aggr={self.aggr}, {self._extra_repr_k()})")
