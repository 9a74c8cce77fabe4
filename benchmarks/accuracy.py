"""Accuracy parity: MaxK against the stock ReLU model, mean +- std of the test
accuracy over seeds (model selected at the best validation epoch).

    python benchmarks/accuracy.py --root DIR     # Cora, CiteSeer (DIR/Cora/raw, ...) + synthetic
    python benchmarks/accuracy.py --tiny         # one seed, few epochs (CI smoke run)
    python benchmarks/accuracy.py --root DIR --autocast bf16   # + MaxK rows under autocast

Planetoid runs use the public split. With ``--autocast bf16`` (or ``fp16``)
every MaxK k also trains with its forward passes under ``torch.autocast``
(``k=K autocast bf16``). Writes benchmarks/results/accuracy[-tiny].json,
.md (the README table) and .png.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from common import RESULTS, environment, pyplot, write_json

from pyg_maxk.app.datasets import DatasetUnavailable, load_dataset
from pyg_maxk.app.training import TrainConfig, train_full_batch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="data", help="folder holding Cora/ and CiteSeer/")
    p.add_argument("--datasets", default="Cora,CiteSeer,small")
    p.add_argument("--models", default="sage,gcn,gin")
    p.add_argument("--k", default="16,32", help="MaxK k values")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--autocast", choices=["bf16", "fp16"], default=None,
                   help="also train every MaxK k under torch.autocast with this dtype")
    p.add_argument("--tag", default="", help="suffix of the result files' names")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    datasets, models = args.datasets.split(","), args.models.split(",")
    ks = [int(k) for k in args.k.split(",")]
    seeds, epochs = (1, 5) if args.tiny else (args.seeds, args.epochs)
    if args.tiny:
        datasets, models, ks = ["small"], ["sage"], ks[:1]
    rows = []
    for name in datasets:
        try:
            task = load_dataset(name, args.root, seed=0)
        except DatasetUnavailable as err:  # no files and no network: the CLI's message
            raise SystemExit(f"accuracy.py: error: {err}") from None
        for model in models:
            runs = {}
            for k, cast in variants(ks, args.autocast):
                accs = []
                for seed in range(seeds):
                    cfg = TrainConfig(model=model, hidden=args.hidden, layers=2, epochs=epochs,
                                      lr=args.lr, weight_decay=args.weight_decay,
                                      dropout=args.dropout, seed=seed, device=args.device,
                                      autocast=cast)
                    accs.append(100 * train_full_batch(task, cfg, k, verbose=False).test_metric)
                runs[label(k, cast)] = {
                    "mean": statistics.mean(accs),
                    "std": statistics.stdev(accs) if len(accs) > 1 else 0.0, "runs": accs}
                kind = "ReLU" if k is None else f"MaxK {label(k, cast)}"
                print(f"{name:9s} {model:5s} {kind:10s} "
                      f"{runs[list(runs)[-1]]['mean']:6.2f} +- {runs[list(runs)[-1]]['std']:.2f}",
                      flush=True)
            rows.append({"dataset": name, "model": model, "results": runs})
            path = save(rows, ks, args)  # after every row: a long run stopped early keeps its rows
    print(markdown(rows, ks, args.hidden, args.autocast))
    print(f"wrote {path}")


def variants(ks, cast):
    """``(k, autocast)`` of every run of a model: the stock ReLU model, each
    MaxK k, and each MaxK k under autocast (when asked for)."""
    return [(None, None)] + [(k, None) for k in ks] + ([(k, cast) for k in ks] if cast else [])


def label(k, cast) -> str:
    return "relu" if k is None else f"k={k}" + (f" autocast {cast}" if cast else "")


def save(rows, ks, args) -> Path:
    """Write the JSON, the markdown table and the plot of ``rows``."""
    name = "accuracy-tiny" if args.tiny else "accuracy"
    if args.tag:
        name += f"-{args.tag}"
    config = {k: v for k, v in vars(args).items() if k not in ("out",)}
    payload = {"benchmark": "accuracy", "environment": environment(torch.device(args.device)),
               "config": config, "rows": rows}
    out_dir = Path(args.out)
    path = write_json(name, payload, out_dir)
    (out_dir / f"{name}.md").write_text(markdown(rows, ks, args.hidden, args.autocast))
    plot(rows, out_dir / f"{name}.png")
    return path


def markdown(rows, ks, hidden, cast=None) -> str:
    maxk = variants(ks, cast)[1:]
    head = "| dataset | model | ReLU | " + " | ".join(
        f"MaxK {label(k, c)} (of {hidden})" for k, c in maxk) + " |"
    lines = [head, "|" + "---|" * (3 + len(maxk))]
    for r in rows:
        res = r["results"]
        relu = res["relu"]["mean"]
        cells = [f"{res['relu']['mean']:.2f} ± {res['relu']['std']:.2f}"]
        for k, c in maxk:
            m = res[label(k, c)]
            cells.append(f"{m['mean']:.2f} ± {m['std']:.2f} ({m['mean'] - relu:+.2f})")
        lines.append(f"| {r['dataset']} | {r['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = [f"{r['dataset']}\n{r['model']}" for r in rows]
    keys = list(rows[0]["results"]) if rows else []
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows)), 4))
    width = 0.8 / max(1, len(keys))
    for i, key in enumerate(keys):
        means = [r["results"][key]["mean"] for r in rows]
        stds = [r["results"][key]["std"] for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], means, width, yerr=stds, label=key)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], labels, fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(bottom=min([50] + [r["results"][k]["mean"] - 5 for r in rows for k in keys]))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
