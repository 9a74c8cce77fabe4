"""What packed half-precision reductions do to the backward SSpMM: speed and error.

    python benchmarks/half_reductions.py          # GPU, Reddit-shaped graph, k=32
    python benchmarks/half_reductions.py --tiny   # CPU smoke run (Numba's simulator)

The SSpMM is bound by its float32 global reductions, 4 bytes per slot and
edge (``reduction_ceiling.py``). sm_90 has packed half reductions
(``red.global.add.noftz.v4.bf16x2`` and ``.f16x2``: 8 slots in one 16-byte
reduction) that would halve those bytes, but each of them rounds the running
sum to the half type, so a gradient entry summed over ``d`` edges is rounded
``d`` times instead of once. The package keeps float32 reductions unless
the user allows packed ones (:func:`pyg_maxk.allow_half_reductions`); this
benchmark measures both sides of that trade, on the package's SSpMM both
ways and on a probe kernel.

The probe, written for the purpose, computes the SSpMM: one thread per
(edge ``r <- s``, 8 slots) adds ``a_e * grad_out[r, indices[s, j]]`` into
``s``'s gradient row, through two float32 vector reductions or one packed
half reduction, with ``grad_out`` in the half type either way. Its float32
form is timed beside the package's SSpMM, so that the ratio of its two forms
stands for what packed reductions would do to the package's kernel. Each
result is compared with the float64 product of the same half-rounded
``grad_out`` (norm-relative error, overall and on the hub rows: the 1% of
sources with the most out-edges, where a half-precision sum loses most),
next to the package's SSpMM (float32 sums rounded once to the half type, or
packed half sums) and the stock backward (cuSPARSE with the transposed adjacency, float32).
The probe's two forms are also timed with every term a constant, without
the index and ``grad_out`` loads: the reductions' own floor.
"""
from __future__ import annotations

import functools
import os
import sys

if "--tiny" in sys.argv:  # before Numba is imported
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import torch
from common import ceiling_setup, environment, pyplot, rel_error, save, time_ms

import pyg_maxk
from pyg_maxk.graph import unpack
from pyg_maxk.kernels import cuda_module, geometry
from pyg_maxk.kernels._half import widen
from pyg_maxk.kernels._numba import simulator_enabled
from pyg_maxk.kernels._vector import PACKED_HALF_SLOTS as SLOTS
from pyg_maxk.kernels._vector import packed_half_atomic_add, vector_atomic_add
from pyg_maxk.ops import numba_ops

