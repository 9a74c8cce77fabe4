"""The first training step of a fresh process, eager against compiled.

    python benchmarks/first_step.py                       # Reddit-shaped SAGE, H200
    python benchmarks/first_step.py --tiny                # CPU smoke run (CI)

Each variant runs in a new Python process, so that its first step pays for
everything a user's first step pays for: the Numba kernels' compilation (every
process compiles them), and under ``torch.compile`` dynamo and Inductor. The
variants: the MaxK model eager on ``edge_index``, and compiled (``default``
and ``reduce-overhead``) on a graph prepared by :class:`pyg_maxk.ToCSRGraph`
with ``fullgraph=True``. Each process then times ``--repeats`` more steps
(the steady epoch, CUDA-event median) and checks that its loss is finite.
Writes ``benchmarks/results/first_step[-tiny].json`` and a ``.png``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("eager", "default", "reduce-overhead")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small CPU smoke run")
    p.add_argument("--graph", default="reddit", help="a workload of train.py")
    p.add_argument("--model", default="sage")
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(args) -> dict:
    """One variant, in this (fresh) process."""
    import time

    import torch
    import torch.nn.functional as F

    import train
    from common import time_ms

    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cpu":
        train.flush_denormals(device)
    preset, layers = train.WORKLOADS["cora" if args.tiny else args.graph]
    data = train.make_graph(preset, device)
    n, ei, x, y = data["num_nodes"], data["edge_index"], data["x"], data["y"]
    torch.manual_seed(0)
    model = train.MODELS[args.model](x.size(1), train.HIDDEN, layers, data["num_classes"],
                                     k=args.k, **train.CONV_KWARGS[args.model]).to(device)
    variant = args.child
    if variant == "reduce-overhead":
        torch._dynamo.mark_static_address(x)  # read in place by CUDA graphs, not copied
    adj = ei if variant == "eager" else train.prepared_graph(args.model, ei, n, args.k)
    run = model if variant == "eager" else torch.compile(
        model, mode=None if variant == "default" else variant, fullgraph=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []

    def step():
        if variant == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(run(x, adj), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    step()
    sync()
    first_s = time.perf_counter() - start
    t = time_ms(step, device, warmup=2, repeats=args.repeats)
    assert all(bool(torch.isfinite(loss)) for loss in losses), "a loss is not finite"
    return {"variant": variant, "first_step_s": first_s, **t}


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    results = {}
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--child", variant, "--graph", args.graph,
               "--model", args.model, "--k", str(args.k), "--repeats", str(args.repeats)]
        if args.tiny:
            cmd.append("--tiny")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"first_step.py: variant {variant} failed")
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[variant]
        print(f"{variant:16s} first step {r['first_step_s']:8.2f} s, then "
              f"{r['median_ms']:8.2f} ms per epoch", flush=True)
    from common import environment, pyplot, write_json

    import torch
    device = torch.device("cpu" if args.tiny else "cuda")
    payload = {"benchmark": "first_step", "environment": environment(device),
               "graph": "cora" if args.tiny else args.graph, "model": args.model, "k": args.k,
               "variants": results}
    name = "first_step-tiny" if args.tiny else "first_step"
    out = Path(args.out)
    print(f"wrote {write_json(name, payload, out)}")
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        names = list(results)
        axes[0].bar(names, [results[v]["first_step_s"] for v in names], color="tab:blue")
        axes[0].set_ylabel("first step (s)")
        axes[1].bar(names, [results[v]["median_ms"] for v in names], color="tab:green")
        axes[1].set_ylabel("later epochs (ms, median)")
        fig.suptitle(f"MaxK {args.model} k={args.k} on {payload['graph']}: "
                     f"{payload['environment'].get('gpu', 'CPU')}")
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
