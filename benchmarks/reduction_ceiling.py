"""The floor under the backward SSpMM: how fast can the GPU add into CBSR rows?

    python benchmarks/reduction_ceiling.py          # GPU, Reddit-shaped graph
    python benchmarks/reduction_ceiling.py --tiny   # CPU smoke run (Numba's simulator)

For every edge ``r <- s`` the SSpMM adds ``k`` floats into the gradient of
``s``'s CBSR row, with global reductions (``width`` slots per reduction, as
:func:`~pyg_maxk.kernels.spgemm.sspmm_vector_width` picks: one 16-byte
``REDG.E.ADD.F32x4`` per lane at k >= 16 on sm_90). The kernel below issues
exactly those reductions, in the same lanes, and nothing else: no CBSR
indices, no shared-memory reads of ``grad_out``, no staging. Its time is a
floor for the SSpMM at the same ``k``; the JSON puts the two side by side,
with the same reductions one slot (4 bytes) per lane, and the stock backward
(cuSPARSE SpMM with the transposed adjacency). Each run adds 1.0 per edge
and slot, so every slot ends up holding its node's out-degree: that is
checked before timing.

Sources are drawn in proportion to the degrees, so hubs take thousands of
reductions into the same row, from warps that run at once. Whether that
contention sets the floor is measured by the same reductions over other
sequences of sources of the same length: the edges shuffled (the same
sources, another order), sorted by source (each hub's reductions back to
back), and drawn uniformly (no hubs); and by the SSpMM on a graph with the
same rows and uniform sources.
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
from pyg_maxk import CSRGraph
from pyg_maxk.graph import unpack
from pyg_maxk.kernels import cuda_module, geometry
from pyg_maxk.kernels._vector import vector_atomic_add
from pyg_maxk.kernels.spgemm import sspmm_vector_width
from pyg_maxk.ops import numba_ops

cuda = cuda_module()


@functools.lru_cache(maxsize=None)
def reduction_kernel(k: int, width: int):
    """``grad[col[e] * k + j] += 1`` for every edge ``e`` and slot ``j``: one
    thread per (edge, group of ``width`` slots), ``width`` slots per reduction
    (one vector reduction for 2 or 4)."""
    add = vector_atomic_add(width) if width > 1 else None
    kk, lanes, vw = uint32(k), uint32(k // width), uint32(width)
    one = float32(1.0)

    @cuda.jit
    def reduce(col, grad, num_edges):
        stride = uint32(cuda.gridDim.x) * uint32(cuda.blockDim.x)
        for i in range(uint32(cuda.grid(1)), uint32(num_edges) * lanes, stride):
            e = i // lanes
            slot = uint32(col[e]) * kk + (i - e * lanes) * vw
            if width == 4:
                add(grad, slot, one, one, one, one)
            elif width == 2:
                add(grad, slot, one, one)
            else:
                cuda.atomic.add(grad, slot, one)

    return reduce


def time_reductions(run, blocks, threads, device, sources, nodes, k, width, warmup,
                    repeats) -> float:
    """Milliseconds of the reductions for the edge sources ``sources``,
    checked first: every slot holds its node's count in ``sources``."""
    kernel = reduction_kernel(k, width)
    grad = torch.zeros(nodes * k, device=device)
    run(kernel, blocks, threads, device, sources, grad, sources.numel())
    expected = torch.bincount(sources.long(), minlength=nodes).float()
    assert torch.equal(grad.view(nodes, k), expected[:, None].expand(nodes, k)), \
        "the reductions missed or repeated slots"
    return time_ms(lambda: run(kernel, blocks, threads, device, sources, grad,
                               sources.numel()),
                   device, warmup=warmup, repeats=repeats)["median_ms"]


