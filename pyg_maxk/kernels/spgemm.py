"""Forward SpGEMM (CSR x CBSR -> dense) and backward SSpMM (the gradient of
the CBSR values), both row-wise over the same balanced work items.

A work item is a run of at most ``max_edges`` edges of one CSR row (see
:class:`pyg_maxk.graph.WorkSchedule`). One *warp* takes one item at a time
(grid-stride over all warps of the grid), so a row of 50,000 edges is spread
over many warps while a short row costs one warp and no block-wide barrier.

The lanes of a warp are split into ``groups`` of ``min(k, 32)`` lanes; lane
``j`` of a group owns CBSR slot ``j`` (and ``j + 32``, ... when ``k > 32``).
A group takes one neighbour at a time, so its lanes touch the ``k`` *distinct*
columns of that neighbour's CBSR row: their updates never collide.

Forward, for item (row r, edges e0..e1), every group g with its own
shared-memory row ``acc[g, :dim]``::

    acc[:] = 0
    for each neighbour s = col[e] taken by group g, lane j:
        acc[g, indices[s, j]] += a_e * values[s, j]    # plain load/add/store
        syncwarp                                         # next neighbour may hit the same column
    out[r, :] = sum_g acc[g, :]      (atomic adds when the row spans several items)

No shared-memory atomics: floating-point ``atomicAdd`` on shared memory
(likely a compare-and-swap loop in SASS; not checked with cuobjdump) was
measured to dominate the previous, block-per-item kernel on an H200 (16.5 ms
with atomics vs 6.7 ms with racy plain stores, Reddit-shaped graph, k=32,
dim 256).

Backward (outer-product style, from the same CSR)::

    buf[:] = grad_out[r, :]                     # the warp's shared row
    for each neighbour s = col[e] taken by group g, lane j:
        grad_values[s, j] += a_e * buf[indices[s, j]]    # coalesced global atomics

Both kernels are bound by the latency of the dependent chain
``col[e] -> values/indices[s, j] -> shared row``, so each lane keeps ``UNROLL``
neighbours in flight: the warp loads 32 column ids at once (one coalesced
load), then the loads of ``UNROLL`` neighbours are issued before their
updates. The CBSR arrays are passed flattened (``[N * k]``) and indexed with
uint32 arithmetic (no negative-index wraparound code).

Lanes synchronise with :func:`~._warp.warp_sync` (``syncwarp``; in Numba's
simulator ``syncthreads`` on one-warp blocks), so every loop bound below is
warp-uniform.
"""
from __future__ import annotations

import functools

from ._numba import cuda_module
from ._warp import WARP, warp_sync

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import float32, uint32  # noqa: E402 (after the numpy shim)

#: Neighbours whose loads a lane issues before it applies their updates.
UNROLL = 4
#: Static shared memory a kernel may use (the CUDA default per block).
SHARED_BYTES = 48 * 1024


