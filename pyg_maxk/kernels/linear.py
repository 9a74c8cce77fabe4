"""A linear map of CBSR rows: ``out = dense(h) @ W^T + b`` without the dense
``[N, dim]`` matrix, for the root term of MaxK SAGE (``lin_r``).

The dense path writes ``[N, dim]`` (densify) and runs a GEMM of ``2 * N *
dim * out_features`` flops, of which MaxK makes all but ``k / dim`` multiply
zeros. Here each output row is the sum of ``k`` rows of ``W^T`` scaled by the
kept values::

    out[r, c] = b[c] + sum_j values[r, j] * W^T[indices[r, j], c]

A block owns one tile of :data:`TILE` output columns (one per lane) and holds
``W^T[:, tile]`` in shared memory; its warps then take rows in turn. A warp
stages its row's values and their offsets in the tile in shared memory, and
every lane reads them back (broadcasts) and then the ``W^T`` entry of its own
column: consecutive lanes, consecutive banks. Each lane loads its share of
the warp's next row before it sums the current one, so that the load latency
hides behind the sums. The cost is about a fixed part per row and tile plus
shared-memory reads per slot, while the dense path's depends on ``dim``
alone: :func:`linear_pays` says where the kernel wins (``benchmarks/kernels.py``
measures both).
"""
from __future__ import annotations

import functools

from ._half import widen
from ._numba import cuda_module, kernel_jit
from ._warp import WARP, cbsr_row_loader, warp_sync

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import float32, uint32  # noqa: E402 (after the numpy shim)

#: Output columns per block: one per lane of every warp.
TILE = WARP
#: Warps of a block on a GPU (the simulator runs one-warp blocks).
LINEAR_WARPS = 8
#: Static shared memory a block may use (the CUDA default per block).
LINEAR_SHARED_BYTES = 48 * 1024


def linear_shared_bytes(dim: int, k: int, warps: int = LINEAR_WARPS) -> int:
    """Shared memory of a block: a ``W^T`` tile of ``dim`` rows and the
    warps' staged rows."""
    return 4 * (dim * TILE + warps * 2 * k)


def linear_fits(dim: int, k: int, warps: int = LINEAR_WARPS) -> bool:
    """Whether a block's shared memory fits (``dim <= 368`` at ``k <= 32``)."""
    return linear_shared_bytes(dim, k, warps) <= LINEAR_SHARED_BYTES


