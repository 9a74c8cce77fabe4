"""``pyg-maxk``: train MaxK GNNs from the command line.

    pyg-maxk train                       # MaxK GraphSAGE on the embedded synthetic graph
    pyg-maxk train --compare             # ... and the stock ReLU model, side by side
    pyg-maxk train --dataset Cora --root data --model gcn --k 16
    pyg-maxk train --loader neighbor --fanout 25,10 --batch-size 1024
    torchrun --nproc_per_node 2 -m pyg_maxk train --loader neighbor --ddp

The default dataset is generated in memory (no files, no network). Real
datasets are read from --root; PyG/ogb download them there when missing.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Dict, List, Optional

import torch

from .datasets import PRESETS, DatasetUnavailable, dataset_names, load_dataset
from .training import (
    STOCK_FORMS,
    TrainConfig,
    ddp_context,
    ddp_shutdown,
    flush_denormals,
    train_full_batch,
    train_full_batch_side_by_side,
    train_neighbor,
)

DEFAULT_DATASET = "small"


def _fanout(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--fanout takes comma-separated integers, got {text!r}") from None
    if not values or any(v == 0 or v < -1 for v in values):
        raise argparse.ArgumentTypeError("--fanout values are positive (or -1: all neighbours)")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyg-maxk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a MaxK model (and optionally the stock one)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--model", choices=["sage", "gcn", "gin"], default="sage",
                   help="conv type: GraphSAGE (mean), GCN or GIN")
    t.add_argument("--k", type=int, default=16,
                   help="MaxK's k: features kept per node after each hidden layer")
    t.add_argument("--hidden", type=int, default=64, help="width of every conv")
    t.add_argument("--layers", type=int, default=2, help="number of convs")
    t.add_argument("--epochs", type=int, default=50, help="training epochs")
    t.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    t.add_argument("--weight-decay", type=float, default=0.0, help="Adam weight decay (L2)")
    t.add_argument("--dropout", type=float, default=0.2,
                   help="feature dropout (on the kept values with MaxK)")
    t.add_argument("--dataset", default=DEFAULT_DATASET, choices=dataset_names(),
                   metavar="NAME",
                   help=f"synthetic preset ({', '.join(sorted(PRESETS))}; generated in "
                        f"memory) or a real dataset ({', '.join(dataset_names()[len(PRESETS):])})")
    t.add_argument("--root", default="data",
                   help="folder of real datasets (PyG/ogb layout); missing files are "
                        "downloaded there when the network allows")
    t.add_argument("--scale", type=float, default=1.0,
                   help="multiply a synthetic preset's nodes and edges")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device")
    t.add_argument("--keep-denormals", action="store_true",
                   help="on a CPU, keep IEEE denormal floats (by default they are "
                        "flushed to zero: late in training, gradients in the denormal "
                        "range make CPU matrix products several times slower)")
    t.add_argument("--seed", type=int, default=0,
                   help="seed of the data generator, the initial weights and sampling")
    t.add_argument("--compare", action="store_true",
                   help="also train the stock-PyG ReLU model with the same settings and "
                        "print a side-by-side table (full batch: the two models' epochs "
                        "alternate, so that both are timed under the same conditions)")
    t.add_argument("--stock-form", choices=STOCK_FORMS, default="auto",
                   help="the stock model's adjacency with --compare (full batch); auto: "
                        "the fastest measured for the device and graph (edge_index on a "
                        "GPU below ~1M edges, else a torch.sparse CSR adj_t)")
    t.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                   help="run the forward passes under torch.autocast with this dtype "
                        "(both models with --compare; the stock model then defaults to "
                        "edge_index, its only form that runs under autocast)")
    t.add_argument("--loader", choices=["full", "neighbor"], default="full",
                   help="full-batch training, or mini-batches from PyG's NeighborLoader")
    t.add_argument("--fanout", type=_fanout, default=[25, 10],
                   help="neighbours sampled per hop (one per layer), e.g. 25,10")
    t.add_argument("--batch-size", type=int, default=1024,
                   help="seed nodes per mini-batch (--loader neighbor)")
    t.add_argument("--num-workers", type=int, default=0,
                   help="NeighborLoader worker processes")
    t.add_argument("--ddp", action="store_true",
                   help="data-parallel over the processes torchrun starts (NCCL on GPUs, "
                        "gloo on CPUs); needs --loader neighbor")
    t.add_argument("--log-every", type=int, default=0,
                   help="print loss and validation metric every n epochs (0: ten lines)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--save-model", metavar="PATH", default=None,
                   help="save the trained MaxK model's state_dict to PATH (under --ddp "
                        "every rank writes PATH.rank<r>; the copies are identical)")
    return parser


def _config(args, device: str) -> TrainConfig:
    return TrainConfig(model=args.model, k=args.k, hidden=args.hidden, layers=args.layers,
                       epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay,
                       dropout=args.dropout, seed=args.seed,
                       device=device, fanout=args.fanout, batch_size=args.batch_size,
                       num_workers=args.num_workers, log_every=args.log_every,
                       stock_form=args.stock_form, autocast=args.autocast,
                       progress=False if args.no_progress else None)


def _check(args) -> Optional[str]:
    if args.k < 1:
        return "--k must be at least 1"
    if args.epochs < 1 or args.layers < 1 or args.hidden < 1:
        return "--epochs, --layers and --hidden must be at least 1"
    if args.ddp and args.loader != "neighbor":
        return "--ddp trains on mini-batches: add --loader neighbor"
    if args.loader == "neighbor" and len(args.fanout) != args.layers:
        return (f"--fanout gives {len(args.fanout)} hops but --layers is {args.layers}: "
                f"give one fanout per layer")
    return None


def train(args) -> int:
    problem = _check(args)
    if problem:
        print(f"pyg-maxk train: error: {problem}", file=sys.stderr)
        return 2
    if not args.keep_denormals:
        flush_denormals(args.device)  # before any parallel op starts torch's threads
    if not args.ddp:
        return _train(args, 0, 1, args.device, None)
    try:
        return _train(args, *ddp_context(args.device))
    finally:
        ddp_shutdown()


def _train(args, rank: int, world: int, device: str, all_reduce) -> int:
    cfg = _config(args, device)
    try:
        task = load_dataset(args.dataset, args.root, scale=args.scale, seed=args.seed)
    except DatasetUnavailable as err:
        print(f"pyg-maxk train: error: {err}", file=sys.stderr)
        return 2
    main_rank = rank == 0
    data = task.data
    if main_rank:
        print(f"dataset {task.name}: {data.num_nodes} nodes, {data.num_edges} edges, "
              f"{data.num_features} features, {task.num_classes} "
              f"{'labels' if task.multilabel else 'classes'}; model {args.model}, "
              f"{args.layers} layers x {args.hidden}, {args.loader} batch"
              f"{f', {world} processes' if world > 1 else ''}, device {device}", flush=True)

    if args.loader == "full" and args.compare:
        # Full batch, epochs alternating: both models see the same host drift.
        maxk, stock = train_full_batch_side_by_side(task, cfg, [args.k, None], main_rank)
        results = {"maxk": maxk, "stock": stock}
    elif args.loader == "full":
        results = {"maxk": train_full_batch(task, cfg, args.k, main_rank)}
    else:
        results = {"maxk": train_neighbor(task, cfg, args.k, main_rank, rank, world, all_reduce)}
        if args.compare:
            results["stock"] = train_neighbor(task, cfg, None, main_rank, rank, world,
                                              all_reduce)
    if args.save_model:
        save_model(results["maxk"].model, args.save_model, rank, world)
    if main_rank:
        print_summary(results, task.metric, args)
    return 0


def save_model(model: torch.nn.Module, path: str, rank: int, world: int) -> None:
    model = getattr(model, "module", model)  # unwrap DistributedDataParallel
    if world > 1:
        path = f"{path}.rank{rank}"
    torch.save(model.state_dict(), path)


def print_summary(results: Dict[str, object], metric: str, args) -> None:
    per_s = args.loader == "neighbor"
    header = f"{'model':<26}{'test ' + metric:>16}{'epoch ms':>12}{'speedup':>9}{'peak MiB':>11}"
    if per_s:
        header += f"{'seeds/s':>11}"
    print()
    print(header)
    stock = results.get("stock")
    for r in results.values():
        speedup = stock.epoch_ms / r.epoch_ms if stock is not None else float("nan")
        label = r.label if r is not stock else f"{r.label} ({r.adjacency})"
        line = (f"{label:<26}{r.test_metric:>16.4f}{r.epoch_ms:>12.2f}"
                f"{_fmt(speedup, '{:.2f}x'):>9}{_fmt(r.peak_mib, '{:.1f}'):>11}")
        if per_s:
            line += f"{r.seeds_per_s:>11.0f}"
        print(line)
    m = results["maxk"]
    if stock is not None:
        print(f"summary: MaxK k={args.k} test {metric} {m.test_metric:.4f} vs stock "
              f"({stock.adjacency}) {stock.test_metric:.4f}, epoch {m.epoch_ms:.2f} ms vs "
              f"{stock.epoch_ms:.2f} ms ({stock.epoch_ms / m.epoch_ms:.2f}x)")
    else:
        print(f"summary: MaxK k={args.k} test {metric} {m.test_metric:.4f}, "
              f"epoch {m.epoch_ms:.2f} ms")


def _fmt(value: float, pattern: str) -> str:
    return "-" if math.isnan(value) else pattern.format(value)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return train(args)
    return 1  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
