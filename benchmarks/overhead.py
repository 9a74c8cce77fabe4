"""Per-call host overhead of the "numba" ops, and kernel-only GPU times.

    python benchmarks/overhead.py

On a tiny graph the GPU work is negligible, so the wall time per call is the
Python + launch overhead (tensor wrapping, dispatch, the custom-op layer). On
the Reddit-shaped graph the profiler separates kernel time from the rest.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyg_maxk  # noqa: E402
from pyg_maxk import CSRGraph  # noqa: E402
from pyg_maxk.datasets import PRESETS, power_law_edge_index  # noqa: E402
from pyg_maxk.kernels import cuda_module  # noqa: E402

from common import environment, write_json  # noqa: E402


def host_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    dev = torch.device("cuda")
    results = {}
    ei = power_law_edge_index(1000, 5000, seed=0, device=dev)
    g = CSRGraph.from_adj(ei, (1000, 1000), normalization="mean")
    x = torch.randn(1000, 256, device=dev)
    with pyg_maxk.use_backend("numba"):
        h = pyg_maxk.maxk(x, 32)
        results["host_us_maxk_select"] = host_us(lambda: pyg_maxk.maxk(x, 32))
        results["host_us_spgemm"] = host_us(lambda: pyg_maxk.aggregate(g, h))
        results["host_us_to_dense"] = host_us(lambda: h.to_dense())
    cuda = cuda_module()
    results["host_us_as_cuda_array"] = host_us(lambda: cuda.as_cuda_array(x, sync=False))
    results["host_us_torch_topk"] = host_us(lambda: torch.topk(x, 32, dim=1))
    results["host_us_cusparse_spmm"] = host_us(lambda: torch.sparse.mm(g.torch_csr(torch.float32), x))
    print(results, flush=True)

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
        results[f"profile_k{k}"] = {e.key: e.device_time_total / e.count for e in prof.key_averages()}
    write_json("overhead", {"environment": environment(dev), **results})


if __name__ == "__main__":
    main()
