"""Forward SpGEMM (CSR x CBSR -> dense) and backward SSpMM (the gradient of
the CBSR values), both row-wise over the same balanced work items.

A work item is a run of at most ``max_edges`` edges of one CSR row (see
:class:`pyg_maxk.graph.WorkSchedule`). One *warp* takes one item at a time
(grid-stride over all warps of the grid), so a row of 50,000 edges is spread
over many warps while a short row costs one warp and no block-wide barrier.

A lane reads ``width`` consecutive CBSR slots with one load (1, 2 or 4:
:func:`spgemm_vector_width`, :func:`sspmm_vector_width`): one 4-, 8- or
16-byte load of values and one word of as many indices. The lanes of a warp
are split into ``groups`` of ``min(k / width, 32)`` lanes; lane ``j`` of a
group owns slots ``j * width`` to ``j * width + width - 1`` (and those 32
lanes further, ... when a row is wider than the group). A group takes one
neighbour at a time, so its lanes touch the ``k`` *distinct* columns of that
neighbour's CBSR row: their updates never collide.

Forward, for item (row r, edges e0..e1), every group g with its own
shared-memory row ``acc[g, :dim]`` (rows :data:`ROW_PAD` floats apart, so
that groups adding the same popular column hit different banks)::

    acc[:] = 0
    for each neighbour s = col[e] taken by group g, lane j:
        acc[g, indices[s, j]] += a_e * values[s, j]    # plain load/add/store
        syncwarp                                         # next neighbour may hit the same column
    out[r, :] = s_r * sum_g acc[g, :]    (atomic adds when the row spans several items)

where ``a_e`` is the edge's value, or 1 when the graph gives a per-row scale
``s_r`` instead (a mean without edge values: ``a_e = 1 / deg(r)`` on every
edge of row ``r``), which is then applied once per output entry rather than
once per edge and slot (H200, Reddit-shaped graph, dim 256: k=8 2.19 -> 2.06
ms, k=32 5.60 -> 5.32 ms; ``s_r`` is 1 otherwise).

No shared-memory atomics: floating-point ``atomicAdd`` on shared memory
(a compare-and-swap loop, ``ATOMS.CAST.SPIN``, in sm_90 SASS) was
measured to dominate the previous, block-per-item kernel on an H200 (16.5 ms
with atomics vs 6.7 ms with racy plain stores, Reddit-shaped graph, k=32,
dim 256).

Backward (outer-product style, from the same CSR)::

    buf[:] = s_r * grad_out[r, :]               # the warp's shared row
    for each neighbour s = col[e] taken by group g, lane j:
        grad_values[s, j] += a_e * buf[indices[s, j]]    # coalesced global atomics,
                                                         # one vector atomic per lane (sm_90)

Each lane keeps several neighbours' loads in flight (:func:`spgemm_unroll`
forward, ``SSPMM_UNROLL`` backward): the warp stages a round of column ids
in shared memory (:func:`staged_round`, coalesced loads), then issues the
loads of several of those neighbours before using any. The CBSR arrays are
passed flattened (``[N * k]``), or to the forward as (value, index) pairs
(:func:`reads_pairs`). What the SASS (``cuobjdump -sass``, H200) showed and
what was done about it:

* loop bounds mixing signed and unsigned integers were compared in float64
  (Numba types int64 with uint64 as float64): ``I2F.F64`` + ``DSETP`` in the
  inner loop. Every index is now uint32 (which also drops the wraparound code
  Numba emits for signed indices);
* the forward multiplied by the edge weight inside each neighbour's guarded
  load, so each load was waited for before the next was issued. Its loads are
  now unconditional (clamped to a real neighbour) and all issued first
  (k=8: 3.66 -> 2.7 ms). The backward keeps guarded loads: its atomics never
  wait on them, and that measured faster (k=32: 5.4 vs 7.0 ms);
* loads in flight per warp matter more than warps per SM: at 4 neighbours
  per lane (56 registers, 36 warps/SM) the forward took 6.55 ms at k=32 and
  2.54 ms at k=8; at 8 neighbours capped to 64 registers (32 warps/SM) it
  takes 5.77 and 2.34 ms. Capping 4 neighbours to 40 registers for full
  occupancy was slower (spills), and the gather below at 36 instead of 64
  warps/SM is only 7% slower. :func:`spgemm_unroll` keeps 4 where 8
  measured slower (k < 8 and k > 32);
* both kernels stage 128 neighbours per round for ``k <= 32`` (32 before):
  fewer stage-and-sync rounds, and at small k a step's ``groups * unroll``
  neighbours no longer run past the staged ones (clamped forward loads that
  only cost, idle backward lanes). Forward at dim 256, 32 / 128 staged: k=1
  3.70 / 2.64 ms, k=2 3.38 / 2.15, k=4 2.84 / 2.37, k=8 2.63 / 2.29, k=16
  3.96 / 3.38, k=32 6.33 / 6.03; dims 64 and 512 gain likewise. Backward:
  k=2 2.71 / 2.36, k=8 2.50 / 2.41, k=32 5.35 / 4.97 (dim 512: 6.06 /
  5.16). At k=64 (two slots per lane) 128 staged was no faster (forward
  10.85 / 11.26, backward 11.12 / 11.06 ms), so it keeps 32. A software-
  pipelined forward (each update followed by the next step's load into the
  registers it frees) measured no faster than this at any k <= 8 and dim
  tried, and mostly slower (dim 256: k=2 2.61 vs 2.18 ms, k=8 2.47 vs
  2.24 ms), so a step's loads are still all issued, then all used.

Reading ``width`` slots per load (``vector_load``, ``LDG.E.128`` at 4)
was the last large step. ``benchmarks/gather_ceiling.py`` reads exactly the
CBSR rows the forward reads, the same way, and nothing else: at k=32, dim 256
on the Reddit-shaped graph that gather took 4.5 ms with one 4-byte load per
slot (about 130 G sectors/s, which an earlier version of this note took for
the L2's limit) and 2.0-2.1 ms with 16-byte loads (275-282 G sectors/s): the
number of load instructions, not the bytes, had limited it. The forward went
from 5.3 to 4.6 ms and the backward from 4.9 to 4.5 ms (its vector atomic,
``REDG.E.ADD.F32x4``, adds 4 slots at once). At k=8 the gather stayed at
1.56 ms whatever the width, while the values alone took 0.92 ms and one
64-byte row per neighbour, read with one load instruction, 0.87 ms: every
load instruction of a neighbour's row costs an L2 request, however few
sectors it touches, and values and indices in separate arrays take two. Up
to k=16 the forward therefore reads (value, index) pairs, one or two slots
per load (:func:`reads_pairs`): k=8 2.03 -> 1.81 ms, k=4 2.14 -> 1.58 ms.

What remains at k=32 is the shared-memory accumulation: its columns are
random, so the read-add-write of a warp's 32 lanes meets about 3.5-way bank
conflicts (simulated for MaxK rows), and a probe giving every lane a
conflict-free column (same loads, same instructions) ran in 3.6 instead of
4.6 ms. The select kernel now writes each CBSR row in bank-major order
(:mod:`.maxk_select`), so a lane's consecutive slots fall in different banks
and the groups' rows, ``ROW_PAD`` apart, shift them further: about 2.9-way
conflicts simulated, 4.15-4.29 ms measured (two runs). Shared memory has no
float add on sm_90 (``atomicAdd`` compiles to a compare-and-swap loop), so
the rest stays unless the accumulation leaves shared memory.

The backward is bound by its global reductions: a kernel issuing only them
(``benchmarks/reduction_ceiling.py``, same lanes and widths) took 4.05 ms at
k=32, dim 256 on the Reddit-shaped graph (3.6 TB/s of float32 added) against
4.53 ms for the SSpMM, and 1.72 against 2.2 ms at k <= 8. Two slots per
reduction took about as long as four (4.14 vs 4.03 ms), so the bytes, not the
instructions, set that floor.

MaxK's columns are not uniform on real features: in a Reddit-trained SAGE
layer one column was in every row and 27-29 in more than half, so the groups
of a warp kept adding to the same column of their rows at once, all in one
bank while the rows were ``dim`` floats apart. :data:`ROW_PAD` fixed that
(same measurement as there).

Lanes synchronise with :func:`~._warp.warp_sync` (``syncwarp``; in Numba's
simulator ``syncthreads`` on one-warp blocks), so every loop bound below is
warp-uniform.
"""
from __future__ import annotations

