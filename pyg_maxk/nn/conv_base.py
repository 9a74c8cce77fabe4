"""What the MaxK convs share: input checking with PyG's size semantics, the
cached graph lookup, and the MaxK sparsification of the input features."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch_geometric.nn import MessagePassing
from torch_geometric.nn.dense.linear import Linear
from torch_geometric.typing import Size

from ..cbsr import CBSR
from ..dispatch import get_backend, half_reductions_allowed
from ..graph import (
    CSRGraph,
    EdgeListGraph,
    PackedGraph,
    edge_list,
    graph_with_edge_values,
    is_edge_index_type,
    is_sparse_tensor,
    is_torch_sparse,
)
from ..ops import (
    _check_features,
    aggregate,
    check_k,
    dropout_scale,
    maxk,
    maxk_aggregate,
    maxk_aggregate_linear,
    to_dense,
)
from ..ops._common import PLAIN_TENSORS
from ..ops._conv_node import run_node
from ..ops._library import _eager_kernels

#: What a layer aggregates over (:meth:`MaxKConv.graph_for`).
Graph = Union[CSRGraph, EdgeListGraph]

Features = Union[Tensor, CBSR]
PairFeatures = Tuple[Features, Optional[Features]]


def _rows(x: Features) -> int:
    return x.num_rows if isinstance(x, CBSR) else x.size(0)


def _device(x: Features) -> torch.device:
    return x.device


def _kept(x: Features, k: int) -> Optional[int]:
    """The ``k`` of the CBSR that the aggregation of ``x`` reads (None when
    MaxK keeps every column: a dense aggregation then)."""
    if isinstance(x, CBSR):
        return None if x.is_full else x.k
    return k if k < x.size(1) else None


def _outside_compiled_graph(reason: str) -> Callable:
    """``torch.compiler.disable`` with the reason dynamo's error gives under
    ``fullgraph=True`` (torch 2.7 and later take one)."""
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return functools.partial(torch.compiler.disable, reason=reason)
    return torch.compiler.disable


def _cached_graph(adj: Any, sizes: Tuple[int, int], k: Optional[int], **kwargs) -> Graph:
    # Cache lookups key on object identity and version counters, and a new
    # graph's build has data-dependent sizes: both run outside any compiled
    # graph (_cached_graph_outside_compile). The graph's tensors then enter
    # the compiled code as inputs, so a new or edited adjacency is never
    # replayed stale. A fixed graph's CSR is cached: one lookup finds it.
    if k is not None and edge_list.takes_edge_list(adj, kwargs.get("edge_weight"),
                                                   kwargs.get("dtype", torch.float32)):
        # One not cached may be served as its edge list (a new mini-batch's).
        graph = CSRGraph.cached(adj, sizes, **kwargs)
        if graph is None:
            listed = edge_list.taken_edge_list(adj, sizes, **kwargs)
            if listed is not None:
                return listed
            graph = CSRGraph.from_adj(adj, sizes, **kwargs)
    else:  # one lookup: a cache hit, or the build
        graph = CSRGraph.from_adj(adj, sizes, **kwargs)
    if k is not None:
        graph.operands_without_sync(k)  # built here, not in the compiled graph
    return graph


#: :func:`_cached_graph` as dynamo sees it; eager calls skip the wrapper's
#: own host time.
_cached_graph_outside_compile = _outside_compiled_graph(
    "pyg_maxk resolves a raw adjacency (edge_index, SparseTensor, torch.sparse) in its graph "
    "cache outside the compiled graph: for fullgraph=True pass a prepared graph instead, "
    "pyg_maxk.ToCSRGraph(normalization, k) or CSRGraph.from_adj(...).prepare(k)")(_cached_graph)


def plain_linear(module: Any, dtype: torch.dtype) -> bool:
    """Whether calling ``module`` is ``F.linear(x, module.weight,
    module.bias)`` on ``dtype`` features: a PyG or torch ``Linear`` (not a
    subclass), no forward hooks (its own or global ones), its weight sized
    and of ``dtype``. A conv may then run the map inside its own op."""
    if type(module) not in _LINEARS or module._forward_hooks or module._forward_pre_hooks:
        return False
    if _GLOBAL_HOOKS is None or any(_GLOBAL_HOOKS):
        return False
    weight = module.weight  # a lazy module's is an UninitializedParameter
    return type(weight) in PLAIN_TENSORS and weight.dtype == dtype


_LINEARS = (Linear, torch.nn.Linear)
#: torch's registries of forward hooks for every module (None where a torch
#: keeps them elsewhere: then no linear map counts as plain).
_GLOBAL_HOOKS = tuple(getattr(torch.nn.modules.module, name, None)
                      for name in ("_global_forward_hooks", "_global_forward_pre_hooks"))
if None in _GLOBAL_HOOKS:  # pragma: no cover
    _GLOBAL_HOOKS = None


def _learnable(edge_weight: Optional[Tensor]) -> bool:
    return edge_weight is not None and edge_weight.requires_grad and torch.is_grad_enabled()


def _learnable_values(adj: Any, options: dict) -> bool:
    """Whether a sparse ``adj_t``'s values need a gradient and the conv reads
    them (PyG's SAGE and GIN drop a ``SparseTensor``'s values)."""
    if is_sparse_tensor(adj):
        return options.get("use_sparse_tensor_values", True) and _learnable(adj.storage.value())
    if is_torch_sparse(adj):
        return _learnable(adj._values() if adj.layout == torch.sparse_coo else adj.values())
    return False


@torch.compiler.disable
def _graph_with_edge_values(adj, sizes, edge_weight, mask, normalization, gcn_improved,
                            gcn_add_self_loops, dtype, k, loop_mask) -> CSRGraph:
    # The structure lookup keys on object identity; autograd records the
    # edge values' computation even outside the compiled graph.
    return graph_with_edge_values(adj, sizes, edge_weight, mask, normalization,
                                  gcn_improved, gcn_add_self_loops, dtype, k, loop_mask)


@_outside_compiled_graph(
    "this CSRGraph is not prepared for the conv's k (its work schedule has data-dependent "
    "sizes): for fullgraph=True call graph.prepare(k) for every k of the model, or use "
    "pyg_maxk.ToCSRGraph(normalization, k), before compiling")
def _prepare(graph: CSRGraph, k: int) -> CSRGraph:
    # A graph not prepared for this k: its schedule has data-dependent sizes.
    return graph.prepare(k)


def _adj_device(adj: Any) -> torch.device:
    if is_sparse_tensor(adj):
        return adj.device()
    return adj.device


_PREPARED = (CSRGraph, EdgeListGraph)


def graph_kind(graph: Graph) -> tuple:
    """What of a prepared graph the layer's checks and the one-node call's
    decisions read, besides its operands: its type, sizes, device, the
    normalisation its edge values hold and GIN's root loops. Graphs of
    one kind (a new graph per step of the same sizes) take the same path."""
    return (type(graph), graph.num_src, graph.num_dst, graph.device, graph.normalization,
            graph.gcn_options, graph.root_loops)


class MaxKConv(MessagePassing):
    """Base of the MaxK convs: a :class:`MessagePassing` whose aggregation
    runs as a CSR x CBSR product instead of gather/scatter.

    Args:
        k (int): features kept per node by MaxK before aggregation
            (``k >= in_channels`` keeps all of them).
        dropout (float): dropout on the kept values (the MaxK-GNN paper's
            feature dropout), active in training mode.
    """

    SUPPORTED_AGGRS: Tuple[str, ...] = ("sum", "add")

    def __init__(self, *, k: int = 32, dropout: float = 0.0, **kwargs: Any) -> None:
        aggr = kwargs.get("aggr", "add")
        if not isinstance(aggr, str) or aggr not in self.SUPPORTED_AGGRS:
            raise ValueError(
                f"{self.__class__.__name__} supports aggr in "
                f"{self.SUPPORTED_AGGRS}, got aggr={aggr!r}: the MaxK sparse "
                f"aggregation is a weighted sum and cannot run this aggregation. "
                f"Use the stock PyG layer for it.")
        flow = kwargs.get("flow", "source_to_target")
        if flow != "source_to_target":
            raise ValueError(f"{self.__class__.__name__} supports only "
                             f"flow='source_to_target', got flow={flow!r}")
        if kwargs.get("node_dim", -2) not in (-2, 0):
            raise ValueError(f"{self.__class__.__name__} expects features of "
                             f"shape [num_nodes, channels] (node_dim=0)")
        super().__init__(**kwargs)
        self.k = check_k(k)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.dropout = float(dropout)

    def message(self, x_j: Tensor) -> Tensor:  # the per-edge reference
        return x_j

    # ----------------------------------------------------------- helpers
    def sparsify(self, x: Features) -> CBSR:
        """MaxK of ``x`` (a CBSR input is taken as already sparsified)."""
        if isinstance(x, CBSR):
            return x
        return maxk(x, self.k, dropout=self.dropout, training=self.training)

    def sparsify_and_aggregate(self, graph: Graph, x: Features, *,
                               with_dense: bool = False) -> Tuple[Tensor, CBSR, Optional[Tensor]]:
        """``(graph @ h, h, dense h or None)`` for ``h`` the MaxK of ``x``
        (with its dropout): one op (:func:`pyg_maxk.ops.maxk_aggregate`, one
        autograd node) unless ``x`` is a CBSR already."""
        if isinstance(x, CBSR):
            return self.aggregate_sparse(graph, x), x, (to_dense(x) if with_dense else None)
        return maxk_aggregate(x, self.k, graph, with_dense=with_dense, dropout=self.dropout,
                              training=self.training)

    @staticmethod
    def aggregate_sparse(graph: Graph, h: CBSR) -> Tensor:
        """``graph @ h`` as a dense ``[num_dst, channels]`` tensor."""
        return aggregate(graph, h)

    @staticmethod
    def split_features(x: Union[Features, PairFeatures]) -> PairFeatures:
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError("Expected x as a tensor or a pair (x_src, x_dst)")
            x_src, x_dst = x
        else:
            x_src, x_dst = x, x
        for name, t in (("x_src", x_src), ("x_dst", x_dst)):
            if t is not None and not isinstance(t, CBSR):
                _check_features(t, name if isinstance(x, (tuple, list)) else "x")
        if x_src is None:
            raise ValueError("x_src must not be None")
        return x_src, x_dst

    def resolve_size(self, adj: Any, x_src: Features, x_dst: Optional[Features],
                     size: Optional[Tuple[Optional[int], Optional[int]]]) -> Tuple[int, int]:
        """``(num_src, num_dst)`` as :class:`MessagePassing` infers it,
        raising on any disagreement between ``adj``, ``size`` and ``x``."""
        if isinstance(adj, _PREPARED):
            sizes = [adj.num_src, adj.num_dst]
        elif is_sparse_tensor(adj) or is_torch_sparse(adj):
            sizes = [int(adj.size(1)), int(adj.size(0))]
        elif is_edge_index_type(adj):
            sizes = [adj.num_rows, adj.num_cols]
        elif isinstance(adj, Tensor):
            if size is not None and len(size) != 2:
                raise ValueError(f"size must be (num_src, num_dst), got {size}")
            sizes = list(size) if size is not None else [None, None]
        else:
            raise TypeError(f"{self.__class__.__name__} got an adjacency of type "
                            f"{type(adj).__name__}")
        for dim, t in ((0, x_src), (1, x_dst)):
            if t is None:
                continue
            rows = _rows(t)
            if sizes[dim] is None:
                sizes[dim] = rows
            elif sizes[dim] != rows:
                raise ValueError(
                    f"Encountered {'source' if dim == 0 else 'target'} features "
                    f"with {rows} nodes, but the adjacency/size expects "
                    f"{sizes[dim]}")
        if sizes[1] is None:
            sizes[1] = sizes[0]
        return int(sizes[0]), int(sizes[1])

    def graph_options(self) -> dict:
        """How this conv's graph is built: keyword arguments of
        :meth:`CSRGraph.from_adj` (``normalization`` and its options)."""
        raise NotImplementedError

    def adjacency_options(self, adj: Any, x_src: Features, x_dst: Optional[Features],
                          sizes: Tuple[int, int]) -> dict:
        """Options of :meth:`CSRGraph.from_adj` that this call adds to
        :meth:`graph_options` (none here)."""
        return {}

    def graph_for(self, adj: Any, x_src: Features, x_dst: Optional[Features] = None,
                  size: Size = None, *,
                  edge_weight: Optional[Tensor] = None) -> Graph:
        """The graph of ``adj`` for this layer, with its operands for this
        layer's ``k`` built: a :class:`CSRGraph`, or, for a GPU ``edge_index``
        not seen before (unless
        :data:`~pyg_maxk.graph.edge_list.LAYERS_TAKE_EDGE_LISTS` is False), an
        :class:`~pyg_maxk.graph.EdgeListGraph` (no sort, no schedule: what a
        new graph per batch should cost).

        A :class:`CSRGraph` (prepared outside the model, e.g. by
        :class:`~pyg_maxk.transforms.ToCSRGraph`) is checked and used as is:
        under ``torch.compile`` that path traces with no graph break. Any
        other adjacency is looked up in (or built into) the graph cache
        outside the compiled graph: one graph break per conv call.
        """
        options = self.graph_options()
        normalization = options.pop("normalization")
        sizes = self.resolve_size(adj, x_src, x_dst, size)
        device = _device(x_src)
        if _adj_device(adj) != device:
            raise ValueError(
                f"The features are on {device} but the adjacency is on "
                f"{_adj_device(adj)}; move both to the same device")
        options.update(self.adjacency_options(adj, x_src, x_dst, sizes))
        mask = self.explain_edge_mask()
        dtype = torch.float64 if x_src.dtype == torch.float64 else torch.float32
        if mask is not None or _learnable(edge_weight) or _learnable_values(adj, options):
            if isinstance(adj, _PREPARED):
                raise NotImplementedError(
                    f"{self.__class__.__name__} applies an explain edge mask or learnable "
                    f"edge weights to an edge_index or sparse adjacency, not to a prepared "
                    f"CSRGraph (which fixes its edge values): pass the edge_index")
            # The cached structure; the edge values recomputed per call,
            # differentiably (their gradient: the SDDMM of the aggregation).
            return _graph_with_edge_values(adj, sizes, edge_weight, mask, normalization,
                                           options.get("gcn_improved", False),
                                           options.get("gcn_add_self_loops", True), dtype,
                                           _kept(x_src, self.k),
                                           getattr(self, "_loop_mask", None))
        if isinstance(adj, _PREPARED):
            self._check_prepared(adj, normalization, edge_weight, options)
            k = _kept(x_src, self.k)
            return adj if k is None or adj.has_operands(k) else _prepare(adj, k)
        lookup = _cached_graph_outside_compile if torch.compiler.is_compiling() else _cached_graph
        return lookup(adj, sizes, _kept(x_src, self.k), edge_weight=edge_weight,
                      normalization=normalization, dtype=dtype, **options)

    # ------------------------------------------------ the repeated fused call
    def fused_call(self, x: Tensor, graph: Graph, adj: Any, maps: tuple,
                   root_scale: Optional[Tensor] = None) -> Tensor:
        """:func:`maxk_aggregate_linear` of ``x`` over ``graph`` with ``maps``
        (the aggregation's linear map, then the root term's, if any) and
        ``root_scale`` (:meth:`root_scale_for` the graph). Where it runs as
        one autograd node on a prepared graph passed as ``adj``, the call is
        remembered with everything that decided it, and
        :meth:`repeat_fused_call` repeats it, on that graph or another of
        its kind, without the layer's and the op's checks while none of
        that has changed."""
        weight, bias, root_weight = self.fused_weights(maps)
        out = maxk_aggregate_linear(x, self.k, graph, weight, bias, root_weight=root_weight,
                                    root_scale=root_scale, dropout=self.dropout,
                                    training=self.training)
        if torch.compiler.is_compiling():  # compiled code keeps no state of its own here
            return out
        self.__dict__.pop("_last_fused", None)
        if adj is graph and not self.explain and isinstance(graph, _PREPARED):
            state = self._fused_state(x)
            packed = graph.operands(self.k)
            kernels = _eager_kernels(x, self.k, packed, None, state[0])
            if kernels is not None:
                self.__dict__["_last_fused"] = (graph, x.shape, x.dtype, x.device, maps, state,
                                                packed, kernels, graph_kind(graph))
        return out

    def fused_maps(self) -> tuple:
        """The linear modules of this conv's one-node call, as they are now."""
        return ()

    def __getstate__(self) -> dict:
        # The remembered call holds a graph: never pickled or deep-copied.
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {key: value for key, value in state.items() if key != "_last_fused"}

    def fused_weights(self, maps: tuple) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """``(weight, bias, root_weight)`` of the one-node call with ``maps``
        (by default the first map's weight and bias, the second's weight)."""
        return maps[0].weight, maps[0].bias, (maps[1].weight if len(maps) > 1 else None)

    def fused_conditions(self, x: Tensor) -> tuple:
        """What else of this conv decides its one-node call on ``x``, beyond
        what :meth:`repeat_fused_call` checks for every conv (none here)."""
        return ()

    def root_scale_for(self, graph: Graph) -> Optional[Tensor]:
        """The ``root_scale`` of this conv's one-node call over ``graph`` (the
        root term's multiple of MaxK's output; None: no such term)."""
        return None

    def _fused_state(self, x: Tensor) -> tuple:
        """What decides the one-node call, besides the graph, the features'
        kind and the modules (the backend first)."""
        return (get_backend(), self.training, self.dropout, self.k, self.explain,
                torch.is_autocast_enabled(x.device.type),
                torch.are_deterministic_algorithms_enabled(), half_reductions_allowed(),
                self.graph_options(), self.fused_conditions(x))

    def repeat_fused_call(self, x: Any, adj: Any) -> Optional[Tensor]:
        """The one-node call that :meth:`fused_call` remembered, for the same
        prepared graph or one of its kind (:func:`graph_kind`: a new graph
        per step) and features of the same shape, type and device, where
        nothing else that decided it has changed; None otherwise."""
        if torch.compiler.is_compiling():  # first: dynamo then traces none of the rest
            return None
        last = self.__dict__.get("_last_fused")
        if last is None or type(x) not in PLAIN_TENSORS:
            return None
        if x.shape != last[1] or x.dtype != last[2] or x.device != last[3]:
            return None
        if (_get_current_dispatch_mode() is not None
                or torch._C._are_functorch_transforms_active()):
            return None
        if _GLOBAL_HOOKS is None or _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]:
            return None
        maps = last[4]
        if self.fused_maps() != maps:
            return None
        for m in maps:
            if m._forward_hooks or m._forward_pre_hooks:
                return None
        weight, bias, root_weight = self.fused_weights(maps)
        for t in (weight, bias, root_weight):
            if t is not None and (type(t) not in PLAIN_TENSORS or t.dtype != x.dtype):
                return None
        if self._fused_state(x) != last[5]:
            return None
        packed = self._repeat_operands(adj, last)
        if packed is None:
            return None
        root_scale = self.root_scale_for(adj)
        scale = dropout_scale(x, self.k, self.dropout, self.training)
        return run_node(last[7], x, self.k, packed, adj.num_dst, weight, bias, root_weight,
                        root_scale, scale)

    def _repeat_operands(self, adj: Any, last: tuple) -> Optional[PackedGraph]:
        """The operands of ``adj`` for a repeat of the call ``last``: its
        own, where it is that call's graph and they are the ones it had (a
        graph that the cache settles gets new ones), or another graph's of
        its kind, built for this ``k`` and with fixed edge values (the call
        is then remembered on it); None otherwise."""
        if adj is last[0]:
            packed = adj.operands(self.k)
            return packed if packed is last[6] else None
        if type(adj) not in _PREPARED or graph_kind(adj) != last[8]:
            return None
        if not adj.has_operands(self.k):
            return None
        packed = adj.operands(self.k)
        if packed.weight is not None or packed.weight_t is not None:
            return None
        self.__dict__["_last_fused"] = (adj, *last[1:6], packed, *last[7:])
        return packed

    def explain_edge_mask(self) -> Optional[Tensor]:
        """The edge mask of PyG's explain module as ``propagate`` applies it
        (after the sigmoid where PyG asks for one), or None when this conv
        is not being explained. The sparse aggregation multiplies it into
        each edge's value, where ``explain_message`` multiplies it into each
        message."""
        if self.explain and "explain_message" in self.__dict__:
            # An explainer that replaces explain_message (GraphMaskExplainer)
            # learns from each message, which the sparse product never forms.
            raise NotImplementedError(
                f"{self.__class__.__name__} does not call explain_message (its sparse "
                f"aggregation forms no per-edge messages), which this explainer replaces "
                f"to read them: explain the stock PyG model (load the same state dict into "
                f"the torch_geometric conv) or use an edge-mask explainer such as "
                f"GNNExplainer or PGExplainer.")
        mask = getattr(self, "_edge_mask", None)
        if not self.explain or mask is None:
            return None
        return mask.sigmoid() if self._apply_sigmoid else mask

    def _check_prepared(self, graph: CSRGraph, normalization: str,
                        edge_weight: Optional[Tensor], options: dict) -> None:
        name = self.__class__.__name__
        if graph.normalization != normalization:
            raise ValueError(
                f"{name} needs a graph with '{normalization}' normalisation, got one "
                f"with '{graph.normalization}': build it with "
                f"ToCSRGraph(normalization='{normalization}') or "
                f"CSRGraph.from_adj(..., normalization='{normalization}')")
        if edge_weight is not None:
            raise ValueError(f"{name} got edge_weight with a CSRGraph: a prepared graph "
                             f"holds its edge values; build it with them instead")
        if graph.root_loops and not options.get("root_loops", False):
            raise ValueError(
                f"{name} got a graph that holds GIN's root term as self-loops (built for a "
                f"MaxKGINConv with eps = 0): pass the edge_index, or a graph built without "
                f"root_loops")
        if normalization == "gcn":
            wanted = (bool(options.get("gcn_improved", False)),
                      bool(options.get("gcn_add_self_loops", True)))
            if graph.gcn_options is not None and graph.gcn_options != wanted:
                raise ValueError(
                    f"{name} (improved={wanted[0]}, add_self_loops={wanted[1]}) got a "
                    f"graph normalised with improved={graph.gcn_options[0]}, "
                    f"add_self_loops={graph.gcn_options[1]}")

    def __prepare_scriptable__(self):
        raise RuntimeError(
            f"{self.__class__.__name__} does not support TorchScript (torch.jit.script), "
            f"which PyTorch has deprecated: compile the model with torch.compile(model) "
            f"instead (see the pyg_maxk README, 'torch.compile and CUDA graphs').")

    def _extra_repr_k(self) -> str:
        return f"k={self.k}" + (f", dropout={self.dropout}" if self.dropout else "")
