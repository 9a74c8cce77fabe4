"""The ``"numba"`` backend: the kernels of :mod:`pyg_maxk.kernels` as
differentiable ops (:class:`KernelOp`): ``torch.library`` custom ops with fake
(meta) implementations and registered autograd, so that ``torch.compile``
treats them as opaque ops, and the same code as plain autograd Functions in
eager mode.

Kernels run on the caller's current torch CUDA stream, with no host
synchronisation. They compute in float32: float16/bfloat16 values are widened
on the way in (an ``[N, k]`` copy) and the result narrowed on the way out, so
accumulation is always float32.

Under Numba's simulator (``NUMBA_ENABLE_CUDASIM=1``) the same ops run the same
kernels on CPU tensors.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..cbsr import CBSR, index_dtype_for
from ..graph import CSRGraph, WorkSchedule
from ..kernels._warp import WARP
from ..kernels.linear import (LINEAR_WARPS, column_tiles, linear_blocks, linear_fits,
                              linear_kernel, linear_pays, linear_shared_bytes)
from ..kernels.maxk_select import ROWS_PER_BLOCK, densify_fits, densify_kernel, select_kernel
from ..kernels.spgemm import (fits_shared_memory, reads_pairs, spgemm_kernel,
                              spgemm_vector_width, sspmm_kernel, sspmm_vector_width)
from . import as_dtype
from ._launch import device_index, launcher

#: Threads of one SpGEMM/SSpMM block. The kernels work per warp; under the
#: simulator blocks are one warp (there ``syncthreads`` stands in for
#: ``syncwarp``).
THREADS = 128
SIM_THREADS = WARP
#: Target (edge, slot) pairs per work item (one warp's share): a row with more
#: edges than ``PAIRS_PER_ITEM // k`` is cut into several items.
PAIRS_PER_ITEM = 8192
KERNEL_DTYPE = torch.float32
UINT32_MAX = 2**32 - 1
#: Edges from which the forward reads the CBSR as (value, index) pairs
#: (:func:`value_index_pairs`, :func:`~pyg_maxk.kernels.spgemm.reads_pairs`).
#: Building them costs two copy launches (about 28 us of host time; 0.04 ms
#: on an H200 for a Reddit-shaped CBSR) and saves one L2 request per edge
#: (k=8: 0.22 ms over 114M edges, about 2 us per million edges).
PAIRS_MIN_EDGES = 1 << 24


def _kernel_input(t: Tensor) -> Tensor:
    """``t`` as the kernels read it: float32 and C-contiguous, with no copy
    when it is. The kernels take raw pointers, so a tensor that requires a
    gradient needs no ``detach`` (each no-op ``to``/``detach`` costs 1-2 us
    of host time, and small graphs are host-bound)."""
    return as_dtype(t, KERNEL_DTYPE).contiguous()


def block_threads() -> int:
    """Threads of one SpGEMM/SSpMM block here (one warp in the simulator)."""
    return SIM_THREADS if launcher().simulator else THREADS


def max_edges_per_item(k: int) -> int:
    return max(1, PAIRS_PER_ITEM // k)


class KernelOp:
    """One kernel op, callable two ways with the same implementation and
    autograd:

    * ``op``: a ``torch.library`` custom op with a fake implementation and
      registered autograd, what ``torch.compile`` sees (opaque) and what
      :func:`torch.library.opcheck` checks;
    * in eager mode, the implementation itself when no input needs a
      gradient, else a classic (``forward(ctx, ...)``) autograd Function
      around it. Host time of a Cora-sized densify on an H200 host: 43 us
      through the custom op, 25 us this way; with an input that needs a
      gradient 67 vs 40 us. (A Function with a separate ``setup_context``
      binds its arguments through :mod:`inspect` on every call: 82 us.)
    """

    def __init__(self, name: str, impl, fake, setup_context=None, backward=None) -> None:
        self.impl = impl
        self.op = torch.library.custom_op(f"pyg_maxk::{name}", impl, mutates_args=())
        self.op.register_fake(fake)
        self.function = None
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup_context)

            def forward(ctx, *args):
                output = impl(*args)
                setup_context(ctx, args, output)
                return output

            self.function = type(f"{name}_function", (torch.autograd.Function,), {
                "forward": staticmethod(forward),
                "backward": staticmethod(backward),
            })

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        if self.function is not None and torch.is_grad_enabled() and any(
                isinstance(a, Tensor) and a.requires_grad for a in args):
            return self.function.apply(*args)
        return self.impl(*args)


# --------------------------------------------------------------- maxk ops
def _rows_per_block() -> int:
    """Rows (one per warp) of a select/densify block here (one warp in the
    simulator)."""
    return 1 if launcher().simulator else ROWS_PER_BLOCK


def _row_launch(num_rows: int, device: torch.device):
    """(launcher, rows per block, threads, blocks) for the warp-per-row kernels."""
    run = launcher()
    rows_per_block = _rows_per_block()
    threads = WARP * rows_per_block
    return (run, rows_per_block, threads,
            min(-(-num_rows // rows_per_block), run.max_blocks(device, threads)))


def _maxk_select(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    n, dim = x.shape
    x32 = _kernel_input(x)
    values = torch.empty(n, k, dtype=KERNEL_DTYPE, device=x.device)
    indices = torch.empty(n, k, dtype=index_dtype_for(dim), device=x.device)
    if n > 0:
        run, rows_per_block, threads, blocks = _row_launch(n, x.device)
        kernel = select_kernel(dim, k, rows_per_block, _has_redux(x.device))
        run(kernel, blocks, threads, x.device, x32, x32.view(torch.int32), values, indices, n)
    return as_dtype(values, x.dtype), indices


def _maxk_select_fake(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    n, dim = x.shape
    return x.new_empty(n, k), x.new_empty(n, k, dtype=index_dtype_for(dim))


def _cbsr_to_dense(values: Tensor, indices: Tensor, dim: int) -> Tensor:
    n, k = values.shape
    v32 = _kernel_input(values)
    dense = torch.empty(n, dim, dtype=KERNEL_DTYPE, device=values.device)  # rows written whole
    if n > 0:
        run, rows_per_block, threads, blocks = _row_launch(n, values.device)
        run(densify_kernel(dim, k, rows_per_block), blocks, threads, values.device, v32,
            indices.contiguous(), dense, n)
    return as_dtype(dense, values.dtype)


def _cbsr_to_dense_fake(values: Tensor, indices: Tensor, dim: int) -> Tensor:
    return values.new_empty(values.size(0), dim)


def _to_dense_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])


def _to_dense_backward(ctx, grad_dense):
    (indices,) = ctx.saved_tensors
    return grad_dense.gather(1, indices.long()), None, None


cbsr_to_dense_op = KernelOp("cbsr_to_dense", _cbsr_to_dense, _cbsr_to_dense_fake,
                            _to_dense_setup, _to_dense_backward)


def _maxk_setup(ctx, inputs, output) -> None:
    x, _ = inputs
    ctx.dim = x.size(1)
    ctx.save_for_backward(output[1])


def _maxk_backward(ctx, grad_values, grad_indices):
    (indices,) = ctx.saved_tensors
    return cbsr_to_dense_op(grad_values, indices, ctx.dim), None


maxk_select_op = KernelOp("maxk_select", _maxk_select, _maxk_select_fake,
                          _maxk_setup, _maxk_backward)


def supports_to_dense(dim: int) -> bool:
    """Whether the densify kernel takes rows of width ``dim`` (one row per
    warp in shared memory); MaxK's widths (:data:`~pyg_maxk.ops.MAX_SELECT_DIM`)
    always fit."""
    return densify_fits(dim, _rows_per_block())


def to_dense(h: CBSR) -> Tensor:
    """``h`` as a dense ``[N, dim]`` tensor, differentiable w.r.t. ``h.values``
    (``h.dim`` within :func:`supports_to_dense`)."""
    return cbsr_to_dense_op(h.values, h.indices, h.dim)


def maxk_select(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """``(values [N, k], indices [N, k])`` of the ``k`` largest entries per
    row (the entries :func:`torch.topk` keeps; ties to the lowest column), in
    bank-major order (by column mod 32, then column; see
    :mod:`~pyg_maxk.kernels.maxk_select`)."""
    return maxk_select_op(x, k)


# ------------------------------------------------------------ linear op
def _linear_warps() -> int:
    return 1 if launcher().simulator else LINEAR_WARPS


def _cbsr_linear(values: Tensor, indices: Tensor, dim: int, weight: Tensor,
                 bias: Optional[Tensor]) -> Tensor:
    n, k = values.shape
    out_features = weight.size(0)
    out = torch.empty(n, out_features, dtype=KERNEL_DTYPE, device=values.device)
    if n > 0 and out_features > 0:
        run = launcher()
        warps = _linear_warps()
        threads = warps * WARP
        # One wave: every block has the same number of rows per tile.
        resident = run.resident_blocks(values.device, threads,
                                       linear_shared_bytes(dim, k, warps))
        row_blocks = min(-(-n // warps), max(1, resident // column_tiles(out_features)))
        kernel = linear_kernel(dim, k, out_features, warps, bias is not None)
        weight_t = as_dtype(weight, KERNEL_DTYPE).t().contiguous()
        run(kernel, linear_blocks(out_features, row_blocks), threads, values.device,
            _kernel_input(values), indices.contiguous(), weight_t,
            _or_unread(_as_kernel_dtype(bias), weight_t), out, n)
    return out


def _cbsr_linear_fake(values: Tensor, indices: Tensor, dim: int, weight: Tensor,
                      bias: Optional[Tensor]) -> Tensor:
    return values.new_empty(values.size(0), weight.size(0), dtype=KERNEL_DTYPE)


#: No autograd of its own: :func:`pyg_maxk.ops.cbsr_linear` calls it from its
#: autograd Function's forward.
cbsr_linear_op = KernelOp("cbsr_linear", _cbsr_linear, _cbsr_linear_fake)


def supports_linear(dim: int, k: int) -> bool:
    """Whether :func:`cbsr_linear` takes CBSR rows of this shape (a ``W^T``
    tile of ``dim`` rows in shared memory)."""
    return linear_fits(dim, k, _linear_warps())


#: Rows from which the layers use :func:`cbsr_linear`. On a Cora-sized
#: graph (2,708 rows) a SAGE epoch took 4.05 ms with it, 3.45 ms before it
#: and 3.35 ms with this threshold (H200; host-bound there, the cause not
#: pinned down); its gain is on large graphs.
LINEAR_MIN_ROWS = 1 << 15


def prefers_linear(num_rows: int, dim: int, k: int) -> bool:
    """Whether :func:`cbsr_linear` takes this shape and beats densify + GEMM
    there (:func:`~pyg_maxk.kernels.linear.linear_pays`, and at least
    :data:`LINEAR_MIN_ROWS` rows)."""
    return num_rows >= LINEAR_MIN_ROWS and supports_linear(dim, k) and linear_pays(dim, k)


def cbsr_linear(values: Tensor, indices: Tensor, dim: int, weight: Tensor,
                bias: Optional[Tensor]) -> Tensor:
    """``dense(h) @ weight.T + bias`` as float32 ``[N, out_features]`` from
    the CBSR ``(values, indices)`` of width ``dim``, not differentiable."""
    return cbsr_linear_op(values, indices, dim, weight, bias)


# ------------------------------------------------------------ SpGEMM ops
def _item_launch(num_items: int, device: torch.device):
    """(launcher, threads, blocks) for the per-warp work-item kernels."""
    run = launcher()
    threads = block_threads()
    return run, threads, min(-(-num_items // (threads // WARP)), run.max_blocks(device, threads))


#: Integer types of 2, 4 and 8 bytes: words of indices the kernels read at once.
_WORD_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _index_operand(indices: Tensor, width: int, *aligned: Tensor) -> Tuple[Tensor, int, int]:
    """``(indices as the kernels read them, slots per load, bits per index)``.

    The kernels read ``width`` slots per load when the flat indices (uint8 or
    int16) can be viewed as words of that many indices and every float32
    array read or written that many slots at a time (``aligned``) is aligned
    to it (a fresh tensor is; a view into another may not be); else 1.
    """
    flat = indices.contiguous().view(-1)
    bits = 8 * flat.element_size()
    word_bytes = width * flat.element_size()
    if (width == 1 or flat.dtype not in (torch.uint8, torch.int16)
            or flat.data_ptr() % word_bytes or any(t.data_ptr() % (4 * width) for t in aligned)):
        return flat, 1, bits
    return flat.view(_WORD_DTYPES[word_bytes]), width, bits


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _has_redux(device: torch.device) -> bool:
    """Whether the GPU has the ``redux.sync`` warp reduction (sm_80 and later)."""
    return device.type == "cuda" and _capability(device_index(device)) >= (8, 0)


def _has_vector_atomics(device: torch.device) -> bool:
    """Whether the GPU has float32 vector atomics (sm_90 and later); asked on
    every backward, so the capability is read once per device."""
    return device.type == "cuda" and _capability(device_index(device)) >= (9, 0)


def value_index_pairs(values: Tensor, indices: Tensor) -> Tensor:
    """``[N, k, 2]`` float32: each slot's value (as float32) beside its column
    index (as float32, exact below 2**24), the CBSR as the forward reads it
    on large graphs (:func:`~pyg_maxk.kernels.spgemm.reads_pairs`)."""
    pairs = torch.empty(*values.shape, 2, dtype=KERNEL_DTYPE, device=values.device)
    pairs[..., 0] = values.detach()
    pairs[..., 1] = indices
    return pairs


def _uses_pairs(k: int, num_edges: int) -> bool:
    """Whether the forward reads the CBSR as (value, index) pairs: where the
    kernel can (:func:`~pyg_maxk.kernels.spgemm.reads_pairs`), on graphs of
    :data:`PAIRS_MIN_EDGES` edges and more."""
    return reads_pairs(k) and num_edges >= PAIRS_MIN_EDGES


def _spgemm_operands(values: Tensor, indices: Tensor, num_edges: int):
    """``(values, indices, width, index bits, pairs)`` as the forward kernel
    reads them: (value, index) pairs where :func:`_uses_pairs` (the kernel
    reads no ``indices`` then), else the flat arrays."""
    k = values.size(1)
    if _uses_pairs(k, num_edges):
        pairs = value_index_pairs(values, indices).view(-1)
        return pairs, pairs, spgemm_vector_width(k), 8 * indices.element_size(), True
    v32 = _kernel_input(values).view(-1)
    words, width, bits = _index_operand(indices, spgemm_vector_width(k), v32)
    return v32, words, width, bits, False


def _spgemm(item_row: Tensor, item_start: Tensor, item_end: Tensor, item_split: Tensor,
            zeroed_rows: Tensor, col: Tensor, weight: Optional[Tensor],
            row_scale: Optional[Tensor], values: Tensor, indices: Tensor, num_dst: int,
            dim: int) -> Tensor:
    k = values.size(1)
    # Only the rows no single item writes whole start from zero, not all of
    # [num_dst, dim]: at Reddit's size, dim 256, k=8 (24,940 of 232,965 rows)
    # 0.034 instead of 0.073 ms on an H200, beside a 1.87 ms product.
    out = torch.empty(num_dst, dim, dtype=KERNEL_DTYPE, device=values.device)
    if zeroed_rows.numel() > 0:
        out.index_fill_(0, zeroed_rows, 0.0)
    num_items = item_row.numel()
    if num_items > 0:
        run, threads, blocks = _item_launch(num_items, values.device)
        v32, index_words, width, bits, pairs = _spgemm_operands(values, indices, col.numel())
        kernel = spgemm_kernel(dim, k, threads, weight is not None, row_scale is not None,
                               width, bits, pairs)
        run(kernel, blocks, threads, values.device, item_row, item_start, item_end, item_split,
            col, _or_unread(weight, item_start), _or_unread(row_scale, item_start),
            v32, index_words, out, num_items)
    return as_dtype(out, values.dtype)


def _spgemm_fake(item_row, item_start, item_end, item_split, zeroed_rows, col, weight,
                 row_scale, values, indices, num_dst, dim):
    return values.new_empty(num_dst, dim)


def _or_unread(optional: Optional[Tensor], stand_in: Tensor) -> Tensor:
    """A kernel argument the kernel was compiled not to read when absent."""
    return optional if optional is not None else stand_in


def _sspmm(item_row: Tensor, item_start: Tensor, item_end: Tensor, col: Tensor,
           weight: Optional[Tensor], row_scale: Optional[Tensor], indices: Tensor,
           grad_out: Tensor, num_src: int) -> Tensor:
    k = indices.size(1)
    dim = grad_out.size(1)
    grad_values = torch.zeros(num_src, k, dtype=KERNEL_DTYPE, device=grad_out.device)
    num_items = item_row.numel()
    if num_items > 0:
        run, threads, blocks = _item_launch(num_items, grad_out.device)
        g32 = _kernel_input(grad_out)
        index_words, width, bits = _index_operand(indices, sspmm_vector_width(k),
                                                   grad_values)
        kernel = sspmm_kernel(dim, k, threads, weight is not None, row_scale is not None,
                              width, bits, _has_vector_atomics(grad_out.device))
        run(kernel, blocks, threads, grad_out.device, item_row, item_start, item_end, col,
            _or_unread(weight, item_start), _or_unread(row_scale, item_start),
            index_words, g32, grad_values.view(-1), num_items)
    return as_dtype(grad_values, grad_out.dtype)


def _sspmm_fake(item_row, item_start, item_end, col, weight, row_scale, indices, grad_out,
                num_src):
    return grad_out.new_empty(num_src, indices.size(1))


sspmm_op = KernelOp("sspmm", _sspmm, _sspmm_fake)


def _spgemm_setup(ctx, inputs, output) -> None:
    item_row, item_start, item_end, _, _, col, weight, row_scale, values, indices, _, _ = inputs
    ctx.num_src = values.size(0)
    ctx.values_dtype = values.dtype
    ctx.has_weight, ctx.has_row_scale = weight is not None, row_scale is not None
    saved = [item_row, item_start, item_end, col, indices]
    saved += [t for t in (weight, row_scale) if t is not None]
    ctx.save_for_backward(*saved)


def _spgemm_backward(ctx, grad_out):
    item_row, item_start, item_end, col, indices, *rest = ctx.saved_tensors
    weight = rest.pop(0) if ctx.has_weight else None
    row_scale = rest.pop(0) if ctx.has_row_scale else None
    grad_values = sspmm_op(item_row, item_start, item_end, col, weight, row_scale, indices,
                           grad_out, ctx.num_src)
    grad_values = as_dtype(grad_values, ctx.values_dtype)
    return None, None, None, None, None, None, None, None, grad_values, None, None, None


spgemm_op = KernelOp("spgemm", _spgemm, _spgemm_fake, _spgemm_setup, _spgemm_backward)


def _as_kernel_dtype(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else as_dtype(t, KERNEL_DTYPE)


def kernel_weights(graph: CSRGraph) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(edge values, row scale)`` as the kernels read them (float32): the
    row scale alone when the graph has one, else the edge values (or None)."""
    if graph.row_scale is not None:
        return None, _as_kernel_dtype(graph.row_scale)
    return _as_kernel_dtype(graph.weight), None


