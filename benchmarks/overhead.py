"""Per-call host overhead of the MaxK ops, and kernel-only GPU times.

    python benchmarks/overhead.py            # the "numba" backend on a GPU
    python benchmarks/overhead.py --tiny     # the "cpu" backend (CI smoke run)

On a tiny graph (1,000 nodes, 5,000 edges, dim 256, k=32) the device work is
negligible, so the wall time per call is the Python + launch overhead (input
checks, dispatch, the custom-op layer, the launch). On a GPU the profiler then
separates kernel time from the rest on the Reddit-shaped graph. Every op is
checked against the torch backend before it is timed. Writes
``benchmarks/results/overhead[-tiny].json``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import RESULTS, environment, rel_error, write_json

import pyg_maxk
from pyg_maxk import CSRGraph
from pyg_maxk.app.datasets import PRESETS, power_law_edge_index


def host_us(fn, device, n=200) -> float:
    """Microseconds of host time per call (the device drained before and
    after, not in between)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(10):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / n * 1e6


def check_ops(graph, x, k: int, backend: str) -> dict:
    """Each op on ``backend`` against the torch backend."""
    with pyg_maxk.use_backend("torch"):
        ref = pyg_maxk.maxk(x, k)
        ref_out = pyg_maxk.aggregate(graph, ref)
    with pyg_maxk.use_backend(backend):
        h = pyg_maxk.maxk(x, k)
        out = pyg_maxk.aggregate(graph, h)
        dense = h.to_dense()
    assert torch.equal(h.values.sort(dim=1, descending=True).values, ref.values), "maxk"
    errors = {"spgemm": rel_error(out, ref_out), "to_dense": rel_error(dense, ref.to_dense())}
    assert max(errors.values()) < 1e-5, errors
    return errors


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the cpu backend on a CPU (CI)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    dev = torch.device("cpu" if args.tiny else "cuda")
    backend = "cpu" if args.tiny else "numba"
    results = {"backend": backend}
    ei = power_law_edge_index(1000, 5000, seed=0, device=dev)
    g = CSRGraph.from_adj(ei, (1000, 1000), normalization="mean")
    x = torch.randn(1000, 256, device=dev)
    results["rel_error_vs_torch_backend"] = check_ops(g, x, 32, backend)
    with pyg_maxk.use_backend(backend):
        h = pyg_maxk.maxk(x, 32)
        results["host_us_maxk_select"] = host_us(lambda: pyg_maxk.maxk(x, 32), dev)
        results["host_us_spgemm"] = host_us(lambda: pyg_maxk.aggregate(g, h), dev)
        results["host_us_to_dense"] = host_us(lambda: h.to_dense(), dev)
    results["host_us_torch_topk"] = host_us(lambda: torch.topk(x, 32, dim=1), dev)
    results["host_us_torch_sparse_spmm"] = host_us(
        lambda: torch.sparse.mm(g.torch_csr(torch.float32), x), dev)
    print({k: v for k, v in results.items() if k.startswith("host")}, flush=True)
    if not args.tiny:
        results.update(profile_reddit(dev))
    name = "overhead-tiny" if args.tiny else "overhead"
    payload = {"benchmark": "overhead", "environment": environment(dev), **results}
    print(f"wrote {write_json(name, payload, Path(args.out))}")


def profile_reddit(dev) -> dict:
    """Kernel time per op of a forward + backward aggregation, k 2 and 32."""
    results = {}
    p = PRESETS["reddit-like"]
    ei = power_law_edge_index(p.num_nodes, p.num_edges, max_degree=p.max_degree, device=dev)
    g = CSRGraph.from_adj(ei, (p.num_nodes, p.num_nodes), normalization="mean")
    del ei
    x = torch.randn(p.num_nodes, 256, device=dev)
    for k in (2, 32):
        with pyg_maxk.use_backend("numba"):
            h = pyg_maxk.maxk(x, k)
            vals = h.values.clone().requires_grad_()
            for _ in range(3):
                out = pyg_maxk.aggregate(g, h.with_values(vals))
                out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    out = pyg_maxk.aggregate(g, h.with_values(vals))
                    out.backward(torch.ones_like(out))
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8)
        print(f"k={k}\n{table}", flush=True)
        results[f"profile_k{k}"] = {e.key: e.device_time_total / e.count
                                    for e in prof.key_averages()}
    return results


if __name__ == "__main__":
    main()