import functools
from typing import Tuple

from ._numba import cuda_module, kernel_jit
from ._vector import vector_atomic_add, vector_load
from ._warp import WARP, warp_sync

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import float32, uint32, uint64  # noqa: E402 (after the numpy shim)

#: Neighbours whose loads a lane of the backward issues before it uses them.
SSPMM_UNROLL = 8
#: Register cap of both kernels. Uncapped, 8 loads in flight take 64-80
#: registers; at 64 ptxas spills at most 20 bytes and 32 warps fit per SM.
MAX_REGISTERS = 64
#: Static shared memory a kernel may use (the CUDA default per block).
SHARED_BYTES = 48 * 1024
#: Floats between the forward's shared rows beyond ``dim``. MaxK picks the
#: same popular columns in many rows (a Reddit-trained SAGE layer: some
#: column in every row, 27-29 columns in more than half), so the groups of a
#: warp, each adding a different neighbour to its own row, hit the same
#: column at once; with rows ``dim`` floats apart (a multiple of 32 banks)
#: those are bank conflicts. An odd stride puts them in different banks.
#: H200, such layers' CBSR, Reddit-shaped graph, dim 256: k=8 2.11 / 2.86 ->
#: 1.90 / 1.86 ms, k=32 (4 slots per load) 4.95 / 5.28 -> 4.35 / 4.31 ms; on
#: random features no change.
ROW_PAD = 1


