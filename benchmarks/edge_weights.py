"""Learnable edge weights: the edge-value gradient (SDDMM) kernel, and a GCN
that learns its edge weights, MaxK against stock PyG.

    python benchmarks/edge_weights.py                 # Reddit-shaped graph, H200
    python benchmarks/edge_weights.py --tiny          # CPU smoke run (CI)

* Kernels (``dim`` 256, each ``k``): the aggregation's forward SpGEMM, its
  backward SSpMM (the features' gradient) and the SDDMM (the edge values'
  gradient), on the GCN-normalised graph; the SDDMM is checked against a
  float64 reference on a random sample of edges (the whole graph too on
  ``--tiny``) before timing.
* Training: a ``layers x 256`` GCN whose edge weights are a learned
  parameter (one per edge, through ``gcn_norm``): the MaxK model on
  ``edge_index`` + ``edge_weight`` against stock PyG ``GCNConv`` in every form
  that learns edge weights (``edge_index`` + ``edge_weight``; a
  ``torch.sparse`` CSR ``adj_t`` whose values are the weights;
  ``SparseTensor`` where torch_sparse has the device's ops), each epoch a
  forward, a backward and an Adam step of the weights and the edge weights.
  Before timing, MaxK's loss and gradients (edge weights included) are
  checked against the ``"torch"`` reference backend. Forms that cannot run
  are reported with the reason.

The training runs at each of ``--train-scales`` (the graph's nodes and edges
scaled): stock forms that do not fit the full graph may fit a smaller one.
Writes ``benchmarks/results/edge_weights[-tiny].json`` and a ``.png``.
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Dict

import torch
import torch.nn.functional as F
import train
from common import RESULTS, check_against_torch_backend, environment, pyplot, time_ms, write_json

import pyg_maxk
from pyg_maxk import CSRGraph, clear_graph_cache
from pyg_maxk.nn import MaxKGCN
from pyg_maxk.ops import _library as lib

HIDDEN = 256
#: Edges of the float64 check of the SDDMM on a large graph.
CHECKED_EDGES = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small CPU smoke run")
    p.add_argument("--graph", default="reddit", help="a workload of train.py")
    p.add_argument("--ks", default="8,16,32")
    p.add_argument("--k", type=int, default=32, help="the training run's k")
    p.add_argument("--train-scales", default="1,0.25",
                   help="graph scales of the training runs (stock may not fit at 1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def csr_ordered(edge_index: torch.Tensor, n: int) -> torch.Tensor:
    """``edge_index`` sorted by (target, source): the order of a CSR
    ``adj_t``'s values, so that one weight vector serves every form."""
    perm = torch.argsort(edge_index[1] * n + edge_index[0])
    return edge_index[:, perm]


def check_sddmm(graph: CSRGraph, ops, values, indices, grad_out, got, sample: int) -> float:
    """Largest error of the SDDMM over ``sample`` random edges (all when
    there are fewer) against float64, relative to the sum of the magnitudes
    of each edge's ``k`` products."""
    e = graph.num_edges
    pick = (torch.randperm(e, device=got.device)[:sample] if e > sample
            else torch.arange(e, device=got.device))
    row = torch.searchsorted(graph.rowptr.long(), pick, right=True) - 1
    src = graph.col[pick].long()
    dense = torch.zeros(src.numel(), grad_out.size(1), dtype=torch.float64, device=got.device)
    dense.scatter_(1, indices[src].long(), values[src].double())
    terms = dense * grad_out[row].double()
    # Relative to the sum of the terms' magnitudes: float32 rounding scales
    # with it (a sum that cancels to near zero is still exact to it).
    err = (got[pick].double() - terms.sum(1)).abs() / terms.abs().sum(1).clamp(min=1e-30)
    return float(err.max()) if err.numel() else 0.0


