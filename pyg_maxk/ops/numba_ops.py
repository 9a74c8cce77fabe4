"""The ``"numba"`` backend: the kernels of :mod:`pyg_maxk.kernels` as
``torch.library`` custom ops with fake (meta) implementations and registered
autograd, so that ``torch.compile`` treats them as opaque ops.

Kernels run on the caller's current torch CUDA stream, with no host
synchronisation. They compute in float32: float16/bfloat16 values are widened
on the way in (an ``[N, k]`` copy) and the result narrowed on the way out, so
accumulation is always float32.

Under Numba's simulator (``NUMBA_ENABLE_CUDASIM=1``) the same ops run the same
kernels on CPU tensors.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..cbsr import CBSR, index_dtype_for
from ..graph import CSRGraph, WorkSchedule
from ..kernels import cuda_module, simulator_enabled
from ..kernels._warp import WARP
from ..kernels.maxk_select import ROWS_PER_BLOCK, densify_fits, densify_kernel, select_kernel
from ..kernels.spgemm import fits_shared_memory, spgemm_kernel, sspmm_kernel

#: Threads of one SpGEMM/SSpMM block. The kernels work per warp; under the
#: simulator blocks are one warp (there ``syncthreads`` stands in for
#: ``syncwarp``).
THREADS = 128
SIM_THREADS = WARP
#: Target (edge, slot) pairs per work item (one warp's share): a row with more
#: edges than ``PAIRS_PER_ITEM // k`` is cut into several items.
PAIRS_PER_ITEM = 8192
#: Grid-stride blocks per multiprocessor.
BLOCKS_PER_SM = 16

KERNEL_DTYPE = torch.float32


# ------------------------------------------------------------------ launch
class _Launcher:
    """Launches Numba kernels on torch tensors: picks grid sizes and the
    caller's stream, and keeps the per-call host cost low.

    Numba's own launch path wraps every tensor through the CUDA Array
    Interface and re-derives every argument's type on each call (~0.1 ms per
    array argument). After the first launch of a specialisation (which goes
    through Numba, compiling if needed) we keep the compiled kernel and pass
    the tensors' pointers, shapes and strides straight to the driver, in the
    layout Numba's ``_Kernel.launch`` builds. If that internal API is missing
    (another numba-cuda version), every launch takes Numba's path.
    """

    def __init__(self) -> None:
        self.cuda = cuda_module()
        self.simulator = simulator_enabled()
        self._streams: dict = {}
        self._num_sms: dict = {}
        self._compiled: dict = {}
        self._driver_launch = None if self.simulator else _driver_launcher()

    def array(self, t: Tensor):
        t = t.detach()
        if self.simulator:
            return t.numpy()
        return self.cuda.as_cuda_array(t, sync=False)

    def stream(self, device: torch.device):
        if self.simulator:
            return 0
        ptr = torch.cuda.current_stream(device).cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            stream = self._streams[ptr] = self.cuda.external_stream(ptr)
        return stream

    def max_blocks(self, device: torch.device, threads: int) -> int:
        if self.simulator:
            return 2
        index = device.index if device.index is not None else torch.cuda.current_device()
        sms = self._num_sms.get(index)
        if sms is None:
            sms = self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return sms * max(1, BLOCKS_PER_SM * 128 // threads)

    @property
    def threads(self) -> int:
        return SIM_THREADS if self.simulator else THREADS

    def __call__(self, kernel, blocks: int, threads: int, device: torch.device, *args) -> None:
        """``kernel[blocks, threads, current stream](*args)``; ``args`` are
        tensors (C-contiguous) and Python ints."""
        stream = self.stream(device)
        key = (id(kernel),) + tuple((a.dtype, a.dim()) if isinstance(a, Tensor) else int
                                    for a in args)
        compiled = self._compiled.get(key)
        if compiled is not None and self._driver_launch is not None:
            self._driver_launch(compiled, stream, blocks, threads, args)
            return
        with self._device(device):
            arrays = [self.array(a) if isinstance(a, Tensor) else a for a in args]
            kernel[blocks, threads, stream](*arrays)
            if self._driver_launch is not None:
                types = tuple(kernel.typeof_pyval(a) for a in arrays)
                self._compiled[key] = kernel.overloads[types]

    def _device(self, device: torch.device):
        """Numba launches on its current device; make it the tensor's."""
        if self.simulator or device.index is None or torch.cuda.device_count() == 1:
            return contextlib.nullcontext()
        return self.cuda.gpus[device.index]