cuda = cuda_module()
from numba import uint32  # noqa: E402 (after the numpy shim)

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ------------------------------------------------------------ probe kernel
@functools.lru_cache(maxsize=None)
def probe_kernel(k: int, kind: str, packed: bool, gather: bool = True):
    """The SSpMM, one thread per (edge, 8 slots): ``grad[s, j] += coef[e] *
    grad_out[r, indices[s, j]]`` for ``e = (s -> r)``, ``grad_out`` holding
    ``kind`` half patterns. ``grad`` is float32 ``[N * k]`` or, when
    ``packed``, ``[N * k / 2]`` packed half pairs. Either way each reduction
    instruction of a warp covers whole 32-byte sectors: a packed thread adds
    its 8 slots ``8t..8t+7`` in one reduction; a float32 thread adds slots
    ``4t..4t+3`` and ``4t+k/2..4t+k/2+3`` in two, one per half row. Without
    ``gather`` every term is ``coef[e]`` (no index or ``grad_out`` loads):
    the reductions' own time."""
    grad_of = widen(kind)
    add_half = packed_half_atomic_add(kind) if packed else None
    add_f32 = vector_atomic_add(4, not simulator_enabled())
    groups, kk = uint32(k // SLOTS), uint32(k)
    first_step = uint32(SLOTS if packed else 4)
    second_offset = uint32(4 if packed else k // 2)
    byte, four = uint32(0xFF), uint32(4)

    @cuda.jit
    def sspmm(row, col, coef, index_words, grad_out, grad, num_edges):
        stride = uint32(cuda.gridDim.x) * uint32(cuda.blockDim.x)
        for i in range(uint32(cuda.grid(1)), uint32(num_edges) * groups, stride):
            e = i // groups
            first = uint32(col[e]) * kk + (i - e * groups) * first_step
            second = first + second_offset
            a = coef[e]
            if gather:
                r = row[e]
                lo = uint32(index_words[first // four])
                hi = uint32(index_words[second // four])
                v0 = grad_of(grad_out[r, lo & byte]) * a
                v1 = grad_of(grad_out[r, (lo >> uint32(8)) & byte]) * a
                v2 = grad_of(grad_out[r, (lo >> uint32(16)) & byte]) * a
                v3 = grad_of(grad_out[r, lo >> uint32(24)]) * a
                v4 = grad_of(grad_out[r, hi & byte]) * a
                v5 = grad_of(grad_out[r, (hi >> uint32(8)) & byte]) * a
                v6 = grad_of(grad_out[r, (hi >> uint32(16)) & byte]) * a
                v7 = grad_of(grad_out[r, hi >> uint32(24)]) * a
            else:
                v0 = v1 = v2 = v3 = v4 = v5 = v6 = v7 = a
            if packed:
                add_half(grad, first // uint32(2), v0, v1, v2, v3, v4, v5, v6, v7)
            else:
                add_f32(grad, first, v0, v1, v2, v3)
                add_f32(grad, second, v4, v5, v6, v7)

    return sspmm


def run_probe(run, blocks, threads, device, edges, indices, grad_out, kind, packed,
              gather=True):
    """The probe SSpMM's gradient ``[N, k]`` (float32, or the half type when
    ``packed``)."""
    row, col, coef = edges
    nodes, k = indices.shape
    dtype = HALF_DTYPES[kind] if packed else torch.float32
    grad = torch.zeros(nodes, k, dtype=dtype, device=device)
    words = grad.view(torch.int32).view(-1) if packed else grad.view(-1)
    run(probe_kernel(k, kind, packed, gather), blocks, threads, device, row, col, coef,
        indices.view(torch.int32).view(-1), grad_out.view(torch.int16), words, col.numel())
    return grad


def package_packed(operands, indices, grad_out, nodes):
    """The package's SSpMM with packed half reductions allowed."""
    pyg_maxk.allow_half_reductions(True)
    try:
        return numba_ops.sspmm(operands, indices, grad_out, nodes)
    finally:
        pyg_maxk.allow_half_reductions(False)


# ------------------------------------------------------------------ main
def errors(result, reference, hubs):
    return {"rel_error": rel_error(result, reference),
            "hub_rel_error": rel_error(result[hubs], reference[hubs])}


def main(argv=None):
    args, device, graph = ceiling_setup(__doc__, argv)
    if args.tiny:
        args.ks = [16]
    nodes, dim = graph.num_dst, args.dim
    run = numba_ops.launcher()
    threads = geometry.block_threads()
    blocks = run.max_blocks(device, threads)
    rowptr, col = graph.rowptr.long(), graph.kernel_col()
    row = torch.repeat_interleave(torch.arange(nodes, device=device), rowptr.diff(),
                                  output_size=col.numel()).to(torch.int32)
    coef = graph.row_scale[row.long()].float()            # the mean's 1 / in-degree
    out_degree = torch.bincount(col.long(), minlength=nodes)
    hubs = out_degree >= out_degree.float().quantile(0.99)
    a_t = torch.sparse_csr_tensor(rowptr, col.long(), coef.double(), (nodes, nodes),
                                  check_invariants=False).t().to_sparse_csr()
    gen = torch.Generator(device=device).manual_seed(0)
    stock_t = graph.torch_csr(torch.float32).t().to_sparse_csr()
    stock_grad_out = torch.randn(nodes, dim, device=device, generator=gen)
    stock_ms = time_ms(lambda: torch.sparse.mm(stock_t, stock_grad_out), device,
                       repeats=args.repeats)["median_ms"]
    rows = []
    for k in args.ks:
        assert k % SLOTS == 0, f"the probe takes k a multiple of {SLOTS}"
        h = pyg_maxk.maxk(torch.randn(nodes, dim, device=device, generator=gen), k)
        operands = unpack(*graph.operands(k))
        for kind, dtype in HALF_DTYPES.items():
            grad_out = torch.randn(nodes, dim, device=device, generator=gen).to(dtype)
            reference = torch.sparse.mm(a_t, grad_out.double()).gather(1, h.indices.long())
            row_out = {"k": k, "dim": dim, "half": kind, "stock_backward_ms": stock_ms,
                       "hub_min_out_degree": int(out_degree[hubs].min()),
                       "max_out_degree": int(out_degree.max())}
            variants = {
                "package_sspmm": lambda: numba_ops.sspmm(operands, h.indices, grad_out, nodes),
                "package_packed": lambda: package_packed(operands, h.indices, grad_out, nodes),
                "probe_float32": lambda: run_probe(run, blocks, threads, device, (row, col, coef),
                                                   h.indices, grad_out, kind, False),
                "probe_packed": lambda: run_probe(run, blocks, threads, device, (row, col, coef),
                                                  h.indices, grad_out, kind, True)}
            for name, fn in variants.items():
                result = fn()
                if name == "probe_float32":   # the float32 sums, rounded once as the package does
                    result = result.to(dtype)
                for key, value in errors(result, reference, hubs).items():
                    row_out[f"{name}_{key}"] = value
                row_out[f"{name}_ms"] = time_ms(fn, device, warmup=1 if args.tiny else 3,
                                                repeats=args.repeats)["median_ms"]
            for packed in (False, True):
                name = "reductions_only_" + ("packed" if packed else "float32")
                row_out[f"{name}_ms"] = time_ms(
                    lambda: run_probe(run, blocks, threads, device, (row, col, coef), h.indices,
                                      grad_out, kind, packed, gather=False),
                    device, warmup=1 if args.tiny else 3, repeats=args.repeats)["median_ms"]
            row_out["packed_over_float32"] = (row_out["probe_packed_ms"]
                                              / row_out["probe_float32_ms"])
            rows.append(row_out)
            print(f"k {k} {kind}: stock backward (float32) {stock_ms:.3f} ms | "
                  f"package SSpMM {row_out['package_sspmm_ms']:.3f} ms, "
                  f"error {row_out['package_sspmm_rel_error']:.2e} (hubs "
                  f"{row_out['package_sspmm_hub_rel_error']:.2e}) | package packed "
                  f"{row_out['package_packed_ms']:.3f} ms, error "
                  f"{row_out['package_packed_rel_error']:.2e} (hubs "
                  f"{row_out['package_packed_hub_rel_error']:.2e}) | probe float32 sums "
                  f"{row_out['probe_float32_ms']:.3f} ms, error "
                  f"{row_out['probe_float32_rel_error']:.2e} | probe packed {kind} sums "
                  f"{row_out['probe_packed_ms']:.3f} ms ({row_out['packed_over_float32']:.2f}x), "
                  f"error {row_out['probe_packed_rel_error']:.2e} (hubs "
                  f"{row_out['probe_packed_hub_rel_error']:.2e}) | reductions only: float32 "
                  f"{row_out['reductions_only_float32_ms']:.3f} ms, packed "
                  f"{row_out['reductions_only_packed_ms']:.3f} ms", flush=True)
    name = "half_reductions-tiny" if args.tiny else "half_reductions"
    payload = {"benchmark": "half_reductions", "environment": environment(device),
               "graph": {"nodes": nodes, "edges": graph.num_edges}, "rows": rows}
    save(name, payload, args.out, lambda png, hardware: plot(rows, png, hardware))


def plot(rows, path, hardware):
    plt = pyplot()
    if plt is None:
        return
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['half']}\nk={r['k']}" for r in rows]
    x = range(len(rows))
    for j, (name, label) in enumerate((("package_sspmm", "package SSpMM (float32 sums)"),
                                       ("package_packed", "package SSpMM, packed half sums"),
                                       ("probe_float32", "probe, float32 sums"),
                                       ("probe_packed", "probe, packed half sums"))):
        xs = [i + 0.2 * (j - 1.5) for i in x]
        ax_t.bar(xs, [r[f"{name}_ms"] for r in rows], width=0.2, label=label)
        ax_e.bar(xs, [r[f"{name}_hub_rel_error"] for r in rows], width=0.2, label=label)
    for ax, ylabel in ((ax_t, "ms"), (ax_e, "hub rows' error vs float64")):
        ax.set_xticks(list(x), labels)
        ax.set_ylabel(ylabel)
    ax_e.set_yscale("log")
    ax_t.legend(fontsize=7)
    fig.suptitle(f"SSpMM with packed half reductions, {hardware}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
