"""Kernel benchmark: MaxK SpGEMM / SSpMM / select against cuSPARSE SpMM, the
stock backward of the same aggregation, and torch.topk.

    python benchmarks/kernels.py            # Reddit-shaped graph on a GPU
    python benchmarks/kernels.py --tiny     # CPU smoke run (CI)
    python benchmarks/kernels.py --dtype bf16 --dims 256   # half-precision CBSR

Every MaxK output (select, SpGEMM, SSpMM, linear) is checked against the
torch backend (float64 for the linear map) before it is timed. ``--tiny``
runs the ``"cpu"`` backend's kernels and the ``"numba"`` kernels in Numba's
simulator on a 100-node graph; ``stock_spmm`` is cuSPARSE on a GPU and
``torch.sparse`` on a CPU, with int64 indices and (``stock_spmm_int32``)
int32 ones; the speedups are over the faster of the two, in float32.

With ``--dtype bf16`` (or ``fp16``) the MaxK features, CBSR values and output
gradients are in that type (the kernels accumulate in float32), checked
against the torch backend on the same half inputs; the stock SpMM is also
timed with a matrix and features of that type (``stock_spmm_half``, or the
error it raises). ``--half-reductions`` also times the SSpMM with
:func:`pyg_maxk.allow_half_reductions` where ``k`` is a multiple of 8
(``maxk_sspmm_half_reductions``,
checked against float32 sums to the looser tolerance its repeated rounding
needs), against the same stock backward.
Writes benchmarks/results/kernels[-tiny].json and kernels[-tiny].png.
"""
from __future__ import annotations

import argparse
import os

import torch
from common import RESULTS, environment, pyplot, rel_error, save, time_ms

import pyg_maxk
from pyg_maxk import CSRGraph
from pyg_maxk.app.datasets import PRESETS, power_law_edge_index

DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Norm-relative agreement with the torch backend: float32 sums in a
#: different order, plus (half types) the output's rounding to that type.
CHECK_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small CPU smoke run")
    p.add_argument("--ks", default="2,4,8,16,32,64,128")
    p.add_argument("--dims", default="64,128,256,512")
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--edges", type=int, default=None)
    p.add_argument("--max-degree", type=int, default=None)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="type of the MaxK features and CBSR values")
    p.add_argument("--half-reductions", action="store_true",
                   help="with a half --dtype, also time the SSpMM with "
                        "pyg_maxk.allow_half_reductions")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.half_reductions and DTYPES[args.dtype] == torch.float32:
        raise SystemExit("--half-reductions needs a half --dtype (bf16 or fp16)")
    if args.tiny:
        # The CPU kernels, and the CUDA kernels in Numba's simulator (slow:
        # a tiny graph, no warm-up), against the torch backend.
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
        device = torch.device("cpu")
        global WARMUP
        nodes, edges, max_deg = args.nodes or 100, args.edges or 500, args.max_degree or 50
        # Half reductions pack 8 slots: k=8 there.
        ks, dims, repeats, WARMUP = [8 if args.half_reductions else 4], [64], 1, 0
        # The cpu backend takes float32/float64 only.
        backends = ["cpu", "numba"] if args.dtype == "float32" else ["numba"]
    else:
        device = torch.device("cuda")
        reddit = PRESETS["reddit-like"]
        nodes = args.nodes or reddit.num_nodes
        edges = args.edges or reddit.num_edges
        max_deg = args.max_degree or reddit.max_degree
        ks = [int(k) for k in args.ks.split(",")]
        dims = [int(d) for d in args.dims.split(",")]
        repeats = args.repeats
        backends = ["numba"]

    ei = power_law_edge_index(nodes, edges, max_degree=max_deg, seed=0, device=device)
    t_build = time_ms(lambda: CSRGraph.from_adj(ei, (nodes, nodes), normalization="mean",
                                                cache=False), device, warmup=1, repeats=3)
    graph = CSRGraph.from_adj(ei, (nodes, nodes), normalization="mean")
    ei = None  # free it for the features (rebound, not deleted: the lambdas above name it)
    dtype = DTYPES[args.dtype]
    a_csr = graph.torch_csr(torch.float32)
    a_csr32 = torch.sparse_csr_tensor(a_csr.crow_indices().int(), a_csr.col_indices().int(),
                                      a_csr.values(), a_csr.shape, check_invariants=False)
    a_half = graph.torch_csr(dtype) if dtype != torch.float32 else None
    a_t = a_csr.t().to_sparse_csr()  # what a transposed-product backward reads
    print(f"graph: {nodes} nodes, {graph.num_edges} edges, max in-degree "
          f"{int(graph.in_degree().max())}, build {t_build['median_ms']:.1f} ms", flush=True)

    stock = "cuSPARSE" if device.type == "cuda" else "torch.sparse (CPU)"
    rows = []
    for dim in dims:
        x32 = torch.randn(nodes, dim, device=device)
        grad32 = torch.randn(nodes, dim, device=device)
        x, grad = x32.to(dtype), grad32.to(dtype)
        dense_t = timed(lambda: torch.sparse.mm(a_csr, x32), device, repeats=repeats)
        dense_t32 = timed(lambda: torch.sparse.mm(a_csr32, x32), device, repeats=repeats)
        stock_half = guarded_time(lambda: torch.sparse.mm(a_half, x), device, repeats) \
            if a_half is not None else None
        fastest_stock = min(dense_t["median_ms"], dense_t32["median_ms"])
        dense_bwd = timed(lambda: torch.sparse.mm(a_t, grad32), device, repeats=repeats)
        for k in ks:
            if k >= dim:
                continue
            with pyg_maxk.use_backend("torch"):
                ref = pyg_maxk.maxk(x, k)
            topk = timed(lambda: torch.topk(x, k, dim=1), device, repeats=repeats)
            for backend in backends:
                row = {"dim": dim, "k": k, "dtype": args.dtype, "stock_spmm": dense_t,
                       "stock_spmm_int32": dense_t32, "stock_backward": dense_bwd,
                       "torch_topk": topk}
                if stock_half is not None:
                    row["stock_spmm_half"] = stock_half
                row.update(time_backend(backend, graph, x, grad, k, ref, a_t, device,
                                        repeats, args.half_reductions))
                row["speedup_spgemm"] = fastest_stock / row["maxk_spgemm"]["median_ms"]
                row["speedup_sspmm"] = dense_bwd["median_ms"] / row["maxk_sspmm"]["median_ms"]
                if "maxk_sspmm_half_reductions" in row:
                    row["speedup_sspmm_half_reductions"] = (
                        dense_bwd["median_ms"] / row["maxk_sspmm_half_reductions"]["median_ms"])
                rows.append(row)
                print(f"dim {dim:4d} k {k:4d} [{backend}]: {stock} (faster of int64/int32) "
                      f"{fastest_stock:8.3f} ms | SpGEMM {row['maxk_spgemm']['median_ms']:8.3f} ms "
                      f"({row['speedup_spgemm']:.2f}x) | stock bwd {dense_bwd['median_ms']:8.3f}"
                      f" ms | SSpMM {row['maxk_sspmm']['median_ms']:8.3f} ms "
                      f"({row['speedup_sspmm']:.2f}x)"
                      + (f", half reductions {row['maxk_sspmm_half_reductions']['median_ms']:.3f}"
                         f" ms ({row['speedup_sspmm_half_reductions']:.2f}x)"
                         if "maxk_sspmm_half_reductions" in row else "")
                      + f" | select {row['maxk_select']['median_ms']:.3f}"
                      f" ms vs topk {topk['median_ms']:.3f} ms"
                      + (f" | linear {row['maxk_linear']['median_ms']:.3f} ms vs dense "
                         f"{row['dense_linear']['median_ms']:.3f} ms" if "maxk_linear" in row
                         else ""), flush=True)
        x = grad = x32 = grad32 = None  # free this width's features before the next

    name = "kernels-tiny" if args.tiny else "kernels"
    if dtype != torch.float32:
        name += f"-{args.dtype}"
    payload = {"benchmark": "kernels", "environment": environment(device),
               "stock_spmm": stock, "backends": backends, "dtype": args.dtype,
               "half_reductions": args.half_reductions,
               "graph": {"nodes": nodes, "edges": graph.num_edges,
                         "max_in_degree": int(graph.in_degree().max()),
                         "build_ms": t_build["median_ms"]},
               "rows": rows}
    save(name, payload, args.out, lambda png, hardware: plot(rows, png, hardware))


#: Untimed calls before each timing (none in the simulator's smoke run, where
#: a call takes seconds).
WARMUP = 3


def timed(fn, device, repeats: int) -> dict:
    return time_ms(fn, device, warmup=WARMUP, repeats=repeats)


def guarded_time(fn, device, repeats: int) -> dict:
    """:func:`timed`, or the error a stock op raises (e.g. a dtype that
    cuSPARSE does not take)."""
    try:
        return timed(fn, device, repeats)
    except RuntimeError as err:
        return {"skipped": f"RuntimeError: {str(err).splitlines()[0][:200]}"}


#: Norm-relative agreement of the half-reduction SSpMM with float32 sums: each
#: packed addition rounds the running sum (``pyg_maxk.allow_half_reductions``
#: documents the bound; measured 5% for bf16 on the Reddit-shaped graph).
HALF_REDUCTION_TOL = {torch.bfloat16: 0.1, torch.float16: 0.02}