def linear_pays(dim: int, k: int) -> bool:
    """Whether the kernel beats densify + GEMM: ``k <= max(16, dim / 8)``, the
    boundary ``benchmarks/kernels.py`` finds over dims 64-512."""
    return k <= max(16, dim // 8)


#: Slots per lane of the next row that a warp loads into registers before it
#: works on the current one (slots beyond are loaded when their row is staged).
LINEAR_AHEAD = 4


@functools.lru_cache(maxsize=None)
def linear_kernel(dim: int, k: int, out_features: int, warps: int, has_bias: bool):
    """The compiled kernel for one ``(dim, k, out_features, warps, has_bias)``.

    Arguments: ``values [N, k]`` float32, ``indices [N, k]`` (uint8/int16),
    ``weight_t [dim, out_features]`` float32 (``W^T``, contiguous), ``bias
    [out_features]`` (not read unless ``has_bias``), ``out [N,
    out_features]`` float32 (every entry written), ``num_rows``. Launch with
    ``warps * 32`` threads and a multiple of ``ceil(out_features / 32)``
    blocks."""
    if not linear_fits(dim, k, warps):
        raise ValueError(f"dim={dim}, k={k}: too wide for the linear kernel's shared memory")
    tiles = column_tiles(out_features)
    threads = warps * WARP
    tile_floats = dim * TILE  # shared array sizes: constants
    stage_shape = (warps, k)
    sync = warp_sync()
    ahead = min(-(-k // WARP), LINEAR_AHEAD)
    load_ahead = cbsr_row_loader(k, ahead)
    rest_from = uint32(ahead * WARP)
    kk, w32, n_out = uint32(k), uint32(WARP), uint32(out_features)
    n_tiles, n_warps, tile_width = uint32(tiles), uint32(warps), uint32(TILE)

    @kernel_jit()
    def linear(values, indices, weight_t, bias, out, num_rows):
        w_tile = cuda.shared.array(tile_floats, float32)
        stage_val = cuda.shared.array(stage_shape, float32)
        stage_pos = cuda.shared.array(stage_shape, uint32)  # offsets in w_tile
        val = cuda.local.array(ahead, float32)  # registers after unrolling
        pos = cuda.local.array(ahead, uint32)
        tid = uint32(cuda.threadIdx.x)
        lane = tid % w32
        warp = tid // w32
        tile = uint32(cuda.blockIdx.x) % n_tiles
        first_col = tile * tile_width
        for t in range(tid, uint32(tile_floats), uint32(threads)):
            c = first_col + t % tile_width
            w_tile[t] = weight_t[t // tile_width, c] if c < n_out else float32(0.0)
        cuda.syncthreads()
        col = first_col + lane
        b = float32(0.0)
        if has_bias and col < n_out:
            b = bias[col]
        n = uint32(num_rows)
        step = (uint32(cuda.gridDim.x) // n_tiles) * n_warps
        row = (uint32(cuda.blockIdx.x) // n_tiles) * n_warps + warp
        if row < n:
            load_ahead(values, indices, row, lane, val, pos)
        while row < n:  # warp-uniform
            following = row + step
            for c in range(ahead):
                j = lane + uint32(c * WARP)
                if j < kk:
                    stage_val[warp, j] = val[c]
                    stage_pos[warp, j] = pos[c] * tile_width
            for j in range(lane + rest_from, kk, w32):
                stage_val[warp, j] = values[row, j]
                stage_pos[warp, j] = uint32(indices[row, j]) * tile_width
            if following < n:  # the next row's loads fly while this one is summed
                load_ahead(values, indices, following, lane, val, pos)
            sync()
            acc = float32(0.0)
            for j in range(k):
                acc += stage_val[warp, j] * w_tile[stage_pos[warp, j] + lane]
            if col < n_out:
                out[row, col] = acc + b
            sync()  # the stage is rewritten for the next row
            row = following

    return linear


def column_tiles(out_features: int) -> int:
    """Tiles of :data:`TILE` output columns (the last one may be partial)."""
    return -(-out_features // TILE)


def linear_blocks(out_features: int, row_blocks: int) -> int:
    """Blocks of a launch: ``row_blocks`` per tile of output columns."""
    return column_tiles(out_features) * max(1, row_blocks)


#: Rows a thread of :func:`column_sum_kernel` loads before it adds any.
COLUMN_SUM_UNROLL = 8


@functools.lru_cache(maxsize=None)
def column_sum_kernel(columns: int, half: str = ""):
    """``out[c] += sum_r x[r, c]`` over the rows of ``x`` (float32, or the
    16-bit patterns of the ``half`` type), in float32: the gradient of a
    bias. ``out`` (float32 ``[columns]``) starts from zero.

    Thread ``t`` of the first ``R * columns`` threads of the grid sums
    column ``t % columns`` over rows ``t // columns``, ``+ R``, ``+ 2R``, ...
    (``R`` = :func:`column_sum_slices`): consecutive threads read consecutive
    entries of a row, and each thread keeps :data:`COLUMN_SUM_UNROLL` loads
    in flight. Then one float32 atomic add per thread; a column gets ``R``.
    (torch's ``sum(0)`` over the rows of a narrow ``[N, dim]`` stays far
    below the memory bandwidth.)"""
    cols = uint32(columns)
    unroll = COLUMN_SUM_UNROLL
    value_of = widen(half)

    @kernel_jit()
    def column_sum(x, out, num_rows, slices):
        t = uint32(cuda.blockIdx.x) * uint32(cuda.blockDim.x) + uint32(cuda.threadIdx.x)
        n, step = uint32(num_rows), uint32(slices)
        if t >= step * cols:
            return
        c = t % cols
        r = t // cols
        loaded = cuda.local.array(unroll, float32)  # registers after unrolling
        total = float32(0.0)
        span = step * uint32(unroll)
        last = span - step
        while r + last < n:  # the unroll's rows all exist
            for u in range(unroll):
                loaded[u] = value_of(x[r + uint32(u) * step, c])
            for u in range(unroll):
                total += loaded[u]
            r += span
        while r < n:
            total += value_of(x[r, c])
            r += step
        cuda.atomic.add(out, c, total)

    return column_sum


def column_sum_slices(num_rows: int, columns: int, resident_threads: int) -> int:
    """Row slices of :func:`column_sum_kernel`: enough threads to fill the
    GPU once, at most one per row."""
    return max(1, min(num_rows, resident_threads // max(1, columns)))