def _driver_launcher():
    """A launch function bypassing Numba's argument marshalling, or None."""
    try:
        import ctypes

        from numba.cuda import dispatcher as numba_dispatcher

        launch = numba_dispatcher.launch
        config_cls = numba_dispatcher.LaunchConfig
        coop = ("is_cooperative" if getattr(numba_dispatcher, "CUDA_CORE_GE_1_0", False)
                else "cooperative_launch")
    except (ImportError, AttributeError):  # pragma: no cover - other numba-cuda
        return None

    def driver_launch(compiled, stream, blocks, threads, args) -> None:
        kernel_args = []
        for a in args:
            if isinstance(a, Tensor):
                size = a.element_size()
                # meminfo, parent, nitems, itemsize, data, shape..., strides...
                kernel_args += [0, 0, a.numel(), size, a.data_ptr(), *a.shape,
                                *(s * size for s in a.stride())]
            else:
                kernel_args.append(ctypes.c_int64(a))
        config = config_cls(grid=blocks, block=threads, shmem_size=0, **{coop: False})
        launch(stream, config, compiled._codelibrary.get_cufunc().kernel, *kernel_args)

    return driver_launch


@functools.lru_cache(maxsize=None)
def launcher() -> _Launcher:
    return _Launcher()


def max_edges_per_item(k: int) -> int:
    return max(1, PAIRS_PER_ITEM // k)


# --------------------------------------------------------------- maxk ops
@torch.library.custom_op("pyg_maxk::maxk_select", mutates_args=())
def maxk_select_op(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    n, dim = x.shape
    x32 = x.detach().to(KERNEL_DTYPE).contiguous()
    values = torch.empty(n, k, dtype=KERNEL_DTYPE, device=x.device)
    indices = torch.empty(n, k, dtype=index_dtype_for(dim), device=x.device)
    if n > 0:
        run = launcher()
        rows_per_block = 1 if run.simulator else ROWS_PER_BLOCK
        threads = WARP * rows_per_block
        blocks = min(-(-n // rows_per_block), run.max_blocks(x.device, threads))
        run(select_kernel(dim, k, rows_per_block), blocks, threads, x.device, x32,
            x32.view(torch.int32), values, indices, n)
    return values.to(x.dtype), indices


@maxk_select_op.register_fake
def _(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    n, dim = x.shape
    return x.new_empty(n, k), x.new_empty(n, k, dtype=index_dtype_for(dim))


def _densify_rows_per_block() -> int:
    return 1 if launcher().simulator else ROWS_PER_BLOCK


@torch.library.custom_op("pyg_maxk::cbsr_to_dense", mutates_args=())
def cbsr_to_dense_op(values: Tensor, indices: Tensor, dim: int) -> Tensor:
    n, k = values.shape
    rows_per_block = _densify_rows_per_block()
    if not densify_fits(dim, rows_per_block):  # rows too wide for shared memory
        dense = values.detach().new_zeros(n, dim)
        return dense.scatter_(1, indices.long(), values.detach())
    v32 = values.detach().to(KERNEL_DTYPE).contiguous()
    dense = torch.empty(n, dim, dtype=KERNEL_DTYPE, device=values.device)  # rows written whole
    if n > 0:
        run = launcher()
        threads = WARP * rows_per_block
        blocks = min(-(-n // rows_per_block), run.max_blocks(values.device, threads))
        run(densify_kernel(dim, k, rows_per_block), blocks, threads, values.device, v32,
            indices.contiguous(), dense, n)
    return dense.to(values.dtype)


@cbsr_to_dense_op.register_fake
def _(values: Tensor, indices: Tensor, dim: int) -> Tensor:
    return values.new_empty(values.size(0), dim)


def _to_dense_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])


def _to_dense_backward(ctx, grad_dense):
    (indices,) = ctx.saved_tensors
    return grad_dense.gather(1, indices.long()), None, None


cbsr_to_dense_op.register_autograd(_to_dense_backward, setup_context=_to_dense_setup)


def to_dense(h: CBSR) -> Tensor:
    """``h`` as a dense ``[N, dim]`` tensor, differentiable w.r.t. ``h.values``."""
    return cbsr_to_dense_op(h.values, h.indices, h.dim)


def _maxk_setup(ctx, inputs, output) -> None:
    x, _ = inputs
    ctx.dim = x.size(1)
    ctx.save_for_backward(output[1])


def _maxk_backward(ctx, grad_values, grad_indices):
    (indices,) = ctx.saved_tensors
    return cbsr_to_dense_op(grad_values, indices, ctx.dim), None


maxk_select_op.register_autograd(_maxk_backward, setup_context=_maxk_setup)


def maxk_select(x: Tensor, k: int) -> Tuple[Tensor, Tensor]:
    """``(values [N, k], indices [N, k])`` of the ``k`` largest entries per
    row (the entries :func:`torch.topk` keeps; ties to the lowest column), in
    column order."""
    return maxk_select_op(x, k)


# ------------------------------------------------------------ SpGEMM ops
def _item_launch(num_items: int, device: torch.device):
    """(launcher, threads, blocks) for the per-warp work-item kernels."""
    run = launcher()
    threads = run.threads
    return run, threads, min(-(-num_items // (threads // WARP)), run.max_blocks(device, threads))


@torch.library.custom_op("pyg_maxk::spgemm", mutates_args=())
def spgemm_op(item_row: Tensor, item_start: Tensor, item_end: Tensor, item_split: Tensor,
              col: Tensor, weight: Optional[Tensor], values: Tensor, indices: Tensor,
              num_dst: int, dim: int) -> Tensor:
    k = values.size(1)
    out = torch.zeros(num_dst, dim, dtype=KERNEL_DTYPE, device=values.device)
    num_items = item_row.numel()
    if num_items > 0:
        run, threads, blocks = _item_launch(num_items, values.device)
        v32 = values.detach().to(KERNEL_DTYPE).contiguous()
        w = weight if weight is not None else item_start  # unread when unweighted
        run(spgemm_kernel(dim, k, threads, weight is not None), blocks, threads, values.device,
            item_row, item_start, item_end, item_split, col, w, v32.view(-1),
            indices.contiguous().view(-1), out, num_items)
    return out.to(values.dtype)


@spgemm_op.register_fake
def _(item_row, item_start, item_end, item_split, col, weight, values, indices,
      num_dst, dim):
    return values.new_empty(num_dst, dim)


@torch.library.custom_op("pyg_maxk::sspmm", mutates_args=())
def sspmm_op(item_row: Tensor, item_start: Tensor, item_end: Tensor, col: Tensor,
             weight: Optional[Tensor], indices: Tensor, grad_out: Tensor,
             num_src: int) -> Tensor:
    k = indices.size(1)
    dim = grad_out.size(1)
    grad_values = torch.zeros(num_src, k, dtype=KERNEL_DTYPE, device=grad_out.device)
    num_items = item_row.numel()
    if num_items > 0:
        run, threads, blocks = _item_launch(num_items, grad_out.device)
        g32 = grad_out.detach().to(KERNEL_DTYPE).contiguous()
        w = weight if weight is not None else item_start  # unread when unweighted
        run(sspmm_kernel(dim, k, threads, weight is not None), blocks, threads, grad_out.device,
            item_row, item_start, item_end, col, w, indices.contiguous().view(-1), g32,
            grad_values.view(-1), num_items)
    return grad_values.to(grad_out.dtype)


@sspmm_op.register_fake
def _(item_row, item_start, item_end, col, weight, indices, grad_out, num_src):
    return grad_out.new_empty(num_src, indices.size(1))


def _spgemm_setup(ctx, inputs, output) -> None:
    item_row, item_start, item_end, _, col, weight, values, indices, _, _ = inputs
    ctx.num_src = values.size(0)
    ctx.values_dtype = values.dtype
    ctx.has_weight = weight is not None
    saved = [item_row, item_start, item_end, col, indices]
    if weight is not None:
        saved.append(weight)
    ctx.save_for_backward(*saved)


def _spgemm_backward(ctx, grad_out):
    item_row, item_start, item_end, col, indices, *rest = ctx.saved_tensors
    weight = rest[0] if ctx.has_weight else None
    grad_values = sspmm_op(item_row, item_start, item_end, col, weight, indices,
                           grad_out, ctx.num_src).to(ctx.values_dtype)
    return None, None, None, None, None, None, grad_values, None, None, None


spgemm_op.register_autograd(_spgemm_backward, setup_context=_spgemm_setup)


def kernel_weight(graph: CSRGraph) -> Optional[Tensor]:
    """The graph's edge values as the kernels read them (float32), or None."""
    if graph.weight is None:
        return None
    return graph.weight if graph.weight.dtype == KERNEL_DTYPE else graph.weight.to(KERNEL_DTYPE)


def supports(k: int, dim: int) -> bool:
    """Whether the SpGEMM/SSpMM kernels take CBSR features of this shape (their
    shared-memory rows hold ``dim`` floats per warp)."""
    return fits_shared_memory(k, dim, launcher().threads // WARP)


def spgemm(graph: CSRGraph, h: CBSR) -> Tensor:
    """``graph @ h`` as ``[num_dst, dim]``, differentiable w.r.t. ``h.values``."""
    schedule: WorkSchedule = graph.schedule(max_edges_per_item(h.k))
    return spgemm_op(schedule.row, schedule.start, schedule.end, schedule.split,
                     graph.kernel_col(), kernel_weight(graph), h.values,
                     h.indices, graph.num_dst, h.dim)