def supports(k: int, dim: int) -> bool:
    """Whether the SpGEMM/SSpMM kernels take CBSR features of this shape (their
    shared-memory rows hold ``dim`` floats per warp)."""
    return fits_shared_memory(k, dim, block_threads() // WARP)


def check_cbsr_offsets(num_rows: int, k: int, num_edges: int) -> None:
    """Raise unless the kernels' uint32 offsets reach every CBSR slot (``row *
    k + slot``, twice that where the forward reads (value, index) pairs)."""
    slots = num_rows * k * (2 if _uses_pairs(k, num_edges) else 1)
    if slots > UINT32_MAX:
        raise ValueError(
            f"The pyg_maxk kernels index CBSR slots with uint32 and these features "
            f"need {slots} ({num_rows} rows, k={k}; limit {UINT32_MAX}). Split the "
            f"graph (e.g. NeighborLoader) or use the 'torch' backend.")


def spgemm(graph: CSRGraph, h: CBSR) -> Tensor:
    """``graph @ h`` as ``[num_dst, dim]``, differentiable w.r.t. ``h.values``.
    A graph with a per-row scale (a mean without edge values) is aggregated
    unweighted and scaled once per output row."""
    check_cbsr_offsets(h.num_rows, h.k, graph.num_edges)
    schedule: WorkSchedule = graph.schedule(max_edges_per_item(h.k))
    weight, row_scale = kernel_weights(graph)
    return spgemm_op(schedule.row, schedule.start, schedule.end, schedule.split,
                     schedule.zeroed_rows, graph.kernel_col(), weight, row_scale, h.values,
                     h.indices, graph.num_dst, h.dim)