def spgemm_vector_width(k: int) -> int:
    """CBSR slots a lane of the forward reads per load (one 4-, 8- or 16-byte
    load of values, one word of indices), as measured on an H200 (Reddit-
    shaped graph, dim 256; 1 / 2 / 4 slots): k=8 2.04 / 2.36 / - ms, k=16
    3.05 / 2.90 / 3.35 ms, k=32 5.31 / 4.70 / 4.63 ms, k=64 10.0 / 9.21 /
    8.27 ms. At k=8 wider loads do not pay (the separate load of indices
    costs an L2 request either way; see :func:`reads_pairs`); at k=16, 4
    slots per lane put 8 neighbours side by side, whose shared rows cost
    occupancy."""
    if k >= 32 and k % 4 == 0:
        return 4
    return 2 if k >= 16 and k % 2 == 0 else 1


def sspmm_vector_width(k: int) -> int:
    """CBSR slots a lane of the backward reads and adds to at once (one
    vector reduction), as measured on an H200 (as above; 1 / 2 / 4 slots):
    k=8 2.26 / 2.16 / - ms, k=16 3.11 / 3.00 / 2.96 ms, k=32 4.94 / 4.59 /
    4.50 ms, k=64 10.39 / - / 10.42 ms."""
    if k >= 16 and k % 4 == 0:
        return 4
    return 2 if k >= 8 and k % 2 == 0 else 1