def kernel_times(data, ks, device, repeats, backend) -> Dict[str, object]:
    n, ei = data["num_nodes"], data["edge_index"]
    graph = CSRGraph.from_adj(ei, (n, n), normalization="gcn")
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for k in ks:
        ops = graph.operands(k)
        x = torch.randn(n, HIDDEN, generator=gen).to(device)
        with pyg_maxk.use_backend(backend):
            h = pyg_maxk.maxk(x, k)
        values, indices = h.values.detach(), h.indices
        grad_out = torch.randn(n, HIDDEN, generator=gen).to(device)

        def spgemm():
            return lib.spgemm(*ops, values, indices, n, HIDDEN, backend)

        def sspmm():
            return lib.sspmm(*ops, indices, grad_out, n, backend)

        def sddmm():
            return lib.sddmm(*ops, values, indices, grad_out, backend)

        got = sddmm()
        err = check_sddmm(graph, ops, values, indices, grad_out, got,
                          graph.num_edges if device.type == "cpu" else CHECKED_EDGES)
        assert err < 1e-5, f"SDDMM differs from float64 by {err:.3g} (k={k})"
        row = {"k": k, "sddmm_max_rel_error": err}
        for name, fn in (("spgemm", spgemm), ("sspmm", sspmm), ("sddmm", sddmm)):
            row[f"{name}_ms"] = time_ms(fn, device, warmup=2, repeats=repeats)["median_ms"]
        row["sddmm_vs_spgemm"] = row["sddmm_ms"] / row["spgemm_ms"]
        print(f"  k={k:3d}: SpGEMM {row['spgemm_ms']:8.3f} ms | SSpMM {row['sspmm_ms']:8.3f} ms"
              f" | SDDMM {row['sddmm_ms']:8.3f} ms ({row['sddmm_vs_spgemm']:.2f}x the SpGEMM),"
              f" max rel error {err:.2g}", flush=True)
        rows.append(row)
    return {"graph_edges": graph.num_edges, "dim": HIDDEN, "backend": backend, "rows": rows}


def _model(data, layers, k):
    torch.manual_seed(0)
    return MaxKGCN(data["x"].size(1), HIDDEN, layers, data["num_classes"], k=k)


def _csr_adj(crow, col, weight, n):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.sparse_csr_tensor(crow, col, weight, size=(n, n))


def training_times(data, layers, k, device, repeats) -> Dict[str, object]:
    """Epochs of a GCN learning one weight per edge: MaxK and stock forms."""
    n, x, y = data["num_nodes"], data["x"], data["y"]
    ei = csr_ordered(data["edge_index"], n)
    counts = torch.bincount(ei[1], minlength=n)
    crow = torch.zeros(n + 1, dtype=torch.long, device=device)
    torch.cumsum(counts, 0, out=crow[1:])
    col = ei[0].contiguous()
    result: Dict[str, object] = {"edges": int(ei.size(1)), "layers": layers, "k": k,
                                 "stock": {}}

    def epoch(model, adj_of):
        weight = torch.nn.Parameter(torch.ones(ei.size(1), device=device))
        opt = torch.optim.Adam(list(model.parameters()) + [weight], lr=0.01)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x, *adj_of(weight)), y)
            loss.backward()
            opt.step()
        return step, weight

    maxk = _model(data, layers, k).to(device)
    weight = torch.nn.Parameter(torch.ones(ei.size(1), device=device))
    check = check_against_torch_backend(
        torch.nn.ModuleDict({"m": maxk, "w": torch.nn.ParameterList([weight])}),
        lambda: F.cross_entropy(maxk(x, ei, weight), y), train.MODEL_RTOL)
    step, _ = epoch(maxk, lambda w: (ei, w))
    result["maxk"] = {**time_ms(step, device, warmup=2, repeats=repeats), "check": check}
    train._report("gcn", f"MaxK k={k}, learned edge weights", result["maxk"])
    clear_graph_cache()
    forms = {"edge_index": lambda w: (ei, w), "csr": lambda w: (_csr_adj(crow, col, w, n),)}
    for form, adj_of in forms.items():
        reason = train.messages_fit(form, ei.size(1), device)
        if reason:
            result["stock"][form] = {"skipped": reason}
            print(f"  gcn stock {form}: skipped ({reason})", flush=True)
            continue

        def run(adj_of=adj_of):
            step, _ = epoch(_model(data, layers, None).to(device), adj_of)
            return time_ms(step, device, warmup=2, repeats=repeats)
        result["stock"][form] = train.guarded(run, f"gcn stock {form}")
        train._report("gcn", f"stock {form}, learned edge weights", result["stock"][form])
    result["stock"]["SparseTensor"] = train.guarded(
        lambda: _sparse_tensor_epoch(data, layers, ei, device, repeats, epoch),
        "gcn stock SparseTensor")
    train._report("gcn", "stock SparseTensor, learned edge weights",
                  result["stock"]["SparseTensor"])
    ran = {form: t["median_ms"] for form, t in result["stock"].items() if "median_ms" in t}
    if ran:
        fastest = min(ran, key=ran.get)
        result["vs_fastest_stock"] = {"form": fastest,
                                      "speedup": ran[fastest] / result["maxk"]["median_ms"]}
        print(f"  MaxK {result['vs_fastest_stock']['speedup']:.2f}x the fastest stock form "
              f"({fastest})", flush=True)
    return result


