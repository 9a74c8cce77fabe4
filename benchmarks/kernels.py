"""Kernel benchmark: MaxK SpGEMM / SSpMM / select against cuSPARSE SpMM, the
stock backward of the same aggregation, and torch.topk.

    python benchmarks/kernels.py            # Reddit-shaped graph on a GPU
    python benchmarks/kernels.py --tiny     # CPU smoke run (CI)

Every MaxK output is checked against the torch backend before it is timed.
Writes benchmarks/results/kernels[-tiny].json and kernels[-tiny].png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyg_maxk  # noqa: E402
from pyg_maxk import CSRGraph  # noqa: E402
from pyg_maxk.datasets import PRESETS, power_law_edge_index  # noqa: E402

from common import RESULTS, environment, pyplot, rel_error, save, time_ms  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small CPU smoke run")
    p.add_argument("--ks", default="2,4,8,16,32,64,128")
    p.add_argument("--dims", default="64,128,256,512")
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--edges", type=int, default=None)
    p.add_argument("--max-degree", type=int, default=None)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.tiny:
        device = torch.device("cpu")
        nodes, edges, max_deg = args.nodes or 2000, args.edges or 20000, args.max_degree or 500
        ks, dims, repeats = [4, 16], [64], 2
        backends = ["torch"]
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
    del ei
    a_csr = graph.torch_csr(torch.float32)
    a_t = a_csr.t().to_sparse_csr()  # what a transposed-product backward reads
    print(f"graph: {nodes} nodes, {graph.num_edges} edges, max in-degree "
          f"{int(graph.in_degree().max())}, build {t_build['median_ms']:.1f} ms", flush=True)

    rows = []
    for dim in dims:
        x = torch.randn(nodes, dim, device=device)
        grad = torch.randn(nodes, dim, device=device)
        dense_t = time_ms(lambda: torch.sparse.mm(a_csr, x), device, repeats=repeats)
        dense_bwd = time_ms(lambda: torch.sparse.mm(a_t, grad), device, repeats=repeats)
        for k in ks:
            if k >= dim:
                continue
            with pyg_maxk.use_backend("torch"):
                ref = pyg_maxk.maxk(x, k)
                ref_out = pyg_maxk.aggregate(graph, ref)
            row = {"dim": dim, "k": k, "cusparse_spmm": dense_t, "stock_backward": dense_bwd}
            for backend in backends:
                with pyg_maxk.use_backend(backend):
                    h = pyg_maxk.maxk(x, k)
                    # Same values (the kernel writes them in bank-major order); tied
                    # columns may differ from torch.topk's pick.
                    kept = h.values.sort(dim=1, descending=True).values
                    assert torch.equal(kept, ref.values), "maxk mismatch"
                    out = pyg_maxk.aggregate(graph, h)
                    row["spgemm_rel_error"] = rel_error(out, ref_out)
                    assert row["spgemm_rel_error"] < 1e-4, row
                    row["maxk_spgemm"] = time_ms(lambda: pyg_maxk.aggregate(graph, h), device,
                                                 repeats=repeats)
                    if backend == "numba":
                        from pyg_maxk.ops import numba_ops
                        s = graph.schedule(numba_ops.max_edges_per_item(k))
                        col = graph.kernel_col()
                        w, row_scale = numba_ops.kernel_weights(graph)
                        gv = numba_ops.sspmm_op(s.row, s.start, s.end, col, w, row_scale,
                                                h.indices, grad, nodes)
                        ref_gv = torch.sparse.mm(a_t, grad).gather(1, h.long_indices())
                        row["sspmm_rel_error"] = rel_error(gv, ref_gv)
                        assert row["sspmm_rel_error"] < 1e-4, row
                        row["maxk_sspmm"] = time_ms(
                            lambda: numba_ops.sspmm_op(s.row, s.start, s.end, col, w, row_scale,
                                                       h.indices, grad, nodes),
                            device, repeats=repeats)
                        row["maxk_select"] = time_ms(lambda: pyg_maxk.maxk(x, k), device,
                                                     repeats=repeats)
                        if numba_ops.supports_linear(dim, k):
                            row.update(time_linear(h, dim, device, repeats))
                    else:
                        row["maxk_select"] = time_ms(lambda: pyg_maxk.maxk(x, k), device,
                                                     repeats=repeats)
            row["torch_topk"] = time_ms(lambda: torch.topk(x, k, dim=1), device, repeats=repeats)
            row["speedup_spgemm"] = dense_t["median_ms"] / row["maxk_spgemm"]["median_ms"]
            if "maxk_sspmm" in row:
                row["speedup_sspmm"] = dense_bwd["median_ms"] / row["maxk_sspmm"]["median_ms"]
            rows.append(row)
            print(f"dim {dim:4d} k {k:4d}: cuSPARSE {dense_t['median_ms']:8.3f} ms | "
                  f"SpGEMM {row['maxk_spgemm']['median_ms']:8.3f} ms "
                  f"({row['speedup_spgemm']:.2f}x) | "
                  + (f"stock bwd {dense_bwd['median_ms']:8.3f} ms | SSpMM "
                     f"{row['maxk_sspmm']['median_ms']:8.3f} ms ({row['speedup_sspmm']:.2f}x) | "
                     if "maxk_sspmm" in row else "")
                  + f"select {row['maxk_select']['median_ms']:.3f} ms vs topk "
                  f"{row['torch_topk']['median_ms']:.3f} ms"
                  + (f" | linear {row['maxk_linear']['median_ms']:.3f} ms vs dense "
                     f"{row['dense_linear']['median_ms']:.3f} ms" if "maxk_linear" in row else ""),
                  flush=True)
        del x, grad

    name = "kernels-tiny" if args.tiny else "kernels"
    payload = {"benchmark": "kernels", "environment": environment(device),
               "graph": {"nodes": nodes, "edges": graph.num_edges,
                         "max_in_degree": int(graph.in_degree().max()),
                         "build_ms": t_build["median_ms"]},
               "rows": rows}
    save(name, payload, args.out, lambda png, hardware: plot(rows, png, hardware))


def time_linear(h, dim: int, device, repeats: int) -> dict:
    """The CBSR linear kernel (SAGE's root term, ``dim -> dim``) against
    densify + F.linear, checked against float64 first. Timed wherever the
    kernel fits, also where the layers pick the dense path."""
    from pyg_maxk.ops import numba_ops
    g = torch.Generator(device=device).manual_seed(dim)
    weight = torch.randn(dim, dim, device=device, generator=g) / dim ** 0.5
    bias = torch.randn(dim, device=device, generator=g)
    out = numba_ops.cbsr_linear(h.values, h.indices, dim, weight, bias)
    ref = torch.nn.functional.linear(h.to_dense().double(), weight.double(), bias.double())
    row = {"linear_rel_error": rel_error(out, ref),
           "linear_picked": numba_ops.prefers_linear(h.num_rows, dim, h.k)}
    assert row["linear_rel_error"] < 1e-5, row
    row["maxk_linear"] = time_ms(
        lambda: numba_ops.cbsr_linear(h.values, h.indices, dim, weight, bias), device,
        repeats=repeats)
    row["dense_linear"] = time_ms(
        lambda: torch.nn.functional.linear(h.to_dense(), weight, bias), device, repeats=repeats)
    row["speedup_linear"] = row["dense_linear"]["median_ms"] / row["maxk_linear"]["median_ms"]
    return row


def plot(rows, path, hardware):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for key, ax, title in (("speedup_spgemm", axes[0], "forward SpGEMM vs cuSPARSE SpMM"),
                           ("speedup_sspmm", axes[1], "backward SSpMM vs stock backward"),
                           ("speedup_linear", axes[2], "SAGE root linear vs densify + GEMM")):
        for dim in sorted({r["dim"] for r in rows}):
            pts = [(r["k"], r[key]) for r in rows if r["dim"] == dim and key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"dim {dim}")
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
