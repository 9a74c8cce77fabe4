"""The floor under the SpGEMM: how fast can the GPU gather CBSR rows at all?

    python benchmarks/gather_ceiling.py          # GPU, Reddit-shaped graph
    python benchmarks/gather_ceiling.py --tiny   # CPU smoke run (Numba's simulator)

For every edge the SpGEMM reads its source node's CBSR row: ``k`` float32
values and ``k`` uint8 indices. On the Reddit-shaped graph the whole CBSR
(232,965 x 32 x 5 bytes = 37 MB at k=32) fits in an H200's L2, so these are
scattered 32-byte-sector reads from L2. The kernel below does only that -- a
warp per run of edges, its lanes reading rows exactly as the SpGEMM's do, with
the same number of loads in flight and slots per load -- and sums what it
reads. Its time is a floor for the SpGEMM at the same ``k``; the JSON puts the
two side by side, with the sector rate achieved, and also the same gather with
one slot (a 4-byte load) per lane and load, which is what the SpGEMM did
before its vector loads: at k >= 16 the load instructions, not the bytes,
limited that one. Up to k=16 it also gathers the rows as (value, index)
pairs, one load for both (``numba_ops.value_index_pairs``), as the SpGEMM
reads them on large graphs: each load instruction of a row costs an L2
request, and separate values and indices take two.
"""
from __future__ import annotations

import functools
import os
import sys

if "--tiny" in sys.argv:  # before Numba is imported
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import torch
from common import ceiling_setup, environment, plot_ms_against_k, save, time_ms
from numba import float32, uint32

import pyg_maxk
from pyg_maxk.graph import max_edges_per_item
from pyg_maxk.kernels import cuda_module, geometry
from pyg_maxk.kernels._vector import vector_load
from pyg_maxk.kernels._warp import WARP
from pyg_maxk.kernels.spgemm import neighbour_lanes, reads_pairs, spgemm_unroll, spgemm_vector_width
from pyg_maxk.ops import numba_ops

cuda = cuda_module()


