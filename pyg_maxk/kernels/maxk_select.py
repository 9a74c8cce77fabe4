"""MaxK selection: the ``k`` largest entries of every row, written straight
into CBSR, and its backward scatter.

One warp per row. Each lane holds ``ceil(dim / 32)`` entries of the row in
registers; ``k`` rounds each pick the next entry in the order (value
descending, column ascending) with a warp-wide arg-max, so the row is never
sorted and the output comes out in :func:`torch.topk` order. NaN ranks above
every number, as in :func:`torch.topk`.

The warp arg-max uses register shuffles on a GPU; Numba's simulator has no
shuffles, so there a shared-memory exchange with the same result stands in.
"""
from __future__ import annotations

import functools
import math

from ._numba import cuda_module, simulator_enabled

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import float32, int32  # noqa: E402 (after the numpy shim)

from ._warp import WARP  # noqa: E402
ROWS_PER_BLOCK = 4


@functools.lru_cache(maxsize=None)
def _device_functions():
    @cuda.jit(device=True, inline=True)
    def precedes(av, ai, bv, bi):
        """Whether entry (av, ai) comes before (bv, bi): larger value first,
        NaN largest, ties to the smaller column."""
        a_nan = av != av
        b_nan = bv != bv
        if a_nan or b_nan:
            if a_nan and b_nan:
                return ai < bi
            return a_nan
        return av > bv or (av == bv and ai < bi)

    @cuda.jit(device=True, inline=True)
    def warp_best_shfl(bv, bi, lane, warp, scratch_v, scratch_i):
        for offset in (16, 8, 4, 2, 1):
            ov = cuda.shfl_xor_sync(0xFFFFFFFF, bv, offset)
            oi = cuda.shfl_xor_sync(0xFFFFFFFF, bi, offset)
            if precedes(ov, oi, bv, bi):
                bv = ov
                bi = oi
        return bv, bi

    @cuda.jit(device=True, inline=True)
    def warp_best_shared(bv, bi, lane, warp, scratch_v, scratch_i):
        scratch_v[warp, lane] = bv
        scratch_i[warp, lane] = bi
        cuda.syncthreads()
        for other in range(WARP):
            ov = scratch_v[warp, other]
            oi = scratch_i[warp, other]
            if precedes(ov, oi, bv, bi):
                bv = ov
                bi = oi
        cuda.syncthreads()
        return bv, bi

    return precedes, warp_best_shfl, warp_best_shared


@functools.lru_cache(maxsize=None)
def select_kernel(dim: int, k: int):
    """The compiled selection kernel for one ``(dim, k)``."""
    precedes, warp_best_shfl, warp_best_shared = _device_functions()
    warp_best = warp_best_shared if simulator_enabled() else warp_best_shfl
    per_lane = math.ceil(dim / WARP)
    rows_per_block = ROWS_PER_BLOCK

    @cuda.jit
    def maxk_select(x, values, indices, num_rows):
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        scratch_v = cuda.shared.array((rows_per_block, WARP), float32)
        scratch_i = cuda.shared.array((rows_per_block, WARP), int32)
        row_vals = cuda.local.array(per_lane, float32)
        # The loop bounds are uniform across the block (the simulator's
        # reduction synchronises the whole block).
        for first in range(cuda.blockIdx.x * rows_per_block, num_rows,
                           cuda.gridDim.x * rows_per_block):
            row = first + warp
            active = row < num_rows
            for m in range(per_lane):
                c = lane + m * WARP
                row_vals[m] = x[row, c] if active and c < dim else float32(0.0)
            prev_v = float32(0.0)
            prev_i = int32(-1)
            for t in range(k):
                best_v = float32(-math.inf)
                best_i = int32(dim)  # "nothing": every real entry precedes it
                for m in range(per_lane):
                    c = lane + m * WARP
                    if c < dim:
                        v = row_vals[m]
                        if (t == 0 or precedes(prev_v, prev_i, v, c)) and (
                                best_i == dim or precedes(v, c, best_v, best_i)):
                            best_v = v
                            best_i = c
                best_v, best_i = warp_best(best_v, best_i, lane, warp, scratch_v, scratch_i)
                if active and lane == 0:
                    values[row, t] = best_v
                    indices[row, t] = best_i
                prev_v = best_v
                prev_i = best_i

    return maxk_select


@functools.lru_cache(maxsize=None)
def scatter_kernel(k: int):
    """``grad_x[r, indices[r, j]] = grad_values[r, j]`` (``grad_x`` zeroed)."""
    @cuda.jit
    def maxk_scatter(grad_values, indices, grad_x, num_rows):
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for t in range(start, num_rows * k, stride):
            r = t // k
            j = t - r * k
            grad_x[r, indices[r, j]] = grad_values[r, j]

    return maxk_scatter
