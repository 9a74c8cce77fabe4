"""The first training step of a fresh process, eager against compiled, with
cold and warm caches.

    python benchmarks/first_step.py                       # Reddit-shaped SAGE, H200
    python benchmarks/first_step.py --tiny                # CPU smoke run (CI)

Each measurement runs in a new Python process, so that its first step pays for
everything a user's first step pays for. Every variant runs twice on one set
of fresh, empty cache directories: **cold** (the process compiles the Numba
kernels, and under ``torch.compile`` dynamo and Inductor compile the model)
and then **warm** (a second process finds the compiled kernels in the
package's kernel cache, ``PYG_MAXK_KERNEL_CACHE``, and Inductor's code in its
own cache). The variants: the MaxK model eager on ``edge_index``, and compiled
(``default`` and ``reduce-overhead``) on a graph prepared by
:class:`pyg_maxk.ToCSRGraph` with ``fullgraph=True``. Each process then times
``--repeats`` more steps (the steady epoch, CUDA-event median) and checks that
its loss is finite. Writes ``benchmarks/results/first_step[-tiny].json`` and a
``.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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


def run_child(args, variant: str, caches: str) -> dict:
    """One variant in a new process whose caches (the package's kernel cache,
    Numba's CPU cache, Inductor's) all live under ``caches``."""
    cmd = [sys.executable, __file__, "--child", variant, "--graph", args.graph,
           "--model", args.model, "--k", str(args.k), "--repeats", str(args.repeats)]
    if args.tiny:
        cmd.append("--tiny")
    env = dict(os.environ, PYG_MAXK_KERNEL_CACHE=os.path.join(caches, "pyg_maxk"),
               NUMBA_CACHE_DIR=os.path.join(caches, "numba"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
               TRITON_CACHE_DIR=os.path.join(caches, "triton"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"first_step.py: variant {variant} failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    results = {}
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory(prefix="first-step-") as caches:
            results[variant] = {temperature: run_child(args, variant, caches)
                                for temperature in ("cold", "warm")}
        cold, warm = results[variant]["cold"], results[variant]["warm"]
        print(f"{variant:16s} first step cold {cold['first_step_s']:8.2f} s, warm "
              f"{warm['first_step_s']:8.2f} s, then {warm['median_ms']:8.2f} ms per epoch",
              flush=True)
    import torch
    from common import environment, pyplot, write_json
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
        at = range(len(names))
        for shift, temperature, color in ((-0.2, "cold", "tab:blue"), (0.2, "warm", "tab:orange")):
            axes[0].bar([i + shift for i in at],
                        [results[v][temperature]["first_step_s"] for v in names],
                        width=0.4, color=color, label=f"{temperature} caches")
        axes[0].set_xticks(list(at), names)
        axes[0].set_ylabel("first step (s)")
        axes[0].legend()
        axes[1].bar(names, [results[v]["warm"]["median_ms"] for v in names], color="tab:green")
        axes[1].set_ylabel("later epochs (ms, median)")
        fig.suptitle(f"MaxK {args.model} k={args.k} on {payload['graph']}: "
                     f"{payload['environment'].get('gpu', 'CPU')}")
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)


if __name__ == "__main__":
    main()
