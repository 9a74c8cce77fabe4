"""Forward SpGEMM (CSR x CBSR -> dense), backward SSpMM (the gradient of the
CBSR values) and SDDMM (the gradient of the edge values), all row-wise over
the same balanced work items.

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
shared-memory row ``acc[g, :dim]`` (rows :data:`ROW_PAD` floats apart)::

    acc[:] = 0
    for each neighbour s = col[e] taken by group g, lane j:
        acc[g, indices[s, j]] += a_e * values[s, j]    # plain load/add/store
        syncwarp                                         # next neighbour may hit the same column
    out[r, :] = s_r * sum_g acc[g, :]    (rounded once to out's type)

A row that spans several items (a split row) is summed instead with float32
atomic adds into its row of a separate float32 array, ``partial``, which
:func:`zeroed_rows_kernel` then stores into ``out``
(:class:`pyg_maxk.graph.WorkSchedule`): the partial sums of a
half-precision output stay float32 until the last one.

where ``a_e`` is the edge's value, or 1 when the graph gives a per-row scale
``s_r`` instead (a mean without edge values), applied once per output entry
(``s_r`` is 1 otherwise). No shared-memory atomics: a float ``atomicAdd`` on
shared memory is a compare-and-swap loop on sm_90.

Backward (outer-product style, from the same CSR)::

    buf[:] = s_r * grad_out[r, :]               # the warp's shared row
    for each neighbour s = col[e] taken by group g, lane j:
        grad_values[s, j] += a_e * buf[indices[s, j]]    # coalesced global atomics,
                                                         # one vector atomic per lane (sm_90)

Edge values' gradient (:func:`sddmm_kernel`)::

    buf[:] = grad_out[r, :]
    for each edge e = (c -> r) taken by a lane:
        grad_weight[e] = sum_j values[c, j] * buf[indices[c, j]]    # one writer per edge

Each lane of the forward and backward keeps several neighbours' loads in
flight (:func:`spgemm_unroll` forward, ``SSPMM_UNROLL`` backward): the warp
stages a round of column ids in shared memory (:func:`staged_round`,
coalesced loads), then issues the loads of several of those neighbours
before using any. The forward's loads are unconditional (clamped to a real
neighbour), the backward's guarded (its atomics never wait on them). Every
index is uint32: Numba compares mixed signed/unsigned loop bounds in
float64. The CBSR arrays are passed flattened (``[N * k]``), or to the
forward as (value, index) pairs (:func:`reads_pairs`): one L2 request per
neighbour instead of two.

Lanes synchronise with :func:`~._warp.warp_sync` (``syncwarp``; in Numba's
simulator ``syncthreads`` on one-warp blocks), so every loop bound that
reaches a barrier is warp-uniform. Why the kernels are built this way and
what limits them now: ``docs/design.md``.
"""
from __future__ import annotations

import functools
from typing import Tuple

from ._half import narrow, pair_word, widen
from ._numba import cuda_module, kernel_jit, simulator_enabled
from ._vector import PACKED_HALF_SLOTS, packed_half_atomic_add, vector_atomic_add, vector_load
from ._warp import FULL_MASK, WARP, thread_span, warp_sync

# Module-level name `cuda`: Numba's simulator swaps exactly this global.
cuda = cuda_module()
from numba import float32, int16, uint32, uint64  # noqa: E402 (after the numpy shim)

#: Neighbours whose loads a lane of the backward issues before it uses them.
SSPMM_UNROLL = 8
#: Register cap of both kernels. Uncapped, 8 loads in flight take 64-80
#: registers; at 64 ptxas spills at most 20 bytes and 32 warps fit per SM.
MAX_REGISTERS = 64
#: Static shared memory a kernel may use (the CUDA default per block).
SHARED_BYTES = 48 * 1024
#: Floats between the forward's shared rows beyond ``dim``. MaxK picks the
#: same popular columns in many rows (a trained layer keeps some columns in
#: most rows), so the groups of a warp, each adding a different neighbour to
#: its own row, hit the same column at once; with rows ``dim`` floats apart
#: (a multiple of 32 banks) those are bank conflicts. An odd stride puts them
#: in different banks (``benchmarks/bank_conflicts.py`` simulates the layouts).
ROW_PAD = 1


def spgemm_vector_width(k: int) -> int:
    """CBSR slots a lane of the forward reads per load (one 4-, 8- or 16-byte
    load of values, one word of indices), the best of 1, 2 and 4 in
    ``benchmarks/kernels.py``. At k=8 wider loads do not pay (the
    separate load of indices costs an L2 request either way; see
    :func:`reads_pairs`); at k=16, 4 slots per lane put 8 neighbours side by
    side, whose shared rows cost occupancy."""
    if k >= 32 and k % 4 == 0:
        return 4
    return 2 if k >= 16 and k % 2 == 0 else 1