def neighbour_lanes(k: int, width: int = 1) -> int:
    """Lanes that read one neighbour's CBSR row, ``width`` slots each."""
    return min(k // width, WARP)


def staged_round(k: int) -> int:
    """Neighbours a kernel stages in shared memory per round: 128 while a
    lane owns one slot (``k <= 32``), else 32, as measured (module docs)."""
    return 128 if k <= WARP else WARP


def group_rows(k: int, dim: int, warps: int, width: int = 1) -> Tuple[int, int]:
    """``(groups, row stride)`` of the forward kernel: neighbours a warp
    processes side by side, one per :func:`neighbour_lanes` lanes, each with
    its own shared row, capped so that the rows fit in shared memory (0 groups
    when even one row per warp does not fit). Rows are padded by
    :data:`ROW_PAD` unless that costs a group (k=2, dim 256: 10 instead of
    11)."""
    staging = warps * staged_round(k) * 8
    wanted = WARP // neighbour_lanes(k, width)

    def fitting(stride: int) -> int:
        return max(0, min(wanted, (SHARED_BYTES - staging) // (4 * stride * warps)))

    padded = fitting(dim + ROW_PAD)
    return (padded, dim + ROW_PAD) if padded == fitting(dim) else (fitting(dim), dim)


def spgemm_unroll(k: int, width: int = 1) -> int:
    """Neighbours whose loads a lane of the forward issues before it applies
    their updates: 8 for ``8 <= k <= 32`` with 4-byte loads, else 4, as
    measured on an H200 (Reddit-shaped graph, dim 256, staging 32 neighbours
    per round; 4 / 8 neighbours: k=2 3.6 / 4.4 ms, k=4 2.9 / 3.3 ms, k=8 2.5
    / 2.4 ms, k=32 6.6 / 5.9 ms, k=64 10.9 / 12.8 ms; at k=64 a lane already
    has two slots per neighbour). With 2 or 4 slots per load the warp
    already has ``32 / lanes`` neighbours per load, and 4 measured best
    (k=32, 4 slots, 2 / 4 / 8 neighbours: 4.73 / 4.63 / 5.05 ms; k=16, 2
    slots, 4 / 8: 2.90 / 2.99 ms)."""
    if width > 1:
        return 4
    return 8 if 8 <= k <= WARP else 4


#: Largest ``k`` for which the forward reads the CBSR as (value, index) pairs
#: (:func:`reads_pairs`); beyond it a row of pairs spans more than a cache line.
PAIRS_MAX_K = 16


def reads_pairs(k: int) -> bool:
    """Whether the forward can read the CBSR as ``[N, k, 2]`` float32 (value,
    index) pairs: a lane then gets a slot's value and its column with *one*
    8-byte load (16 bytes for 2 slots), and a neighbour's whole row with one
    load instruction per lane, where separate arrays of values and indices
    take two instructions and two L2 requests. The number of requests, not
    of sectors, limited the gather at small k: gathering a 64-byte row with
    one instruction took 0.87 ms against 1.57 ms for the separate arrays'
    40 bytes (H200, Reddit-shaped graph, k=8). SpGEMM, dim 256, flat / pairs:
    k=1 2.50 / 1.95 ms, k=2 2.09 / 1.88, k=4 2.14 / 1.58, k=8 2.03 / 1.81,
    k=16 2.88 / 2.73 ms (rows packed into one sector, values then indices,
    read with two instructions: k=1 2.08, k=2 1.91, k=4 1.70 ms)."""
    return k <= PAIRS_MAX_K


def fits_shared_memory(k: int, dim: int, warps: int) -> bool:
    """Whether the kernels' shared rows of width ``dim`` fit."""
    return group_rows(k, dim, warps)[0] >= 1


@functools.lru_cache(maxsize=None)
def _stager(k: int, weighted: bool):
    """The device function both kernels use to stage a round of up to
    :func:`staged_round` neighbours (times ``k``: their CBSR row offsets) and
    edge values in shared memory, with coalesced loads."""
    kk = uint32(k)
    per_lane = staged_round(k) // WARP

    @cuda.jit(device=True, inline=True)
    def stage(col, weight, base, n, lane, warp, nbr, nbr_w):
        for t in range(per_lane):
            i = lane + uint32(t * WARP)
            if i < n:
                nbr[warp, i] = uint32(col[base + i]) * kk
                if weighted:
                    nbr_w[warp, i] = weight[base + i]

    return stage


@functools.lru_cache(maxsize=None)
def _index_field(index_bits: int):
    """``field(word, w)``: the ``w``-th column index packed in ``word`` (a
    CBSR index word of indices of ``index_bits`` bits each)."""
    mask = uint32((1 << index_bits) - 1)

    @cuda.jit(device=True, inline=True)
    def field(word, w):
        return uint32(word >> uint32(index_bits * w)) & mask

    return field


def _word_type(index_bits: int, width: int):
    """The integer type holding ``width`` column indices (8 or 16 bits each)."""
    return uint64 if index_bits * width > 32 else uint32


def _layout(k: int, groups: int, width: int):
    """(lanes per group, active lanes, slot chunks per lane)."""
    lanes = neighbour_lanes(k, width)
    return lanes, lanes * groups, -(-k // (lanes * width))


@functools.lru_cache(maxsize=None)
def spgemm_kernel(dim: int, k: int, threads: int, weighted: bool, scaled: bool = False,
                  width: int = 1, index_bits: int = 8, pairs: bool = False):
    """The compiled forward kernel for one ``(dim, k, threads, weighted,
    scaled, width, index_bits, pairs)``: ``weighted`` reads a value per edge,
    ``scaled`` one per row; with ``width`` 2 or 4 a lane reads that many slots
    per load and ``indices`` is the flat CBSR indices viewed as words of that
    many indices of ``index_bits`` bits each (int16, int32 or int64), else the
    flat indices. ``pairs``: ``values`` is the flat ``[N, k, 2]`` (value,
    float32 column index) pairs (:func:`reads_pairs`; ``width`` 1 or 2) and
    ``indices`` is not read."""
    if pairs and (not reads_pairs(k) or width > 2):
        raise ValueError(f"k={k}, width={width}: not read as (value, index) pairs")
    warps = threads // WARP
    groups, row_stride = group_rows(k, dim, warps, width)
    if groups < 1:
        raise ValueError(f"dim={dim} is too wide for the SpGEMM kernel's shared memory")
    lanes, active_lanes, chunks = _layout(k, groups, width)
    kk, last_slot = uint32(k), uint32(k - width)
    n_lanes, n_groups, n_warps = uint32(lanes), uint32(groups), uint32(warps)
    w32, d32, zero, one = uint32(WARP), uint32(dim), uint32(0), uint32(1)
    chunk_step, vw = uint32(lanes * width), uint32(width)
    unroll = spgemm_unroll(k, width)
    round_step = uint32(groups * unroll)
    staged = staged_round(k)
    round_size = uint32(staged)
    sync = warp_sync()
    stage = _stager(k, weighted)
    load = vector_load(width) if width > 1 else None
    load_pairs = vector_load(2 * width) if pairs else None
    field = _index_field(index_bits)
    word_type = _word_type(index_bits, width)

    @kernel_jit(max_registers=MAX_REGISTERS)
    def spgemm(item_row, item_start, item_end, item_split, col, weight, scale,
               values, indices, out, num_items):
        acc = cuda.shared.array((warps, groups, row_stride), float32)
        nbr = cuda.shared.array((warps, staged), uint32)    # neighbour * k
        nbr_w = cuda.shared.array((warps, staged), float32)
        val = cuda.local.array((unroll, width), float32)  # registers after unrolling
        pos = cuda.local.array(unroll, word_type)
        pair_pos = cuda.local.array((unroll, width), uint32)
        lane = uint32(cuda.threadIdx.x) % w32
        warp = uint32(cuda.threadIdx.x) // w32
        group = lane // n_lanes
        my_row = min(group, n_groups - one)  # idle lanes (never write) alias a real row
        slot = (lane - group * n_lanes) * vw
        active = lane < uint32(active_lanes)
        for item in range(uint32(cuda.blockIdx.x) * n_warps + warp, uint32(num_items),
                          uint32(cuda.gridDim.x) * n_warps):
            for g in range(groups):
                for d in range(lane, d32, w32):
                    acc[warp, g, d] = float32(0.0)
            e0 = uint32(item_start[item])
            e1 = uint32(item_end[item])
            sync()
            for base in range(e0, e1, round_size):
                n = min(round_size, e1 - base)
                stage(col, weight, base, n, lane, warp, nbr, nbr_w)
                sync()
                for step in range(zero, n, round_step):
                    first = step + group
                    for c in range(chunks):
                        j = slot + uint32(c) * chunk_step
                        live = active and j < kk
                        jj = min(j, last_slot)
                        # All the loads are issued before any is used, without
                        # branches: a neighbour past the round's end is clamped to
                        # its last one (always in bounds); the update skips it.
                        for u in range(unroll):
                            s = nbr[warp, min(first + uint32(u) * n_groups, n - one)] + jj
                            if pairs:
                                both = load_pairs(values, s * uint32(2))
                                for w in range(width):
                                    val[u, w] = both[2 * w]
                                    pair_pos[u, w] = uint32(both[2 * w + 1])
                            elif width == 1:
                                val[u, 0] = values[s]
                                pos[u] = uint32(indices[s])
                            else:
                                loaded = load(values, s)
                                for w in range(width):
                                    val[u, w] = loaded[w]
                                pos[u] = word_type(indices[s // vw])
                        for u in range(unroll):
                            q = first + uint32(u) * n_groups
                            if live and q < n:
                                for w in range(width):
                                    v = val[u, w]
                                    if weighted:
                                        v *= nbr_w[warp, q]
                                    if pairs:
                                        p = pair_pos[u, w]
                                    elif width == 1:
                                        p = pos[u]
                                    else:
                                        p = field(pos[u], w)
                                    acc[warp, my_row, p] += v
                            sync()  # the next neighbour may hit the same column
            split = item_split[item]
            r = uint32(item_row[item])
            row_scale = scale[r] if scaled else float32(1.0)
            for d in range(lane, d32, w32):
                total = acc[warp, 0, d]
                for g in range(1, groups):
                    total += acc[warp, g, d]
                if scaled:
                    total *= row_scale
                if split:
                    if total != float32(0.0):
                        cuda.atomic.add(out, (r, d), total)
                else:
                    out[r, d] = total
            sync()

    return spgemm


@functools.lru_cache(maxsize=None)
def sspmm_kernel(dim: int, k: int, threads: int, weighted: bool, scaled: bool = False,
                 width: int = 1, index_bits: int = 8, vector_atomics: bool = True):
    """The compiled backward kernel for one ``(dim, k, threads, weighted,
    scaled, width, index_bits, vector_atomics)``; ``indices`` (as for
    :func:`spgemm_kernel`) and ``grad_values`` are flat arrays; with ``width``
    2 or 4 a lane adds to that many slots at once, with one vector reduction
    when ``vector_atomics`` (sm_90 and later)."""
    warps = threads // WARP
    if not fits_shared_memory(k, dim, warps):
        raise ValueError(f"dim={dim} is too wide for the SSpMM kernel's shared memory")
    groups = max(1, WARP // neighbour_lanes(k, width))
    lanes, active_lanes, chunks = _layout(k, groups, width)
    kk = uint32(k)
    n_lanes, n_groups, n_warps = uint32(lanes), uint32(groups), uint32(warps)
    w32, d32, zero = uint32(WARP), uint32(dim), uint32(0)
    chunk_step, vw = uint32(lanes * width), uint32(width)
    unroll = SSPMM_UNROLL
    round_step = uint32(groups * unroll)
    staged = staged_round(k)
    round_size = uint32(staged)
    sync = warp_sync()
    stage = _stager(k, weighted)
    add = vector_atomic_add(width, vector_atomics) if width > 1 else None
    field = _index_field(index_bits)
    word_type = _word_type(index_bits, width)

    @kernel_jit(max_registers=MAX_REGISTERS)
    def sspmm(item_row, item_start, item_end, col, weight, scale, indices, grad_out,
              grad_values, num_items):
        buf = cuda.shared.array((warps, dim), float32)
        nbr = cuda.shared.array((warps, staged), uint32)    # neighbour * k
        nbr_w = cuda.shared.array((warps, staged), float32)
        at = cuda.local.array(unroll, uint32)             # registers after unrolling
        pos = cuda.local.array(unroll, word_type)
        lane = uint32(cuda.threadIdx.x) % w32
        warp = uint32(cuda.threadIdx.x) // w32
        group = lane // n_lanes
        slot = (lane - group * n_lanes) * vw
        active = lane < uint32(active_lanes)
        for item in range(uint32(cuda.blockIdx.x) * n_warps + warp, uint32(num_items),
                          uint32(cuda.gridDim.x) * n_warps):
            r = uint32(item_row[item])
            row_scale = scale[r] if scaled else float32(1.0)
            for d in range(lane, d32, w32):
                buf[warp, d] = grad_out[r, d] * row_scale if scaled else grad_out[r, d]
            e0 = uint32(item_start[item])
            e1 = uint32(item_end[item])
            for base in range(e0, e1, round_size):
                n = min(round_size, e1 - base)
                sync()  # the previous round's reads of nbr are done
                stage(col, weight, base, n, lane, warp, nbr, nbr_w)
                sync()
                for step in range(zero, n, round_step):
                    first = step + group
                    for c in range(chunks):
                        j = slot + uint32(c) * chunk_step
                        live = active and j < kk
                        # Guarded loads here (unlike the forward's clamped ones):
                        # measured faster on an H200 (k=32: 5.4 vs 7.0 ms), as
                        # the fire-and-forget atomics never wait on them.
                        for u in range(unroll):
                            q = first + uint32(u) * n_groups
                            if live and q < n:
                                s = nbr[warp, q] + j
                                at[u] = s
                                if width == 1:
                                    pos[u] = uint32(indices[s])
                                else:
                                    pos[u] = word_type(indices[s // vw])
                        for u in range(unroll):
                            q = first + uint32(u) * n_groups
                            if live and q < n:
                                a = nbr_w[warp, q] if weighted else float32(1.0)
                                if width == 1:
                                    cuda.atomic.add(grad_values, at[u], buf[warp, pos[u]] * a)
                                elif width == 2:
                                    word = pos[u]
                                    add(grad_values, at[u], buf[warp, field(word, 0)] * a,
                                        buf[warp, field(word, 1)] * a)
                                else:
                                    word = pos[u]
                                    add(grad_values, at[u], buf[warp, field(word, 0)] * a,
                                        buf[warp, field(word, 1)] * a,
                                        buf[warp, field(word, 2)] * a,
                                        buf[warp, field(word, 3)] * a)
            sync()  # buf is rewritten by the next item

    return sspmm