def lane_groups(k: int, dim: int, warps: int) -> int:
    """Neighbours a warp processes side by side in the forward kernel: one
    per ``min(k, 32)`` lanes, capped so that the per-group rows fit in shared
    memory (0 when even one row per warp does not fit)."""
    rows_that_fit = (SHARED_BYTES - warps * WARP * 8) // (4 * dim * warps)
    return max(0, min(max(1, WARP // k), rows_that_fit))


def fits_shared_memory(k: int, dim: int, warps: int) -> bool:
    """Whether the kernels' shared rows of width ``dim`` fit."""
    return lane_groups(k, dim, warps) >= 1


@functools.lru_cache(maxsize=None)
def _helpers(k: int, weighted: bool):
    """Device functions both kernels share: staging a round of up to 32
    neighbours in shared memory, and the ``UNROLL`` neighbours a lane takes."""
    kk = uint32(k)

    @cuda.jit(device=True, inline=True)
    def stage(col, weight, base, n, lane, warp, nbr, nbr_w):
        if lane < n:
            nbr[warp, lane] = uint32(col[base + lane]) * kk
            if weighted:
                nbr_w[warp, lane] = weight[base + lane]

    @cuda.jit(device=True, inline=True)
    def take(step, group, groups, n, ok):
        """Round-local neighbour numbers q0..q3 and whether each is real."""
        q0 = step + group
        q1 = q0 + groups
        q2 = q1 + groups
        q3 = q2 + groups
        return q0, q1, q2, q3, ok and q0 < n, ok and q1 < n, ok and q2 < n, ok and q3 < n

    return stage, take


def _layout(k: int, groups: int):
    """(lanes per group, active lanes, slot chunks per lane)."""
    lanes = min(k, WARP)
    return lanes, lanes * groups, -(-k // WARP)


@functools.lru_cache(maxsize=None)
def spgemm_kernel(dim: int, k: int, threads: int, weighted: bool):
    """The compiled forward kernel for one ``(dim, k, threads, weighted)``."""
    warps = threads // WARP
    groups = lane_groups(k, dim, warps)
    if groups < 1:
        raise ValueError(f"dim={dim} is too wide for the SpGEMM kernel's shared memory")
    lanes, active_lanes, chunks = _layout(k, groups)
    kk = uint32(k)
    sync = warp_sync()
    stage, take = _helpers(k, weighted)

    # The four neighbours' loads are spelled out on purpose: moving them into a
    # device function (with an early return for absent neighbours) made the
    # k=32 kernel 7.2 -> 10.3 ms on an H200 (and SSpMM 5.9 -> 7.7 ms).
    @cuda.jit
    def spgemm(item_row, item_start, item_end, item_split, col, weight,
               values, indices, out, num_items):
        acc = cuda.shared.array((warps, groups, dim), float32)
        nbr = cuda.shared.array((warps, WARP), uint32)    # neighbour * k
        nbr_w = cuda.shared.array((warps, WARP), float32)
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        group = lane // lanes
        slot = uint32(lane - group * lanes)
        active = lane < active_lanes
        for item in range(cuda.blockIdx.x * warps + warp, num_items, cuda.gridDim.x * warps):
            for g in range(groups):
                for d in range(lane, dim, WARP):
                    acc[warp, g, d] = float32(0.0)
            e0 = uint32(item_start[item])
            e1 = uint32(item_end[item])
            sync()
            for base in range(e0, e1, uint32(WARP)):
                n = min(uint32(WARP), e1 - base)
                stage(col, weight, base, n, lane, warp, nbr, nbr_w)
                sync()
                for step in range(0, n, groups * UNROLL):
                    for c in range(chunks):
                        j = slot + uint32(c * WARP)
                        q0, q1, q2, q3, ok0, ok1, ok2, ok3 = take(step, group, groups, n,
                                                                  active and j < kk)
                        v0 = v1 = v2 = v3 = float32(0.0)
                        i0 = i1 = i2 = i3 = 0
                        if ok0:
                            s = nbr[warp, q0] + j
                            v0 = values[s]
                            i0 = indices[s]
                            if weighted:
                                v0 *= nbr_w[warp, q0]
                        if ok1:
                            s = nbr[warp, q1] + j
                            v1 = values[s]
                            i1 = indices[s]
                            if weighted:
                                v1 *= nbr_w[warp, q1]
                        if ok2:
                            s = nbr[warp, q2] + j
                            v2 = values[s]
                            i2 = indices[s]
                            if weighted:
                                v2 *= nbr_w[warp, q2]
                        if ok3:
                            s = nbr[warp, q3] + j
                            v3 = values[s]
                            i3 = indices[s]
                            if weighted:
                                v3 *= nbr_w[warp, q3]
                        if ok0:
                            acc[warp, group, i0] += v0
                        sync()
                        if ok1:
                            acc[warp, group, i1] += v1
                        sync()
                        if ok2:
                            acc[warp, group, i2] += v2
                        sync()
                        if ok3:
                            acc[warp, group, i3] += v3
                        sync()
            split = item_split[item]
            r = item_row[item]
            for d in range(lane, dim, WARP):
                total = acc[warp, 0, d]
                for g in range(1, groups):
                    total += acc[warp, g, d]
                if split:
                    if total != 0:
                        cuda.atomic.add(out, (r, d), total)
                else:
                    out[r, d] = total
            sync()

    return spgemm


@functools.lru_cache(maxsize=None)
def sspmm_kernel(dim: int, k: int, threads: int, weighted: bool):
    """The compiled backward kernel for one ``(dim, k, threads, weighted)``;
    ``indices`` and ``grad_values`` are flattened ``[N * k]`` arrays."""
    warps = threads // WARP
    if not fits_shared_memory(k, dim, warps):
        raise ValueError(f"dim={dim} is too wide for the SSpMM kernel's shared memory")
    groups = max(1, WARP // k)
    lanes, active_lanes, chunks = _layout(k, groups)
    kk = uint32(k)
    sync = warp_sync()
    stage, take = _helpers(k, weighted)

    @cuda.jit
    def sspmm(item_row, item_start, item_end, col, weight, indices, grad_out,
              grad_values, num_items):
        buf = cuda.shared.array((warps, dim), float32)
        nbr = cuda.shared.array((warps, WARP), uint32)    # neighbour * k
        nbr_w = cuda.shared.array((warps, WARP), float32)
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        group = lane // lanes
        slot = uint32(lane - group * lanes)
        active = lane < active_lanes
        for item in range(cuda.blockIdx.x * warps + warp, num_items, cuda.gridDim.x * warps):
            r = item_row[item]
            for d in range(lane, dim, WARP):
                buf[warp, d] = grad_out[r, d]
            e0 = uint32(item_start[item])
            e1 = uint32(item_end[item])
            for base in range(e0, e1, uint32(WARP)):
                n = min(uint32(WARP), e1 - base)
                sync()  # the previous round's reads of nbr are done
                stage(col, weight, base, n, lane, warp, nbr, nbr_w)
                sync()
                for step in range(0, n, groups * UNROLL):
                    for c in range(chunks):
                        j = slot + uint32(c * WARP)
                        q0, q1, q2, q3, ok0, ok1, ok2, ok3 = take(step, group, groups, n,
                                                                  active and j < kk)
                        s0 = s1 = s2 = s3 = uint32(0)
                        i0 = i1 = i2 = i3 = 0
                        if ok0:
                            s0 = nbr[warp, q0] + j
                            i0 = indices[s0]
                        if ok1:
                            s1 = nbr[warp, q1] + j
                            i1 = indices[s1]
                        if ok2:
                            s2 = nbr[warp, q2] + j
                            i2 = indices[s2]
                        if ok3:
                            s3 = nbr[warp, q3] + j
                            i3 = indices[s3]
                        if ok0:
                            g = buf[warp, i0]
                            if weighted:
                                g *= nbr_w[warp, q0]
                            cuda.atomic.add(grad_values, s0, g)
                        if ok1:
                            g = buf[warp, i1]
                            if weighted:
                                g *= nbr_w[warp, q1]
                            cuda.atomic.add(grad_values, s1, g)
                        if ok2:
                            g = buf[warp, i2]
                            if weighted:
                                g *= nbr_w[warp, q2]
                            cuda.atomic.add(grad_values, s2, g)
                        if ok3:
                            g = buf[warp, i3]
                            if weighted:
                                g *= nbr_w[warp, q3]
                            cuda.atomic.add(grad_values, s3, g)
            sync()  # buf is rewritten by the next item

    return sspmm