def sspmm_vector_width(k: int) -> int:
    """CBSR slots a lane of the backward reads and adds to at once (one
    vector reduction), the best of 1, 2 and 4 (as above)."""
    if k >= 16 and k % 4 == 0:
        return 4
    return 2 if k >= 8 and k % 2 == 0 else 1


def neighbour_lanes(k: int, width: int = 1) -> int:
    """Lanes that read one neighbour's CBSR row, ``width`` slots each."""
    return min(k // width, WARP)


def staged_round(k: int) -> int:
    """Neighbours a kernel stages in shared memory per round: 128 while a
    lane owns one slot (``k <= 32``), else 32, the best of the sizes the
    module docs name."""
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
    their updates: 8 for ``8 <= k <= 32`` with 4-byte loads, else 4: the
    gather is latency-bound, so loads in flight per warp matter more than
    warps per SM. With 2 or 4 slots per load the warp already has
    ``32 / lanes`` neighbours per load, and 4 suffices."""
    if width > 1:
        return 4
    return 8 if 8 <= k <= WARP else 4


#: Largest ``k`` for which the forward reads the CBSR as (value, index) pairs
#: (:func:`reads_pairs`); beyond it a row of pairs spans more than a cache line
#: (128 bytes: 16 float32 pairs, 32 packed half-precision ones).
PAIRS_MAX_K = 16
HALF_PAIRS_MAX_K = 32
#: Bits of a packed half-precision pair below its column index.
_PAIR_SHIFT = uint32(16)


def reads_pairs(k: int, half: bool = False) -> bool:
    """Whether the forward can read the CBSR as (value, index) pairs: ``[N,
    k, 2]`` float32 (the index as a float), or, for half-precision values,
    ``[N, k]`` 32-bit words (the value's 16 bits below the index's). A lane
    then gets a slot's value and its column with *one* load (one 16-byte
    load for 2 float32 pairs or 4 half ones), and a neighbour's whole row
    with one load instruction per lane, where separate arrays of values and
    indices take two instructions and two L2 requests. The number of
    requests, not of sectors, limits the gather at small k
    (``benchmarks/gather_ceiling.py``), so pairs are faster up to a cache
    line per row (:data:`PAIRS_MAX_K`, :data:`HALF_PAIRS_MAX_K`)."""
    return k <= (HALF_PAIRS_MAX_K if half else PAIRS_MAX_K)


def pair_width_fits(width: int, half: bool = False) -> bool:
    """Whether a lane's ``width`` pairs are one load (at most 16 bytes)."""
    return width <= (4 if half else 2)


@functools.lru_cache(maxsize=None)
def pairs_kernel(half: bool):
    """``pairs[2 s] = values[s]``, ``pairs[2 s + 1] = indices[s]``: the flat
    CBSR as the (value, index) pairs of :func:`reads_pairs`, in one pass.
    With ``half``, ``values`` and ``pairs`` hold 16-bit patterns (``int16``)
    and each pair is one 32-bit word, the value in its low half and the
    index (below 2**16) in its high half; else they are float32 and the
    index is a float (exact below 2**24). One thread per slot (grid-stride)."""
    element = int16 if half else float32
    span = thread_span()

    @kernel_jit()
    def pack(values, indices, pairs, num_slots):
        first, stride = span()
        for s in range(first, uint32(num_slots), stride):
            pairs[uint32(2) * s] = values[s]
            pairs[uint32(2) * s + uint32(1)] = element(indices[s])

    return pack


