"""``pyg-maxk``: train a MaxK model on an embedded synthetic graph.

    pyg-maxk train                      # MaxK GraphSAGE on the default graph
    pyg-maxk train --compare            # ... and the stock ReLU model, side by side
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .datasets import PRESETS, preset_dataset

DEFAULT_DATASET = "small"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyg-maxk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a MaxK model (full batch)")
    train.add_argument("--model", choices=["sage", "gcn", "gin"], default="sage",
                       help="conv type (default: sage)")
    train.add_argument("--k", type=int, default=16, help="MaxK's k (default: 16)")
    train.add_argument("--hidden", type=int, default=64, help="hidden width (default: 64)")
    train.add_argument("--layers", type=int, default=2, help="number of convs (default: 2)")
    train.add_argument("--epochs", type=int, default=50, help="training epochs (default: 50)")
    train.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    train.add_argument("--dropout", type=float, default=0.2, help="feature dropout")
    train.add_argument("--dataset", default=DEFAULT_DATASET, choices=sorted(PRESETS),
                       help=f"synthetic preset, generated in memory (default: {DEFAULT_DATASET})")
    train.add_argument("--scale", type=float, default=1.0,
                       help="multiply the preset's nodes and edges (default: 1.0)")
    train.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                       help="torch device (default: cuda if available, else cpu)")
    train.add_argument("--seed", type=int, default=0, help="random seed")
    train.add_argument("--compare", action="store_true",
                       help="also train the stock-PyG ReLU model and print both")
    return parser


def _model(kind: str, in_channels: int, out_channels: int, args, k: Optional[int]):
    from .nn import MaxKGCN, MaxKGIN, MaxKGraphSAGE

    cls = {"sage": MaxKGraphSAGE, "gcn": MaxKGCN, "gin": MaxKGIN}[kind]
    return cls(in_channels, args.hidden, args.layers, out_channels, k=k, dropout=args.dropout)


def train_once(data, args, k: Optional[int]) -> Dict[str, float]:
    """Train one model; returns test accuracy, median epoch time and peak memory."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = _model(args.model, data.num_features, int(data.num_classes), args, k).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    label = f"MaxK k={k}" if k is not None else "stock ReLU"
    epoch_ms: List[float] = []
    best_val, test_at_best = 0.0, 0.0
    for epoch in range(1, args.epochs + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model.train()
        opt.zero_grad()
        out = model(data.x, data.edge_index)
        loss = F.cross_entropy(out[data.train_mask], data.y[data.train_mask])
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        epoch_ms.append((time.perf_counter() - start) * 1e3)
        model.eval()
        with torch.no_grad():
            pred = model(data.x, data.edge_index).argmax(-1)
        val = (pred[data.val_mask] == data.y[data.val_mask]).float().mean().item()
        test = (pred[data.test_mask] == data.y[data.test_mask]).float().mean().item()
        if val >= best_val:
            best_val, test_at_best = val, test
        if epoch == 1 or epoch % max(1, args.epochs // 10) == 0 or epoch == args.epochs:
            print(f"[{label}] epoch {epoch:4d}  loss {loss.item():.4f}  val acc {val:.4f}",
                  flush=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    # The first epochs compile kernels and build the graph: leave them out.
    steady = epoch_ms[min(3, len(epoch_ms) - 1):]
    return {"test_acc": test_at_best, "val_acc": best_val,
            "epoch_ms": statistics.median(steady), "peak_mib": peak}


def train(args) -> int:
    data = preset_dataset(args.dataset, scale=args.scale, seed=args.seed).to(args.device)
    print(f"dataset {args.dataset}: {data.num_nodes} nodes, {data.num_edges} edges, "
          f"{data.num_features} features, {int(data.num_classes)} classes; "
          f"model {args.model}, {args.layers} layers x {args.hidden}, device {args.device}")
    results = {"maxk": train_once(data, args, args.k)}
    if args.compare:
        results["stock"] = train_once(data, args, None)
    print()
    print(f"{'model':<14}{'test acc':>10}{'epoch ms':>12}{'peak MiB':>11}")
    for name, r in results.items():
        label = f"MaxK k={args.k}" if name == "maxk" else "stock ReLU"
        print(f"{label:<14}{r['test_acc']:>10.4f}{r['epoch_ms']:>12.2f}{r['peak_mib']:>11.1f}")
    m = results["maxk"]
    if args.compare:
        s = results["stock"]
        print(f"summary: MaxK k={args.k} test acc {m['test_acc']:.4f} vs stock {s['test_acc']:.4f}, "
              f"epoch {m['epoch_ms']:.2f} ms vs {s['epoch_ms']:.2f} ms "
              f"({s['epoch_ms'] / m['epoch_ms']:.2f}x)")
    else:
        print(f"summary: MaxK k={args.k} test acc {m['test_acc']:.4f}, epoch {m['epoch_ms']:.2f} ms")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return train(args)
    return 1  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