def time_backend(backend: str, graph, x, grad, k, ref, a_t, device, repeats,
                 half_reductions: bool = False) -> dict:
    """Select, SpGEMM, SSpMM and (where its kernel takes the shape) the CBSR
    linear map of one backend (``"numba"`` or ``"cpu"``), each checked
    against the torch backend before it is timed: the selected values
    against ``ref`` (torch.topk), the products on the backend's own CBSR (tied
    entries, common in bf16, may keep other columns than torch.topk's)."""
    from pyg_maxk.dispatch import half_reductions_allowed
    from pyg_maxk.kernels._vector import PACKED_HALF_SLOTS  # after --tiny's simulator switch
    from pyg_maxk.ops import _library as lib
    nodes, dim = x.shape
    tol = CHECK_TOL[x.dtype]
    row = {"backend": backend}
    with pyg_maxk.use_backend(backend):
        h = pyg_maxk.maxk(x, k)
        assert h.values.dtype == x.dtype
        # Same values (the kernels write them in their own order); tied
        # columns may differ from torch.topk's pick.
        kept = h.values.sort(dim=1, descending=True).values
        assert torch.equal(kept, ref.values), f"{backend}: maxk differs from torch.topk"
        out = pyg_maxk.aggregate(graph, h)
        assert out.dtype == x.dtype
    with pyg_maxk.use_backend("torch"):
        ref_out = pyg_maxk.aggregate(graph, h)
    row["spgemm_rel_error"] = rel_error(out, ref_out)
    assert row["spgemm_rel_error"] < tol, row
    with pyg_maxk.use_backend(backend):
        row["maxk_spgemm"] = timed(lambda: pyg_maxk.aggregate(graph, h), device,
                                     repeats=repeats)
        row["maxk_select"] = timed(lambda: pyg_maxk.maxk(x, k), device, repeats=repeats)
    operands = graph.operands(k)
    gv = lib.sspmm(*operands, h.indices, grad, nodes, backend)
    assert gv.dtype == grad.dtype
    ref_gv = torch.sparse.mm(a_t, grad.float()).gather(1, h.long_indices())
    row["sspmm_rel_error"] = rel_error(gv, ref_gv)
    assert row["sspmm_rel_error"] < tol, row
    row["maxk_sspmm"] = timed(lambda: lib.sspmm(*operands, h.indices, grad, nodes, backend),
                                device, repeats=repeats)
    if half_reductions and backend == "numba" and k % PACKED_HALF_SLOTS == 0:
        before = half_reductions_allowed()
        pyg_maxk.allow_half_reductions(True)
        try:
            gv = lib.sspmm(*operands, h.indices, grad, nodes, backend)
            row["sspmm_half_reductions_rel_error"] = rel_error(gv, ref_gv)
            assert row["sspmm_half_reductions_rel_error"] < HALF_REDUCTION_TOL[x.dtype], row
            row["maxk_sspmm_half_reductions"] = timed(
                lambda: lib.sspmm(*operands, h.indices, grad, nodes, backend), device,
                repeats=repeats)
        finally:
            pyg_maxk.allow_half_reductions(before)
    from pyg_maxk.kernels import geometry
    if x.dtype == torch.float32 and (backend == "cpu" or geometry.takes_linear(dim, k)):
        row.update(time_linear(h, dim, device, repeats, backend))
    return row


def time_linear(h, dim: int, device, repeats: int, backend: str) -> dict:
    """The CBSR linear kernel of ``backend`` (SAGE's root term, ``dim ->
    dim``) against densify + F.linear, checked against float64 first. Timed
    wherever the kernel takes the shape, also where the layers pick the
    dense path (``linear_picked`` says which they pick)."""
    from pyg_maxk.ops import cpu_ops, numba_ops
    impl = {"numba": numba_ops, "cpu": cpu_ops}[backend].cbsr_linear
    g = torch.Generator(device=device).manual_seed(dim)
    weight = torch.randn(dim, dim, device=device, generator=g) / dim ** 0.5
    bias = torch.randn(dim, device=device, generator=g)
    out = impl(h.values, h.indices, dim, weight, bias)
    ref = torch.nn.functional.linear(h.to_dense().double(), weight.double(), bias.double())
    with pyg_maxk.use_backend(backend):
        picked = pyg_maxk.ops.linear_backend(h, weight, bias)
    row = {"linear_rel_error": rel_error(out, ref), "linear_picked": picked == backend}
    assert row["linear_rel_error"] < 1e-5, row
    row["maxk_linear"] = timed(lambda: impl(h.values, h.indices, dim, weight, bias), device,
                                 repeats=repeats)
    row["dense_linear"] = timed(
        lambda: torch.nn.functional.linear(h.to_dense(), weight, bias), device, repeats=repeats)
    row["speedup_linear"] = row["dense_linear"]["median_ms"] / row["maxk_linear"]["median_ms"]
    return row


def plot(rows, path, hardware):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for key, ax, title in (("speedup_spgemm", axes[0], "forward SpGEMM vs stock SpMM"),
                           ("speedup_sspmm", axes[1], "backward SSpMM vs stock backward"),
                           ("speedup_linear", axes[2], "SAGE root linear vs densify + GEMM")):
        for backend in sorted({r["backend"] for r in rows}):
            for dim in sorted({r["dim"] for r in rows}):
                pts = [(r["k"], r[key]) for r in rows
                       if r["dim"] == dim and r["backend"] == backend and key in r]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{backend}, dim {dim}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.set_ylabel("speedup (x)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:  # not the unlabelled 1x line alone
            ax.legend()
    fig.suptitle(f"pyg-maxk kernels on {hardware}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