@functools.lru_cache(maxsize=None)
def zeroed_rows_kernel(out_half: str = "", pairs: bool = False):
    """``out[rows[z], :] = partial[z, :]``, each float32 rounded to ``out``'s
    type (``out_half``, see :mod:`._half`; float32 for ``""``): the rows of
    the forward's result that no single item writes whole, summed in
    ``partial`` by :func:`spgemm_kernel`. One thread per entry of
    ``partial`` (grid-stride), so one launch stores them all, whatever the
    row lengths; with ``pairs`` (:func:`~._half.stores_pairs`) one per two
    entries, ``out`` viewed as 32-bit words of two half patterns."""
    store = narrow(out_half)
    span = thread_span()
    word = pair_word()
    two = uint32(2)

    @kernel_jit()
    def store_rows(partial, rows, out, num_stores):
        per_row = uint32(out.shape[1])
        first, stride = span()
        for s in range(first, uint32(num_stores), stride):
            z = s // per_row
            d = s - z * per_row
            if pairs:
                out[rows[z], d] = word(store(partial[z, two * d]),
                                       store(partial[z, two * d + uint32(1)]))
            else:
                out[rows[z], d] = store(partial[z, d])

    return store_rows


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
                  width: int = 1, index_bits: int = 8, pairs: bool = False, half: str = "",
                  out_half: str = ""):
    """The compiled forward kernel for one ``(dim, k, threads, weighted,
    scaled, width, index_bits, pairs, half, out_half)``: ``weighted`` reads a value per
    edge, ``scaled`` one per row; with ``width`` 2 or 4 a lane reads that
    many slots per load and ``indices`` is the flat CBSR indices viewed as
    words of that many indices of ``index_bits`` bits each (int16, int32 or
    int64), else the flat indices. ``pairs``: ``values`` is the flat (value,
    column index) pairs (:func:`reads_pairs`; :func:`pair_width_fits`) and
    ``indices`` is not read. ``half`` (``"bf16"``/``"fp16"``, see
    :mod:`._half`): the values are that type's 16-bit patterns (``int16``;
    packed pairs ``int32``), widened to float32 as they are loaded.
    ``out_half``: ``out`` holds that type's 16-bit patterns, each sum rounded
    to it once as it is stored; else ``out`` is float32. ``item_split[t]``
    is 0 for an item that writes its row whole, else 1 + the row of
    ``partial`` (float32) that the item adds into."""
    is_half = bool(half)
    if pairs and (not reads_pairs(k, is_half) or not pair_width_fits(width, is_half)):
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
    pair_words = width if is_half else 2 * width  # 32-bit words of a lane's pairs
    load_pairs = vector_load(pair_words) if pairs and pair_words > 1 else None
    value_of = widen(half)
    store = narrow(out_half)
    field = _index_field(index_bits)
    word_type = _word_type(index_bits, width)

    @kernel_jit(max_registers=MAX_REGISTERS)
    def spgemm(item_row, item_start, item_end, item_split, col, weight, scale,
               values, indices, out, partial, num_items):
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
                                if not is_half:
                                    both = load_pairs(values, s * uint32(2))
                                    for w in range(width):
                                        val[u, w] = both[2 * w]
                                        pair_pos[u, w] = uint32(both[2 * w + 1])
                                elif width == 1:
                                    word = uint32(values[s])
                                    val[u, 0] = value_of(word)
                                    pair_pos[u, 0] = word >> _PAIR_SHIFT
                                else:
                                    words = load_pairs(values, s)
                                    for w in range(width):
                                        word = uint32(words[w])
                                        val[u, w] = value_of(word)
                                        pair_pos[u, w] = word >> _PAIR_SHIFT
                            elif width == 1:
                                val[u, 0] = value_of(values[s])
                                pos[u] = uint32(indices[s])
                            else:
                                loaded = load(values, s)
                                for w in range(width):
                                    val[u, w] = value_of(loaded[w])
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
            split = uint32(item_split[item])
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
                        cuda.atomic.add(partial, (split - one, d), total)
                else:
                    out[r, d] = store(total)
            sync()

    return spgemm