def _sparse_tensor_epoch(data, layers, ei, device, repeats, epoch):
    from torch_sparse import SparseTensor
    n = data["num_nodes"]
    step, _ = epoch(_model(data, layers, None).to(device),
                    lambda w: (SparseTensor(row=ei[1], col=ei[0], value=w, sparse_sizes=(n, n),
                                            is_sorted=True),))
    return time_ms(step, device, warmup=2, repeats=repeats)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cpu":
        train.flush_denormals(device)
    name = "cora" if args.tiny else args.graph
    preset, layers = train.WORKLOADS[name]
    data = train.make_graph(preset, device)
    backend = "cpu" if device.type == "cpu" else "numba"
    ks = [4, 16] if args.tiny else [int(k) for k in args.ks.split(",")]
    repeats = 2 if args.tiny else args.repeats
    print(f"[{name}] {data['num_nodes']} nodes, {data['edge_index'].size(1)} edges", flush=True)
    payload = {"benchmark": "edge_weights", "environment": environment(device),
               "graph": name, "kernels": kernel_times(data, ks, device, repeats, backend)}
    payload["training"] = {}
    for scale in [1.0] if args.tiny else [float(x) for x in args.train_scales.split(",")]:
        clear_graph_cache()
        if scale != 1.0:
            del data
            data = train.make_graph(preset, device, scale)
            print(f"[{name} x {scale}] {data['num_nodes']} nodes, "
                  f"{data['edge_index'].size(1)} edges", flush=True)
        payload["training"][str(scale)] = training_times(data, layers, args.k, device, repeats)
    out = Path(args.out)
    stem = "edge_weights-tiny" if args.tiny else "edge_weights"
    print(f"wrote {write_json(stem, payload, out)}")
    plot(payload, out / f"{stem}.png")


def plot(payload, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    rows = payload["kernels"]["rows"]
    ks = [r["k"] for r in rows]
    for name in ("spgemm", "sspmm", "sddmm"):
        ax0.plot(ks, [r[f"{name}_ms"] for r in rows], marker="o", label=name)
    ax0.set_xlabel("k")
    ax0.set_ylabel("ms")
    ax0.set_xscale("log", base=2)
    ax0.set_title(f"kernels, dim {payload['kernels']['dim']}")
    ax0.legend()
    scale, t = next(iter(payload["training"].items()))
    for size, run in payload["training"].items():  # the largest graph stock trains on
        if any("median_ms" in r for r in run["stock"].values()):
            scale, t = size, run
            break
    labels, times = ["MaxK"], [t["maxk"]["median_ms"]]
    for form, r in t["stock"].items():
        if "median_ms" in r:
            labels.append(f"stock {form}")
            times.append(r["median_ms"])
    ax1.bar(labels, times, color=["tab:green"] + ["tab:gray"] * (len(labels) - 1))
    ax1.set_ylabel("epoch (ms, median)")
    ax1.set_title(f"GCN learning edge weights, k={t['k']}, graph x {scale}")
    fig.suptitle(f"{payload['graph']}: {payload['environment'].get('gpu', 'CPU')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