@functools.lru_cache(maxsize=None)
def gather_kernel(k: int, read_indices: bool, warps: int, width: int = 1, pairs: bool = False):
    """Sum the CBSR rows of every edge's source (values, and indices when
    ``read_indices``), ``width`` slots per lane and load (``indices`` then
    holds words of ``width`` indices), as many rows in flight per lane as
    the SpGEMM; ``pairs``: ``values`` holds (value, index) pairs, read
    together."""
    lanes = neighbour_lanes(k, width)
    groups, chunks = WARP // lanes, -(-k // (lanes * width))
    kk, last_slot, n_lanes, n_groups = uint32(k), uint32(k - width), uint32(lanes), uint32(groups)
    per_item = uint32(max_edges_per_item(k))
    w32, n_warps, one, vw = uint32(WARP), uint32(warps), uint32(1), uint32(width)
    unroll = spgemm_unroll(k, width)
    load = vector_load(width) if width > 1 else None
    load_pairs = vector_load(2 * width) if pairs else None

    @cuda.jit
    def gather(col, values, indices, out, num_edges):
        lane = uint32(cuda.threadIdx.x) % w32
        warp = uint32(cuda.threadIdx.x) // w32
        group = lane // n_lanes
        slot = (lane - group * n_lanes) * vw
        val = cuda.local.array((unroll, width), float32)
        pos = cuda.local.array(unroll, uint32)
        acc = float32(0.0)
        seen = uint32(0)
        num_items = (uint32(num_edges) + per_item - one) // per_item
        for item in range(uint32(cuda.blockIdx.x) * n_warps + warp, num_items,
                          uint32(cuda.gridDim.x) * n_warps):
            e0 = item * per_item
            e1 = min(e0 + per_item, uint32(num_edges))
            for e in range(e0 + group, e1, n_groups * uint32(unroll)):
                for c in range(chunks):
                    j = min(slot + uint32(c) * n_lanes * vw, last_slot)
                    for u in range(unroll):
                        s = uint32(col[min(e + uint32(u) * n_groups, e1 - one)]) * kk + j
                        if pairs:
                            both = load_pairs(values, s * uint32(2))
                            for w in range(width):
                                val[u, w] = both[2 * w]
                            pos[u] = uint32(both[1])
                        elif width == 1:
                            val[u, 0] = values[s]
                        else:
                            loaded = load(values, s)
                            for w in range(width):
                                val[u, w] = loaded[w]
                        if read_indices and not pairs:
                            pos[u] = uint32(indices[s // vw])
                    for u in range(unroll):
                        for w in range(width):
                            acc += val[u, w]
                        if read_indices or pairs:
                            seen ^= pos[u]
        out[uint32(cuda.blockIdx.x) * uint32(cuda.blockDim.x) + uint32(cuda.threadIdx.x)] = \
            acc + float32(seen)

    return gather


def sectors(nbytes: int) -> int:
    """32-byte sectors one row of ``nbytes`` (a power of two) touches."""
    return -(-nbytes // 32)


def main(argv=None):
    args, device, graph = ceiling_setup(__doc__, argv)
    nodes, ks, repeats = graph.num_dst, args.ks, args.repeats
    col = graph.kernel_col()
    run = numba_ops.launcher()
    threads = geometry.block_threads()
    blocks = run.max_blocks(device, threads)
    out = torch.empty(blocks * threads, device=device)
    x = torch.randn(nodes, args.dim, device=device)
    dense_ms = time_ms(lambda: torch.sparse.mm(graph.torch_csr(torch.float32), x), device,
                       repeats=repeats)["median_ms"]
    rows = []
    warmup = 1 if args.tiny else 3
    for k in ks:
        h = pyg_maxk.maxk(x, k)
        with pyg_maxk.use_backend("numba"):
            spgemm_ms = time_ms(lambda: pyg_maxk.aggregate(graph, h), device, warmup=warmup,
                                repeats=repeats)["median_ms"]
        values = h.values.reshape(-1)
        width = spgemm_vector_width(k)
        row = {"k": k, "dim": args.dim, "slots_per_load": width,
               "unroll": spgemm_unroll(k, width), "cusparse_spmm_ms": dense_ms,
               "maxk_spgemm_ms": spgemm_ms}
        # As the SpGEMM reads them (``width`` slots per load), and one slot per
        # load (4-byte loads: the load instructions, not the bytes, limit it).
        variants = [("values", False, width, False), ("cbsr", True, width, False),
                    ("cbsr_1slot", True, 1, False)]
        if reads_pairs(k):
            variants.append(("pairs", True, width, True))
        for name, with_indices, w, pairs in variants:
            kernel = gather_kernel(k, with_indices, threads // WARP, w, pairs)
            if pairs:
                read = words = numba_ops.value_index_pairs(h.values, h.indices).view(-1)
            else:
                read = values
                words, used, _ = numba_ops._index_operand(h.indices, w, values)  # as the SpGEMM
                assert used == w, "CBSR arrays not aligned for the SpGEMM's loads"
            ms = time_ms(lambda: run(kernel, blocks, threads, device, col, read, words, out,
                                     col.numel()), device, warmup=warmup,
                         repeats=repeats)["median_ms"]
            per_edge = (sectors(8 * k) if pairs else
                        sectors(4 * k) + (sectors(k) if with_indices else 0))
            if name == "cbsr":
                flat_sums = out.clone()
            elif pairs and w == 1:  # the same slots in the same lanes and order
                assert torch.equal(out, flat_sums), "the pairs gather read other rows"
            row[f"gather_{name}_ms"] = ms
            row[f"gather_{name}_sectors_per_edge"] = per_edge
            row[f"gather_{name}_gsectors_per_s"] = graph.num_edges * per_edge / ms / 1e6
        floor = row.get("gather_pairs_ms", row["gather_cbsr_ms"])  # as the SpGEMM reads
        row["spgemm_over_gather"] = spgemm_ms / floor
        rows.append(row)
        print(f"k {k:3d}: gather values {row['gather_values_ms']:.3f} ms, CBSR "
              f"{row['gather_cbsr_ms']:.3f} ms "
              f"({row['gather_cbsr_gsectors_per_s']:.0f} G sectors/s; one slot per load "
              f"{row['gather_cbsr_1slot_ms']:.3f} ms)"
              + (f", pairs {row['gather_pairs_ms']:.3f} ms" if reads_pairs(k) else "")
              + f" | SpGEMM {spgemm_ms:.3f} ms ({row['spgemm_over_gather']:.2f}x the gather) | "
              f"cuSPARSE {dense_ms:.3f} ms", flush=True)
    name = "gather_ceiling-tiny" if args.tiny else "gather_ceiling"
    payload = {"benchmark": "gather_ceiling", "environment": environment(device),
               "graph": {"nodes": nodes, "edges": graph.num_edges},
               "rows": rows}
    save(name, payload, args.out, lambda png, hardware: plot(rows, png, hardware))


def plot(rows, path, hardware):
    plot_ms_against_k(rows, (("maxk_spgemm_ms", "MaxK SpGEMM"),
                             ("gather_cbsr_ms", "gather CBSR rows only"),
                             ("gather_cbsr_1slot_ms", "gather CBSR rows, 4-byte loads"),
                             ("gather_pairs_ms", "gather (value, index) pairs (k <= 16)"),
                             ("gather_values_ms", "gather values only"),
                             ("cusparse_spmm_ms", "cuSPARSE SpMM (dense)")),
                      f"SpGEMM vs its gather floor, {hardware}", path)


if __name__ == "__main__":
    main()