@functools.lru_cache(maxsize=None)
def sspmm_kernel(dim: int, k: int, threads: int, weighted: bool, scaled: bool = False,
                 width: int = 1, index_bits: int = 8, vector_atomics: bool = True,
                 half: str = "", packed: bool = False):
    """The compiled backward kernel for one ``(dim, k, threads, weighted,
    scaled, width, index_bits, vector_atomics, half, packed)``; ``indices``
    (as for :func:`spgemm_kernel`) and ``grad_values`` are flat arrays; with
    ``width`` 2 or 4 a lane adds to that many slots at once, with one vector
    reduction when ``vector_atomics`` (sm_90 and later). ``half``:
    ``grad_out`` holds that type's 16-bit patterns (:mod:`._half`), widened
    as it is staged; ``grad_values`` is float32 (the reductions stay
    float32) unless ``packed``: then ``grad_values`` is the gradient in that
    half type as 32-bit words of two slots, and a lane adds ``width`` = 8
    slots with one packed half reduction (sm_90;
    :func:`~._vector.packed_half_atomic_add`), which rounds each running sum
    to the half type (``indices``: words of 8 uint8 indices, or pairs of
    words of 4 int16 ones)."""
    if packed and (not half or width != PACKED_HALF_SLOTS):
        raise ValueError(f"packed half reductions take a half type and {PACKED_HALF_SLOTS} "
                         f"slots per lane, got {half!r} and {width}")
    grad_of = widen(half)
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
    if packed:
        add = packed_half_atomic_add(half)
        index_pairs = index_bits * width > 64  # int16 indices: two words of 4 per lane
        load_index_pair = vector_load(2) if index_pairs else None
        word_type = uint64
    else:
        add = vector_atomic_add(width, vector_atomics) if width > 1 else None
        index_pairs, load_index_pair = False, None
        word_type = _word_type(index_bits, width)
    pos_words = 2 if index_pairs else 1
    per_word = uint32(64 // index_bits)  # indices in a 64-bit word (read as pairs)
    field = _index_field(index_bits)

    @kernel_jit(max_registers=MAX_REGISTERS)
    def sspmm(item_row, item_start, item_end, col, weight, scale, indices, grad_out,
              grad_values, num_items):
        buf = cuda.shared.array((warps, dim), float32)
        nbr = cuda.shared.array((warps, staged), uint32)    # neighbour * k
        nbr_w = cuda.shared.array((warps, staged), float32)
        at = cuda.local.array(unroll, uint32)             # registers after unrolling
        pos = cuda.local.array((unroll, pos_words), word_type)
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
                g = grad_of(grad_out[r, d])
                buf[warp, d] = g * row_scale if scaled else g
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
                        # the fire-and-forget atomics never wait on them, so
                        # skipping dead loads costs nothing.
                        for u in range(unroll):
                            q = first + uint32(u) * n_groups
                            if live and q < n:
                                s = nbr[warp, q] + j
                                at[u] = s
                                if width == 1:
                                    pos[u, 0] = uint32(indices[s])
                                elif index_pairs:
                                    words = load_index_pair(indices, s // per_word)
                                    pos[u, 0] = word_type(words[0])
                                    pos[u, 1] = word_type(words[1])
                                else:
                                    pos[u, 0] = word_type(indices[s // vw])
                        for u in range(unroll):
                            q = first + uint32(u) * n_groups
                            if live and q < n:
                                a = nbr_w[warp, q] if weighted else float32(1.0)
                                if width == 1:
                                    cuda.atomic.add(grad_values, at[u], buf[warp, pos[u, 0]] * a)
                                elif width == 2:
                                    word = pos[u, 0]
                                    add(grad_values, at[u], buf[warp, field(word, 0)] * a,
                                        buf[warp, field(word, 1)] * a)
                                elif width == 4:
                                    word = pos[u, 0]
                                    add(grad_values, at[u], buf[warp, field(word, 0)] * a,
                                        buf[warp, field(word, 1)] * a,
                                        buf[warp, field(word, 2)] * a,
                                        buf[warp, field(word, 3)] * a)
                                else:  # 8 slots, one packed half reduction
                                    lo = pos[u, 0]
                                    if index_pairs:  # slots 4-7 in the second word
                                        hi, up = pos[u, 1], 4
                                    else:
                                        hi, up = lo, 0
                                    add(grad_values, at[u] // uint32(2),
                                        buf[warp, field(lo, 0)] * a,
                                        buf[warp, field(lo, 1)] * a,
                                        buf[warp, field(lo, 2)] * a,
                                        buf[warp, field(lo, 3)] * a,
                                        buf[warp, field(hi, 4 - up)] * a,
                                        buf[warp, field(hi, 5 - up)] * a,
                                        buf[warp, field(hi, 6 - up)] * a,
                                        buf[warp, field(hi, 7 - up)] * a)
            sync()  # buf is rewritten by the next item

    return sspmm


#: Edges whose loads a group of the SDDMM issues before it reduces them.
SDDMM_UNROLL = 4


def sddmm_layout(k: int, width: int) -> Tuple[int, int, int]:
    """``(lanes per edge, edges side by side, slot chunks per lane)`` of the
    SDDMM: a power-of-two group of lanes (so that it reduces with xor
    shuffles) covering ``k / width`` loads, at most a warp."""
    lanes = 1
    while lanes < WARP and lanes * width < k:
        lanes *= 2
    return lanes, WARP // lanes, -(-k // (lanes * width))


@functools.lru_cache(maxsize=None)
def _group_sum(lanes: int):
    """``total(value, lane, warp, scratch)``: the sum of ``value`` over the
    ``lanes`` (a power of two) lanes of the caller's group, valid in the
    group's first lane. Xor shuffles on a GPU; in the simulator (no
    shuffles) through the warp's ``scratch`` row, between two barriers."""
    if simulator_enabled():
        sync = warp_sync()
        n = uint32(lanes)

        @cuda.jit(device=True)
        def total(value, lane, warp, scratch):
            scratch[warp, lane] = value
            sync()
            first = lane - lane % n
            t = float32(0.0)
            for i in range(n):
                t += scratch[warp, first + uint32(i)]
            sync()
            return t
        return total
    offsets = []
    off = lanes // 2
    while off > 0:
        offsets.append(off)
        off //= 2
    steps = len(offsets)
    first_offset = lanes // 2

    @cuda.jit(device=True, inline=True)
    def total(value, lane, warp, scratch):
        off = uint32(first_offset)
        for _ in range(steps):
            value += cuda.shfl_xor_sync(FULL_MASK, value, off)
            off = off // uint32(2)
        return value
    return total


@functools.lru_cache(maxsize=None)
def sddmm_kernel(dim: int, k: int, threads: int, width: int = 1, index_bits: int = 8,
                 values_half: str = "", grad_half: str = ""):
    """The compiled kernel of the gradient w.r.t. the edge values (a sampled
    dense-dense product) for one ``(dim, k, threads, width, index_bits)``:
    for every edge ``e = (c -> r)``, ``grad_weight[e] = sum_j values[c, j] *
    grad_out[r, indices[c, j]]``.

    One warp per work item of the forward's schedule (a row, or a slice of a
    long row) stages ``grad_out[r]`` in shared memory. Its lanes split into
    groups (:func:`sddmm_layout`); a group takes one edge at a time and its
    lanes read ``width`` slots of the source's CBSR row per load (vector
    loads, as the forward), multiply them with the staged row at their
    columns, and reduce in float32 across the group. Each edge has one
    writer: no atomics. ``values`` and ``indices`` are flat ``[N * k]``
    arrays (``indices`` as words of ``width`` indices), ``grad_out`` is
    ``[num_dst, dim]``; ``values_half``/``grad_half`` name a half type whose
    16-bit patterns that array holds (:mod:`._half`), widened on load."""
    value_of, grad_of = widen(values_half), widen(grad_half)
    warps = threads // WARP
    if not fits_shared_memory(k, dim, warps):
        raise ValueError(f"dim={dim} is too wide for the SDDMM kernel's shared memory")
    lanes, groups, chunks = sddmm_layout(k, width)
    unroll = SDDMM_UNROLL
    kk, vw = uint32(k), uint32(width)
    n_lanes, n_groups, n_warps = uint32(lanes), uint32(groups), uint32(warps)
    w32, d32, zero = uint32(WARP), uint32(dim), uint32(0)
    chunk_step = uint32(lanes * width)
    round_step = uint32(groups * unroll)
    sync = warp_sync()
    reduce = _group_sum(lanes)
    load = vector_load(width) if width > 1 else None
    field = _index_field(index_bits)
    word_type = _word_type(index_bits, width)

    @kernel_jit(max_registers=MAX_REGISTERS)
    def sddmm(item_row, item_start, item_end, col, values, indices, grad_out, grad_weight,
              num_items):
        buf = cuda.shared.array((warps, dim), float32)
        scratch = cuda.shared.array((warps, WARP), float32)  # the simulator's reductions
        part = cuda.local.array(unroll, float32)              # registers after unrolling
        lane = uint32(cuda.threadIdx.x) % w32
        warp = uint32(cuda.threadIdx.x) // w32
        group = lane // n_lanes
        slot = (lane - group * n_lanes) * vw
        for item in range(uint32(cuda.blockIdx.x) * n_warps + warp, uint32(num_items),
                          uint32(cuda.gridDim.x) * n_warps):
            r = uint32(item_row[item])
            for d in range(lane, d32, w32):
                buf[warp, d] = grad_of(grad_out[r, d])
            sync()
            e1 = uint32(item_end[item])
            for step in range(uint32(item_start[item]), e1, round_step):
                for u in range(unroll):
                    e = step + group + uint32(u) * n_groups
                    acc = float32(0.0)
                    if e < e1:
                        base = uint64(col[e]) * kk
                        for c in range(chunks):
                            j = slot + uint32(c) * chunk_step
                            if j < kk:
                                s = base + j
                                if width == 1:
                                    acc += value_of(values[s]) * buf[warp, uint32(indices[s])]
                                else:
                                    loaded = load(values, s)
                                    word = word_type(indices[s // vw])
                                    for w in range(width):
                                        acc += value_of(loaded[w]) * buf[warp, field(word, w)]
                    part[u] = acc
                for u in range(unroll):  # every lane reaches every shuffle
                    total = reduce(part[u], lane, warp, scratch)
                    e = step + group + uint32(u) * n_groups
                    if lane % n_lanes == zero and e < e1:
                        grad_weight[e] = total
            sync()  # buf is rewritten by the next item

    return sddmm