def main(argv=None):
    args, device, graph = ceiling_setup(__doc__, argv)
    nodes, ks, repeats = graph.num_dst, args.ks, args.repeats
    col = graph.kernel_col()
    gen = torch.Generator(device=device).manual_seed(1)
    uniform_col = torch.randint(0, nodes, (col.numel(),), device=device, generator=gen,
                                dtype=col.dtype)
    orders = {"shuffled": col[torch.randperm(col.numel(), device=device, generator=gen)],
              "sorted": col.sort().values, "uniform": uniform_col}
    uniform = CSRGraph(graph.rowptr, uniform_col, graph.weight, graph.size,
                       graph.normalization, graph.row_scale)
    run = numba_ops.launcher()
    threads = geometry.block_threads()
    blocks = run.max_blocks(device, threads)
    grad_out = torch.randn(nodes, args.dim, device=device)
    a_t = graph.torch_csr(torch.float32).t().to_sparse_csr()
    stock_ms = time_ms(lambda: torch.sparse.mm(a_t, grad_out), device,
                       repeats=repeats)["median_ms"]
    warmup = 1 if args.tiny else 3
    rows = []
    for k in ks:
        h = pyg_maxk.maxk(torch.randn(nodes, args.dim, device=device), k)
        operands = unpack(*graph.operands(k))
        sspmm_ms = time_ms(lambda: numba_ops.sspmm(operands, h.indices, grad_out, nodes),
                           device, warmup=warmup, repeats=repeats)["median_ms"]
        width = sspmm_vector_width(k)
        row = {"k": k, "dim": args.dim, "slots_per_reduction": width,
               "stock_backward_ms": stock_ms, "maxk_sspmm_ms": sspmm_ms}
        runs = [("reduce", width, col), ("reduce_1slot", 1, col)]
        runs += [(f"reduce_{order}", width, sources) for order, sources in orders.items()]
        for name, w, sources in runs:
            row[f"{name}_ms"] = time_reductions(run, blocks, threads, device, sources, nodes,
                                                k, w, warmup, repeats)
            row[f"{name}_gbytes_per_s"] = graph.num_edges * k * 4 / row[f"{name}_ms"] / 1e6
        row["sspmm_over_reduce"] = sspmm_ms / row["reduce_ms"]
        operands_uniform = unpack(*uniform.operands(k))
        row["maxk_sspmm_uniform_sources_ms"] = time_ms(
            lambda: numba_ops.sspmm(operands_uniform, h.indices, grad_out, nodes),
            device, warmup=warmup, repeats=repeats)["median_ms"]
        rows.append(row)
        print(f"k {k:3d}: reductions only {row['reduce_ms']:.3f} ms "
              f"({row['reduce_gbytes_per_s']:.0f} GB/s added, {width} slots each; one slot "
              f"each {row['reduce_1slot_ms']:.3f} ms; shuffled / sorted / uniform sources "
              f"{row['reduce_shuffled_ms']:.3f} / {row['reduce_sorted_ms']:.3f} / "
              f"{row['reduce_uniform_ms']:.3f} ms) | SSpMM {sspmm_ms:.3f} ms "
              f"({row['sspmm_over_reduce']:.2f}x the reductions; uniform sources "
              f"{row['maxk_sspmm_uniform_sources_ms']:.3f} ms) | stock backward "
              f"{stock_ms:.3f} ms", flush=True)
    name = "reduction_ceiling-tiny" if args.tiny else "reduction_ceiling"
    payload = {"benchmark": "reduction_ceiling", "environment": environment(device),
               "graph": {"nodes": nodes, "edges": graph.num_edges}, "rows": rows}
    save(name, payload, args.out, lambda png, hardware: plot(rows, png, hardware))


def plot(rows, path, hardware):
    plot_ms_against_k(rows, (("maxk_sspmm_ms", "MaxK SSpMM"),
                             ("maxk_sspmm_uniform_sources_ms", "MaxK SSpMM, uniform sources"),
                             ("reduce_ms", "its reductions only"),
                             ("reduce_uniform_ms", "its reductions, uniform sources"),
                             ("reduce_1slot_ms", "its reductions, one slot each"),
                             ("stock_backward_ms", "stock backward (cuSPARSE, A^T)")),
                      f"SSpMM vs its reduction floor, {hardware}", path)


if __name__ == "__main__":
    main()
