"""The MaxK ops as ``torch.library`` custom ops: one op per computation,
each with a fake implementation (shapes and dtypes only) and registered
autograd, whatever backend runs it.

Every op takes the *requested* backend (:func:`pyg_maxk.dispatch.get_backend`)
as a string argument and, at run time, runs the implementation that
:func:`pyg_maxk.dispatch.choose` picks for it (:mod:`.torch_ops`,
:mod:`.numba_ops`, :mod:`.cpu_ops`); every backend's output has the same
shapes and dtypes. So dynamo, AOTAutograd and Inductor see opaque ops with
exact metadata and never trace a kernel launch, and the backward, which gets
the same string, runs the forward's choice.

In eager mode an op is called without the dispatcher (:class:`KernelOp`).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import dispatch
from ..cbsr import index_dtype_for
from ..dispatch import choose
from ..graph import PackedGraph, layout_dtype, layout_numel, unpack
from . import torch_ops
from ._common import PLAIN_TENSORS, aggregation_dtype, as_dtype, dtype_of


def _impls(op: str, requested: str, tensor: Tensor, **shape):
    """The module of the implementations that run ``op`` (see
    :func:`~pyg_maxk.dispatch.choose`)."""
    return _module(choose(op, tensor, requested=requested, **shape))


def _module(backend: str) -> ModuleType:
    module = _MODULES.get(backend)
    if module is None:
        if backend not in ("numba", "cpu"):
            raise ValueError(f"Unknown pyg_maxk backend {backend!r}")
        # Imported on first use (they import Numba); then a dict lookup,
        # where an import statement costs microseconds on every call.
        module = _MODULES[backend] = importlib.import_module(f".{backend}_ops", __package__)
    return module


_MODULES = {"torch": torch_ops}


#: The library that defines the ops (``torch.ops.pyg_maxk``).
_LIBRARY = torch.library.Library("pyg_maxk", "DEF")


class KernelOp:
    """One op, callable two ways with the same implementation and autograd:

    * ``op``: the ``torch.library`` op (``torch.ops.pyg_maxk.<name>.default``),
      what ``torch.compile`` sees and what :func:`torch.library.opcheck`
      checks;
    * in eager mode, the implementation itself when no input needs a
      gradient, else a classic (``forward(ctx, ...)``) autograd Function
      around it: the dispatcher and a separate ``setup_context`` cost tens of
      microseconds of host time per call, and small graphs are host-bound.

    The op is defined from the implementation's type hints (the schema that
    :func:`torch.library.custom_op` would infer) and the implementation is
    registered for every device as it is: ``custom_op``'s registration wraps
    it in per-call Python layers (a check that no output aliases an input, a
    ``torch.compiler.disable`` guard) that a compiled step, calling the op
    through the dispatcher, pays on every call. Implementations return fresh
    tensors (:func:`torch.library.opcheck` checks it in the tests).
    """

    def __init__(self, name: str, impl: Callable, fake: Callable,
                 setup_context: Optional[Callable] = None,
                 backward: Optional[Callable] = None) -> None:
        self.name = name
        self.impl = impl
        qualname = f"pyg_maxk::{name}"
        _LIBRARY.define(name + torch.library.infer_schema(impl, mutates_args=()))
        _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
        self.op = getattr(torch.ops.pyg_maxk, name).default
        torch.library.register_fake(qualname, fake, lib=_LIBRARY)
        self.function = None
        # An op without autograd (a backward's own) gets one that raises: the
        # dispatcher's default would drop its terms from a double backward.
        _register_autograd(name, self.op, impl, backward or _no_autograd_formula(qualname),
                           setup_context or _nothing_to_save)
        if backward is not None:

            def forward(ctx, *args):
                output = impl(*args)
                setup_context(ctx, args, output)
                return output

            self.function = type(f"{name}_function", (torch.autograd.Function,), {
                "forward": staticmethod(forward),
                "backward": staticmethod(backward),
            })
            # The C++ apply under Function.apply, whose Python wrapper (functorch
            # checks, a pass over the arguments) costs host time on every call.
            self._apply = super(torch.autograd.Function, self.function).apply

    def __call__(self, *args):
        # Dynamo, a tracing mode (AOTAutograd, fake tensors, make_fx) and
        # tensor subclasses need the dispatcher (and the fake implementation).
        # Then one pass over the arguments: plain tensors, any needing a gradient.
        if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
            return self.op(*args)
        needs_grad = False
        for a in args:
            if isinstance(a, Tensor):
                if type(a) not in PLAIN_TENSORS:
                    return self.op(*args)
                needs_grad = needs_grad or a.requires_grad
        if needs_grad and torch.is_grad_enabled():
            if self.function is None:
                # An op without autograd (a backward's own op, differentiated
                # again under create_graph=True): the dispatcher's output
                # raises a clear error if a backward reaches it.
                return self.op(*args)
            if torch._C._are_functorch_transforms_active():
                return self.function.apply(*args)
            return self._apply(*args)
        return self.impl(*args)

    def __repr__(self) -> str:
        return f"KernelOp(pyg_maxk::{self.name})"


def _register_autograd(name: str, op, impl: Callable, backward: Callable,
                       setup_context: Callable) -> None:
    """:func:`torch.library.register_autograd`'s kernel for ``op``, which
    calls ``impl`` itself where no input needs a gradient and every tensor
    is a plain one with no dispatch mode active: what compiled code's calls
    are at run time (AOTAutograd runs its graphs without autograd). There
    torch's kernel would dispatch the call again below autograd, a second
    trip through the dispatcher and its Python layers on every call. Fake
    tensors, functionalization and tracing modes still take that trip, to
    the fake implementation; an input that needs a gradient takes torch's
    kernel (its autograd Function). Torch's kernel alone where its builder
    is missing."""
    try:
        from torch._library.autograd import Info, make_autograd_impl
        general = make_autograd_impl(op, Info(backward, setup_context))
    except (ImportError, AttributeError, TypeError):
        torch.library.register_autograd(f"pyg_maxk::{name}", backward,
                                        setup_context=setup_context, lib=_LIBRARY)
        return
    any_requires_grad = torch._C._any_requires_grad

    def kernel(keyset, *args):
        if not (torch.is_grad_enabled() and any_requires_grad(*args)) \
                and _get_current_dispatch_mode() is None \
                and all(type(a) in PLAIN_TENSORS for a in args if isinstance(a, Tensor)):
            return impl(*args)
        return general(keyset, *args)
    _LIBRARY.impl(name, kernel, "Autograd", with_keyset=True)


def _no_autograd_formula(qualname: str) -> Callable:
    def backward(ctx, *grads):
        raise RuntimeError(f"Trying to backward through {qualname}, which has no autograd "
                           f"formula: it computes a gradient of the MaxK ops, and their "
                           f"second derivatives are not supported.")
    return backward


def _nothing_to_save(ctx, inputs, output) -> None:
    pass


def _densify(requested: str, values: Tensor, dim: int):
    """The densify function that ``requested`` runs on ``values``."""
    return _impls("densify", requested, values, dim=dim, k=values.size(1)).cbsr_to_dense


# ------------------------------------------------------------------ densify
def _cbsr_to_dense(values: Tensor, indices: Tensor, dim: int, backend: str) -> Tensor:
    return _densify(backend, values, dim)(values, indices, dim)


def _cbsr_to_dense_fake(values, indices, dim, backend):
    return values.new_empty(values.size(0), dim)


def _cbsr_to_dense_setup(ctx, inputs, output) -> None:
    ctx.backend = inputs[3]
    ctx.save_for_backward(inputs[1])


def _cbsr_to_dense_backward(ctx, grad_dense):
    (indices,) = ctx.saved_tensors
    return gather_at(grad_dense, indices, ctx.backend), None, None, None


# ---------------------------------------------- gather (densify's adjoint)
def _gather_at(dense: Tensor, indices: Tensor, backend: str) -> Tensor:
    # The CPU kernel where the backend densifies on the CPU (no int64 copy of
    # the indices); torch's gather elsewhere: on a GPU it costs less host
    # time than a kernel launch.
    if choose("densify", dense, requested=backend, dim=dense.size(1),
              k=indices.size(1)) == "cpu":
        return _module("cpu").gather_at(dense, indices)
    return torch_ops.gather_at(dense, indices)


def _gather_at_fake(dense, indices, backend):
    return dense.new_empty(indices.shape)


def _gather_at_setup(ctx, inputs, output) -> None:
    ctx.dim, ctx.backend = inputs[0].size(1), inputs[2]
    ctx.save_for_backward(inputs[1])


def _gather_at_backward(ctx, grad_values):
    (indices,) = ctx.saved_tensors
    return cbsr_to_dense(grad_values.contiguous(), indices, ctx.dim, ctx.backend), None, None


cbsr_to_dense = KernelOp("cbsr_to_dense", _cbsr_to_dense, _cbsr_to_dense_fake,
                         _cbsr_to_dense_setup, _cbsr_to_dense_backward)
#: ``dense`` at the CBSR pattern ``indices``, ``[N, k]``: the gradient of
#: :data:`cbsr_to_dense`, whose gradient is in turn this op.
gather_at = KernelOp("gather_at", _gather_at, _gather_at_fake, _gather_at_setup,
                     _gather_at_backward)


# -------------------------------------------------------------------- maxk
def _maxk_select(x: Tensor, k: int, backend: str) -> Tuple[Tensor, Tensor]:
    return _impls("select", backend, x, dim=x.size(1), k=k).maxk_select(x, k)


def _maxk_select_fake(x, k, backend):
    n, dim = x.shape
    return x.new_empty(n, k), x.new_empty(n, k, dtype=index_dtype_for(dim))


def _maxk_select_setup(ctx, inputs, output) -> None:
    x, _, backend = inputs
    ctx.set_materialize_grads(False)  # no zero-filled gradient of the indices
    ctx.dim = x.size(1)
    ctx.backend = backend
    ctx.save_for_backward(output[1])


def _maxk_select_backward(ctx, grad_values, grad_indices):
    if grad_values is None:
        return None, None, None
    (indices,) = ctx.saved_tensors
    grad_x = cbsr_to_dense(grad_values.contiguous(), indices, ctx.dim, ctx.backend)
    return grad_x, None, None


maxk_select = KernelOp("maxk_select", _maxk_select, _maxk_select_fake,
                       _maxk_select_setup, _maxk_select_backward)


# ----------------------------------------------------------- aggregation
#: The graph arguments of :data:`spgemm`, :data:`sspmm` and :data:`sddmm`, in
#: order (:class:`~pyg_maxk.graph.PackedGraph`).
NUM_GRAPH_ARGS = len(PackedGraph._fields)
#: Position of the edge values given apart among the graph arguments.
_WEIGHT_ARG = PackedGraph._fields.index("weight")


def _spgemm(index: Tensor, weight: Optional[Tensor], weight_t: Optional[Tensor],
            layout: List[int], values: Tensor, indices: Tensor, num_dst: int, dim: int,
            backend: str) -> Tensor:
    g = unpack(index, weight, weight_t, layout)
    return _impls("aggregate", backend, values, dim=dim, k=values.size(1)).spgemm(
        g, values, indices, num_dst, dim)


def _spgemm_fake(index, weight, weight_t, layout, values, indices, num_dst, dim, backend):
    weight_dtype = weight.dtype if weight is not None else layout_dtype(layout, "weight")
    return values.new_empty(num_dst, dim, dtype=aggregation_dtype(
        values.dtype, weight_dtype, layout_dtype(layout, "row_scale")))


def _save_with_graph(ctx, graph, values: Tensor, indices: Tensor,
                     scale: Optional[Tensor] = None) -> None:
    """Save the CBSR ``indices``, its ``values`` where the edge values need a
    gradient (their SDDMM reads them), the dropout ``scale`` of its values
    (None: no dropout), and the graph arguments present."""
    ctx.layout = graph[-1]
    tensors = graph[:-1]
    ctx.present = [t is not None for t in tensors]
    weight = graph[_WEIGHT_ARG]
    ctx.weight_grad = weight is not None and weight.requires_grad
    ctx.save_for_backward(indices, values if ctx.weight_grad else None, scale,
                          *[t for t in tensors if t is not None])


def _saved_with_graph(ctx):
    """``(indices, values or None, scale or None, graph arguments)`` of
    :func:`_save_with_graph`."""
    indices, values, scale, *present = ctx.saved_tensors
    present = iter(present)
    return (indices, values, scale,
            [next(present) if p else None for p in ctx.present] + [ctx.layout])


def _graph_grads(ctx, graph, values: Tensor, indices: Tensor, grad_out: Tensor) -> list:
    """The gradients of the graph arguments: the edge values' (an SDDMM)
    where they need one, None elsewhere."""
    grads = [None] * NUM_GRAPH_ARGS
    if ctx.weight_grad and ctx.needs_input_grad[ctx.graph_at + _WEIGHT_ARG]:
        weight = graph[_WEIGHT_ARG]
        grads[_WEIGHT_ARG] = sddmm(*graph, values, indices, grad_out,
                                   ctx.backend).to(weight.dtype)
    return grads


def _spgemm_setup(ctx, inputs, output) -> None:
    graph, (values, indices, _, _, backend) = inputs[:NUM_GRAPH_ARGS], inputs[NUM_GRAPH_ARGS:]
    ctx.num_src = values.size(0)
    ctx.values_dtype = values.dtype
    ctx.backend = backend
    ctx.graph_at = 0  # position of the graph arguments among the inputs
    _save_with_graph(ctx, graph, values, indices)


def _spgemm_backward(ctx, grad_out):
    indices, values, _, graph = _saved_with_graph(ctx)
    grad_out = grad_out.contiguous()
    grad_values = None
    if ctx.needs_input_grad[NUM_GRAPH_ARGS]:
        grad_values = as_dtype(sspmm(*graph, indices, grad_out, ctx.num_src, ctx.backend),
                               ctx.values_dtype)
    return (*_graph_grads(ctx, graph, values, indices, grad_out), grad_values, None, None,
            None, None)


def _sspmm(index: Tensor, weight: Optional[Tensor], weight_t: Optional[Tensor],
           layout: List[int], indices: Tensor, grad_out: Tensor, num_src: int,
           backend: str) -> Tensor:
    g = unpack(index, weight, weight_t, layout)
    return _impls("aggregate", backend, grad_out, dim=grad_out.size(1),
                  k=indices.size(1)).sspmm(g, indices, grad_out, num_src)


def _sspmm_fake(*args):
    indices, grad_out, num_src = args[NUM_GRAPH_ARGS:NUM_GRAPH_ARGS + 3]
    return grad_out.new_empty(num_src, indices.size(1))


def _sddmm(index: Tensor, weight: Optional[Tensor], weight_t: Optional[Tensor],
           layout: List[int], values: Tensor, indices: Tensor, grad_out: Tensor,
           backend: str) -> Tensor:
    g = unpack(index, weight, weight_t, layout)
    return _impls("aggregate", backend, grad_out, dim=grad_out.size(1),
                  k=indices.size(1)).sddmm(g, values, indices, grad_out)


def _sddmm_fake(index, weight, weight_t, layout, values, indices, grad_out, backend):
    return grad_out.new_empty(layout_numel(layout, "col"),
                              dtype=torch.promote_types(values.dtype, torch.float32))


#: No autograd of its own (no double backward through the aggregation).
sspmm = KernelOp("sspmm", _sspmm, _sspmm_fake)
#: The gradient of the aggregation w.r.t. its edge values (CSR order), float32
#: at least; no autograd of its own.
sddmm = KernelOp("sddmm", _sddmm, _sddmm_fake)
spgemm = KernelOp("spgemm", _spgemm, _spgemm_fake, _spgemm_setup, _spgemm_backward)


# ----------------------------------------------- select + aggregation
def _maxk_aggregate(x: Tensor, k: int, index: Tensor, weight: Optional[Tensor],
                    weight_t: Optional[Tensor], layout: List[int], num_dst: int,
                    with_dense: bool, scale: Optional[Tensor],
                    backend: str) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    dim = x.size(1)
    kernels = _one_family(x, k, backend)
    if kernels is not None:
        agg, values, indices, dense = _family_forward(
            kernels, unpack(index, weight, weight_t, layout), x, k, num_dst, with_dense, scale)
        return agg, values, indices, dense if with_dense else x.new_empty(0)
    values, indices = _maxk_select(x, k, backend)
    if scale is not None:  # dropout on the kept values (values is fresh)
        values = values.mul_(scale)
    agg = _spgemm(index, weight, weight_t, layout, values, indices, num_dst, dim, backend)
    dense = _cbsr_to_dense(values, indices, dim, backend) if with_dense else x.new_empty(0)
    return agg, values, indices, dense


def _one_family(x: Tensor, k: int, backend: str) -> Optional[str]:
    """The kernel family that runs every step of :data:`maxk_aggregate` on
    ``x`` (:func:`~pyg_maxk.dispatch.maxk_aggregate_kernels`), None where the
    steps take their backends one by one (and for no rows)."""
    if x.size(0) == 0:
        return None
    return dispatch.maxk_aggregate_kernels(x.device.type, x.dtype, x.size(1), k, backend)


def _family_forward(kernels: str, g, x: Tensor, k: int, num_dst: int, with_dense: bool,
                    scale: Optional[Tensor], sums: Optional[Tensor] = None):
    """``(agg, values, indices, dense or None)`` of :data:`maxk_aggregate` by
    one kernel family: the Numba kernels' select launch also takes the
    dropout, the dense form, the aggregation's zero-fill and that of the
    backward's ``sums`` where given
    (:func:`~pyg_maxk.ops.numba_ops.maxk_aggregate`); the CPU kernels' in
    one call (:func:`~pyg_maxk.ops.cpu_ops.maxk_aggregate`)."""
    if kernels == "numba":
        return _module("numba").maxk_aggregate(g, x, k, num_dst, with_dense, scale, sums)
    return _module("cpu").maxk_aggregate(g, x, k, num_dst, with_dense, scale)


def _family_input_grad(kernels: str, g, indices: Tensor, grad_agg: Optional[Tensor],
                       grad_values: Optional[Tensor], grad_dense: Optional[Tensor], dim: int,
                       dtype: torch.dtype, scale: Optional[Tensor],
                       sums: Optional[Tensor] = None) -> Tensor:
    """:data:`maxk_input_grad` by one kernel family, every gradient of
    ``dtype`` (float32 for the Numba kernels): the SSpMM (into the zeroed
    ``sums`` where given) and one fused densify launch, or one CPU kernel."""
    if kernels == "numba":
        return _module("numba").maxk_input_grad(g, indices, grad_agg, grad_values, grad_dense,
                                                dim, scale, sums)
    return _module("cpu").maxk_input_grad(g, indices, grad_agg, grad_values, grad_dense, dim,
                                          dtype, scale)


def _maxk_aggregate_fake(x, k, index, weight, weight_t, layout, num_dst, with_dense, scale,
                         backend):
    values, indices = _maxk_select_fake(x, k, backend)
    agg = _spgemm_fake(index, weight, weight_t, layout, values, indices, num_dst, x.size(1),
                       backend)
    return agg, values, indices, x.new_empty(x.shape if with_dense else (0,))


def _maxk_aggregate_setup(ctx, inputs, output) -> None:
    x, graph = inputs[0], inputs[2:2 + NUM_GRAPH_ARGS]
    with_dense, scale, backend = inputs[-3:]
    ctx.set_materialize_grads(False)  # unused outputs cost no zero-filled gradient
    ctx.dim, ctx.values_dtype, ctx.backend = x.size(1), x.dtype, backend
    ctx.with_dense = with_dense
    ctx.graph_at = 2
    _save_with_graph(ctx, graph, output[1], output[2], scale)


def _maxk_aggregate_backward(ctx, grad_agg, grad_values, grad_indices, grad_dense):
    indices, values, scale, graph = _saved_with_graph(ctx)
    grads = [None] * NUM_GRAPH_ARGS
    if grad_agg is not None:
        grad_agg = grad_agg.contiguous()
        grads = _graph_grads(ctx, graph, values, indices, grad_agg)
    grad_dense = grad_dense if ctx.with_dense else None
    grad_x = None
    if ctx.needs_input_grad[0] and any(t is not None for t in (grad_agg, grad_values, grad_dense)):
        grad_x = maxk_input_grad(*graph, indices, grad_agg, grad_values, grad_dense, scale,
                                 ctx.dim, ctx.values_dtype, ctx.backend)
    return (grad_x, None, *grads, None, None, None, None)


# ------------------------------ the features' gradient of maxk_aggregate
def _maxk_input_grad(index: Tensor, weight: Optional[Tensor], weight_t: Optional[Tensor],
                     layout: List[int], indices: Tensor, grad_agg: Optional[Tensor],
                     grad_values: Optional[Tensor], grad_dense: Optional[Tensor],
                     scale: Optional[Tensor], dim: int, dtype: torch.dtype,
                     backend: str) -> Tensor:
    # The gradient of the kept values (the SSpMM of the aggregation's, plus
    # the CBSR's and the dense form's own, times the dropout's scale),
    # densified into x's shape: one CPU kernel where the CPU backend runs
    # both steps on one dtype; the SSpMM and one fused densify where the
    # Numba kernels run both in float32.
    given = [t for t in (grad_agg, grad_values, grad_dense, scale) if t is not None]
    if all(t.dtype == dtype for t in given):
        kernels = dispatch.maxk_input_grad_kernels(indices.device.type, dtype, dim,
                                                   indices.size(1), backend)
        if kernels is not None:
            return _family_input_grad(kernels, unpack(index, weight, weight_t, layout), indices,
                                      grad_agg, grad_values, grad_dense, dim, dtype, scale)
    grad = None
    if grad_agg is not None:
        grad = as_dtype(_sspmm(index, weight, weight_t, layout, indices, grad_agg.contiguous(),
                               indices.size(0), backend), dtype)
    if grad_values is not None:
        grad = grad_values if grad is None else grad + grad_values
    if grad_dense is not None:
        sampled = _gather_at(grad_dense.contiguous(), indices, backend)
        grad = sampled if grad is None else grad + sampled
    if scale is not None:
        grad = as_dtype(grad * scale, dtype)
    return _cbsr_to_dense(grad.contiguous(), indices, dim, backend)


def _maxk_input_grad_fake(index, weight, weight_t, layout, indices, grad_agg, grad_values,
                          grad_dense, scale, dim, dtype, backend):
    return indices.new_empty(indices.size(0), dim, dtype=dtype)


#: The gradient of :data:`maxk_aggregate` w.r.t. its features ``[N, dim]``,
#: from those of its outputs (each None when absent) and its dropout's
#: scale (None: no dropout); no autograd of its own.
maxk_input_grad = KernelOp("maxk_input_grad", _maxk_input_grad, _maxk_input_grad_fake)


#: MaxK, dropout on the kept values (``scale``: zero or ``1 / (1 - p)`` per
#: slot; None: none), and the aggregation of the CBSR (and, asked for, its
#: dense form) as one op: one autograd node where :data:`maxk_select`,
#: the dropout and :data:`spgemm` make three, and small graphs are bound by
#: host time per node.
maxk_aggregate = KernelOp("maxk_aggregate", _maxk_aggregate, _maxk_aggregate_fake,
                          _maxk_aggregate_setup, _maxk_aggregate_backward)


# ------------------------------------------- maxk_aggregate's eager path
def maxk_aggregate_eager(x: Tensor, k: int, graph: PackedGraph, num_dst: int, with_dense: bool,
                         scale: Optional[Tensor], backend: str):
    """:data:`maxk_aggregate`'s ``(agg, values, indices, dense or None)`` in
    eager mode where one kernel family runs all its steps
    (:func:`~pyg_maxk.dispatch.maxk_aggregate_kernels`), else None (then
    call the op).

    It calls that family's implementations themselves, forward and
    backward, with one autograd node as the op's: on a small graph the op's
    own per-call layers (the pass over its thirteen arguments, a backend
    choice per step, the generic save and unpacking of the graph) cost more
    host time than the kernels. The edge values' gradient (the SDDMM) stays
    with the op: it runs only where they need no gradient."""
    kernels = _eager_kernels(x, k, graph, scale, backend)
    if kernels is None:
        return None
    if x.requires_grad and torch.is_grad_enabled():
        return _eager_maxk_aggregate(x, scale, graph, k, num_dst, with_dense, kernels,
                                     backend)
    return _family_forward(kernels, unpack(*graph), x, k, num_dst, with_dense, scale)


def _eager_kernels(x: Tensor, k: int, graph: PackedGraph, scale: Optional[Tensor],
                   backend: str) -> Optional[str]:
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return None
    if type(x) not in PLAIN_TENSORS:
        return None
    for t in (scale, graph.weight, graph.weight_t):
        if t is not None and (type(t) not in PLAIN_TENSORS or t.requires_grad):
            return None
    if torch._C._are_functorch_transforms_active():
        return None
    return _one_family(x, k, backend)


def _eager_forward(ctx, x, scale, graph, k, num_dst, with_dense, kernels, backend):
    # The Numba select launch also zeroes the backward's SSpMM sums: a
    # zero-fill fewer on autograd's device thread.
    sums = (torch.empty(x.size(0), k, dtype=torch.float32, device=x.device)
            if kernels == "numba" else None)
    agg, values, indices, dense = _family_forward(kernels, unpack(*graph), x, k, num_dst,
                                                  with_dense, scale, sums)
    ctx.set_materialize_grads(False)  # unused outputs cost no zero-filled gradient
    ctx.save_for_backward(indices, scale, *graph[:-1])
    ctx.layout, ctx.dim, ctx.dtype = graph.layout, x.size(1), x.dtype
    ctx.kernels, ctx.backend, ctx.sums = kernels, backend, sums
    return agg, values, indices, dense


def _eager_backward(ctx, grad_agg, grad_values, grad_indices, grad_dense):
    indices, scale, *graph = ctx.saved_tensors
    if grad_agg is None and grad_values is None and grad_dense is None:
        return None, None, None, None, None, None, None, None
    if grad_agg is not None:
        grad_agg = grad_agg.contiguous()
    dim, dtype = ctx.dim, ctx.dtype
    if torch.is_grad_enabled() or any(t is not None and t.dtype != dtype
                                      for t in (grad_agg, grad_values, grad_dense)):
        # create_graph=True (the op's gradient op refuses a second derivative
        # instead of dropping its terms), or gradients of another type.
        grad_x = maxk_input_grad(*graph, ctx.layout, indices, grad_agg, grad_values, grad_dense,
                                 scale, dim, dtype, ctx.backend)
    else:
        # The zeroed sums serve one backward (retain_graph=True may run more).
        sums, ctx.sums = (ctx.sums if grad_agg is not None else None), None
        grad_x = _family_input_grad(ctx.kernels, unpack(*graph, ctx.layout), indices, grad_agg,
                                    grad_values, grad_dense, dim, dtype, scale, sums)
    return grad_x, None, None, None, None, None, None, None


# Named as the op's node (autograd names it "maxk_aggregate_functionBackward").
_eager_maxk_aggregate = super(torch.autograd.Function, type(
    "maxk_aggregate_function", (torch.autograd.Function,),
    {"forward": staticmethod(_eager_forward), "backward": staticmethod(_eager_backward)})).apply


def _spmm(rowptr: Tensor, col: Tensor, weight: Optional[Tensor], dense: Tensor, num_src: int,
          transpose: bool) -> Tensor:
    return torch_ops.spmm(rowptr, col, weight, dense, num_src, transpose)


def _spmm_fake(rowptr, col, weight, dense, num_src, transpose):
    return dense.new_empty(num_src if transpose else rowptr.size(0) - 1, dense.size(1),
                           dtype=aggregation_dtype(dense.dtype, dtype_of(weight), None))


def _spmm_setup(ctx, inputs, output) -> None:
    rowptr, col, weight, dense, num_src, transpose = inputs
    ctx.weight_grad = weight is not None and weight.requires_grad
    ctx.save_for_backward(rowptr, col, weight, dense if ctx.weight_grad else None)
    ctx.num_src, ctx.transpose, ctx.dense_dtype = num_src, transpose, dense.dtype


def _spmm_backward(ctx, grad_out):
    rowptr, col, weight, dense = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_dense = grad_weight = None
    if ctx.needs_input_grad[3]:
        grad_dense = spmm(rowptr, col, weight, grad_out, ctx.num_src,
                          not ctx.transpose).to(ctx.dense_dtype)
    if ctx.weight_grad and ctx.needs_input_grad[2]:
        # Edge e = (c -> r): <dense[c], grad_out[r]> (rows and columns swap
        # for the transposed product); an [E, d] product, torch's own ops.
        row = torch_ops.edge_targets(rowptr, col.numel())
        src, dst = (row, col.long()) if ctx.transpose else (col.long(), row)
        acc = torch.promote_types(dense.dtype, torch.float32)
        grad_weight = (dense[src].to(acc) * grad_out[dst].to(acc)).sum(1).to(weight.dtype)
    return None, None, grad_weight, grad_dense, None, None


#: The aggregation of dense features (``A @ X``; ``A^T @ X`` with
#: ``transpose``), through ``torch.sparse``.
spmm = KernelOp("spmm", _spmm, _spmm_fake, _spmm_setup, _spmm_backward)


# ------------------------------------------------------------------ linear
def linear_choice(requested: str, values: Tensor, dim: int) -> str:
    """Which implementation runs the CBSR linear map (operands of one dtype)."""
    return choose("linear", values, requested=requested, dim=dim, k=values.size(1),
                  large=values.size(0) >= dispatch.LINEAR_MIN_ROWS)


def _cbsr_linear(values: Tensor, indices: Tensor, dim: int, weight: Tensor,
                 bias: Optional[Tensor], dense: Optional[Tensor],
                 dense_weight: Optional[Tensor], backend: str) -> Tensor:
    chosen = linear_choice(backend, values, dim)
    if chosen == "torch":  # the dense path, with the requested backend's densify
        out = torch_ops.cbsr_linear(values, indices, dim, weight, bias,
                                    _densify(backend, values, dim))
    else:
        out = _module(chosen).cbsr_linear(values, indices, dim, weight, bias)
    if dense is not None:
        # In place into the fresh output (cuBLAS's beta = 1): no copy of
        # ``out``, which an out-of-place addmm makes first.
        out.addmm_(dense, dense_weight.t())
    return out


def _cbsr_linear_fake(values, indices, dim, weight, bias, dense, dense_weight, backend):
    return values.new_empty(values.size(0), weight.size(0))


def _cbsr_linear_setup(ctx, inputs, output) -> None:
    values, indices, dim, weight, bias, dense, dense_weight, backend = inputs
    ctx.dim, ctx.backend = dim, backend
    ctx.save_for_backward(values, indices, weight, dense, dense_weight)


def _cbsr_linear_backward(ctx, grad_out):
    values, indices, weight, dense, dense_weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    grad_out = grad_out.contiguous()
    grad_values = grad_weight = grad_bias = grad_dense = grad_dense_weight = None
    if need[0] or need[3] or need[4]:
        grad_values, grad_weight, grad_bias = cbsr_linear_backward(
            grad_out, values, indices, weight, ctx.dim, need[0], need[3], need[4], ctx.backend)
        grad_values = grad_values if need[0] else None
        grad_weight = grad_weight if need[3] else None
        grad_bias = grad_bias if need[4] else None
    if need[5]:
        grad_dense = grad_out @ dense_weight
    if need[6]:
        grad_dense_weight = grad_out.t() @ dense
    return (grad_values, None, None, grad_weight, grad_bias, grad_dense, grad_dense_weight,
            None)


def _cbsr_linear_backward_impl(grad_out: Tensor, values: Tensor, indices: Tensor,
                               weight: Tensor, dim: int, need_values: bool, need_weight: bool,
                               need_bias: bool, backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    # The densify backend's densify, sampling and column sums: the numba
    # kernels wherever they take the CBSR, else torch's.
    dense_ops = _impls("densify", backend, values, dim=dim, k=values.size(1))
    if linear_choice(backend, values, dim) == "cpu":
        grads = _module("cpu").cbsr_linear_backward(grad_out, values, indices, weight, dim,
                                                    need_values, need_weight)
    else:
        # The numba kernel's backward is the dense path's: cuBLAS GEMMs.
        grads = torch_ops.cbsr_linear_backward(grad_out, values, indices, weight, dim,
                                               need_values, need_weight,
                                               dense_ops.cbsr_to_dense, dense_ops.gather_at)
    grad_values, grad_weight = grads
    # torch's sum(0) of a short [N, out] costs less host time than a launch;
    # over many rows it stays far below the bandwidth that the kernel reaches
    # (whose float atomics deterministic mode rules out).
    large = grad_out.size(0) >= dispatch.LINEAR_MIN_ROWS
    kernel_sums = large and dispatch.float_atomics_allowed()
    column_sums = dense_ops.column_sums if kernel_sums else torch_ops.column_sums
    grad_bias = column_sums(grad_out) if need_bias else None
    # Custom ops return tensors: an empty one stands for a gradient not asked for.
    return (grad_values if grad_values is not None else values.new_empty(0),
            grad_weight if grad_weight is not None else weight.new_empty(0),
            grad_bias if grad_bias is not None else grad_out.new_empty(0))


def _cbsr_linear_backward_fake(grad_out, values, indices, weight, dim, need_values,
                               need_weight, need_bias, backend):
    return (values.new_empty(values.shape) if need_values else values.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else weight.new_empty(0),
            grad_out.new_empty(grad_out.size(1)) if need_bias else grad_out.new_empty(0))


cbsr_linear_backward = KernelOp("cbsr_linear_backward", _cbsr_linear_backward_impl,
                                _cbsr_linear_backward_fake)
cbsr_linear = KernelOp("cbsr_linear", _cbsr_linear, _cbsr_linear_fake, _cbsr_linear_setup,
                       _cbsr_linear_backward)

#: Every op of this module, for tests (opcheck) and docs.
ALL_OPS = (maxk_select, cbsr_to_dense, gather_at, spgemm, maxk_aggregate, maxk_input_grad,
           sspmm, sddmm, spmm, cbsr_linear, cbsr_linear_backward)
