"""Mini-batch benchmark: NeighborLoader training of MaxK GraphSAGE against
the stock model with the same loader, and the per-batch cost of building the
CSR graph the kernels read.

    python benchmarks/minibatch.py                # Reddit-shaped synthetic graph (GPU)
    python benchmarks/minibatch.py --tiny         # small CPU smoke run (CI)

Reports seed nodes per second over whole epochs (sampling included) and, on
a fixed set of sampled batches already on the device, the time of a training
step and of ``CSRGraph.from_adj`` for that batch's layers. Writes
benchmarks/results/minibatch[-tiny].json and .png.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from common import RESULTS, check_against_torch_backend, environment, pyplot, save, time_ms

from pyg_maxk import CSRGraph
from pyg_maxk.app.datasets import load_dataset
from pyg_maxk.app.training import TrainConfig, neighbor_loader
from pyg_maxk.nn import MaxKGraphSAGE

#: Relative tolerance of a MaxK model's loss and gradients against the torch backend.
MODEL_RTOL = 2e-3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="reddit-like")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--fanout", default="25,10")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--batches", type=int, default=20, help="batches in the step timing")
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.tiny:
        args.dataset, args.scale, args.batches, args.num_workers = "small", 0.5, 3, 0
        args.hidden, args.k, args.batch_size = 64, 16, 256
    device = torch.device(args.device)
    fanout = [int(f) for f in args.fanout.split(",")]
    t0 = time.perf_counter()
    task = load_dataset(args.dataset, scale=args.scale, seed=0)
    data = task.data
    print(f"{args.dataset} x{args.scale}: {data.num_nodes} nodes, {data.num_edges} edges "
          f"(generated in {time.perf_counter() - t0:.1f} s)", flush=True)
    cfg = TrainConfig(layers=len(fanout), fanout=fanout, batch_size=args.batch_size,
                      num_workers=args.num_workers, device=str(device))
    seeds = data.train_mask.nonzero().view(-1)
    batches = []
    for i, batch in enumerate(neighbor_loader(data, seeds, cfg, shuffle=True,
                                              generator=torch.Generator().manual_seed(0))):
        if i == args.batches:
            break
        batches.append(batch.to(device))
    result = {"dataset": args.dataset, "scale": args.scale, "nodes": data.num_nodes,
              "edges": data.num_edges, "fanout": fanout, "batch_size": args.batch_size,
              "hidden": args.hidden, "k": args.k,
              "mean_batch_nodes": sum(b.num_nodes for b in batches) / len(batches),
              "mean_batch_edges": sum(b.num_edges for b in batches) / len(batches)}
    for name, k in (("maxk", args.k), ("stock", None)):
        torch.manual_seed(0)
        model = MaxKGraphSAGE(data.num_features, args.hidden, len(fanout), task.num_classes,
                              k=k).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        if k is not None:  # checked before timing: loss and gradients of two batches
            for b in batches[:2]:
                result["check_vs_torch_backend"] = check_against_torch_backend(
                    model, lambda b=b: F.cross_entropy(model(b.x, b.edge_index)[:b.batch_size],
                                                       b.y[:b.batch_size]), MODEL_RTOL)

        def steps():
            for b in batches:
                opt.zero_grad(set_to_none=True)
                out = model(b.x, b.edge_index)[:b.batch_size]
                F.cross_entropy(out, b.y[:b.batch_size]).backward()
                opt.step()

        step = time_ms(steps, device, warmup=1, repeats=3)
        result[f"{name}_step_ms"] = step["median_ms"] / len(batches)
        # Whole epochs with sampling, as a user runs them.
        loader = neighbor_loader(data, seeds, cfg, shuffle=True)
        start = time.perf_counter()
        seen = 0
        for b in loader:
            b = b.to(device)
            opt.zero_grad(set_to_none=True)
            out = model(b.x, b.edge_index)[:b.batch_size]
            F.cross_entropy(out, b.y[:b.batch_size]).backward()
            opt.step()
            seen += b.batch_size
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        result[f"{name}_seeds_per_s"] = seen / (time.perf_counter() - start)
        print(f"{name}: {result[f'{name}_step_ms']:.2f} ms per step on device-resident batches, "
              f"{result[f'{name}_seeds_per_s']:,.0f} seed nodes/s with sampling", flush=True)

    def builds():  # what one training step builds: one graph per batch (shared by layers)
        for b in batches:
            CSRGraph.from_adj(b.edge_index, (b.num_nodes, b.num_nodes), normalization="mean",
                              cache=False).schedule(512)

    build = time_ms(builds, device, warmup=1, repeats=3)["median_ms"]
    result["graph_build_ms"] = build / len(batches)
    result["graph_build_fraction_of_maxk_step"] = result["graph_build_ms"] / result["maxk_step_ms"]
    result["speedup_step"] = result["stock_step_ms"] / result["maxk_step_ms"]
    result["speedup_seeds_per_s"] = result["maxk_seeds_per_s"] / result["stock_seeds_per_s"]
    print(f"graph build {result['graph_build_ms']:.3f} ms per batch "
          f"({100 * result['graph_build_fraction_of_maxk_step']:.1f}% of a MaxK step); "
          f"step speedup {result['speedup_step']:.2f}x, "
          f"seeds/s speedup {result['speedup_seeds_per_s']:.2f}x", flush=True)
    name = "minibatch-tiny" if args.tiny else "minibatch"
    payload = {"benchmark": "minibatch", "environment": environment(device), "result": result}
    save(name, payload, args.out, lambda png, hardware: plot(result, png, hardware))


def plot(r, path, hardware) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(["stock", "MaxK", "MaxK: graph build"],
                [r["stock_step_ms"], r["maxk_step_ms"], r["graph_build_ms"]],
                color=["tab:grey", "tab:blue", "tab:orange"])
    axes[0].set_ylabel("ms per training step")
    axes[1].bar(["stock", "MaxK"], [r["stock_seeds_per_s"], r["maxk_seeds_per_s"]],
                color=["tab:grey", "tab:blue"])
    axes[1].set_ylabel("seed nodes / s (with sampling)")
    fig.suptitle(f"NeighborLoader {r['fanout']}, batch {r['batch_size']}, {r['dataset']} "
                 f"on {hardware}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
