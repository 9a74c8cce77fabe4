"""Host overhead: per MaxK op, and per small-graph training step.

    python benchmarks/overhead.py            # the "numba" backend on a GPU
    python benchmarks/overhead.py --tiny     # the "cpu" backend (CI smoke run)
    python benchmarks/overhead.py --blocks   # steps timed 5 at a time (throughput)
    python benchmarks/overhead.py --backward-on-calling-thread --out DIR  # no device thread

Ops: on a tiny graph (1,000 nodes, 5,000 edges, dim 256, k=32) the device
work is negligible, so the wall time per call is the Python + launch
overhead (input checks, dispatch, the custom-op layer, the launch). On a GPU
the profiler then separates kernel time from the rest on the Reddit-shaped
graph. Every op is checked against the torch backend before it is timed.

Steps: one training step (input linear, two convs 256 wide, output linear,
cross-entropy, Adam) of SAGE, GCN and GIN on a Cora-sized graph, MaxK k=32
against the stock ReLU model, timed round-robin: on a fixed graph (stock in
each form: ``edge_index`` and a ``torch.sparse`` CSR ``adj_t``; the fastest
is named) and with a new ``edge_index`` tensor every step (as mini-batches
give; stock on ``edge_index``); each step timed to its own end (a sync
after each: latency), or with ``--blocks`` each round's 5 steps together
(throughput: the host queues a step while the GPU runs the last, as in a
training loop that does not sync per step). On the fixed graph also the stock step in
each form with PyG's ``propagate`` as the identity (no aggregation at all):
the fastest stock step over that of its form bounds what a faster
aggregation alone can gain there. Compiled (``torch.compile`` default mode;
on a GPU also ``reduce-overhead``): MaxK with ``fullgraph=True`` on a
prepared graph against stock compiled on ``edge_index`` (the form dynamo
compiles), and MaxK's eager step on the same graph beside them, each
checked against eager first. On a GPU also the host syncs
(``torch.cuda.set_sync_debug_mode``, with the package's lines that sync) and
kernel launches per step. On a CPU, denormal floats are flushed to zero
on both sides, as in ``train.py``.

With ``--small`` the step tables run on a host-bound graph instead: 200
nodes, about 780 edges, 64 features, two convs 64 wide, MaxK k=16 (the size of
a mini-batch of small graphs, where a step's time is host time on a CPU
too); the op table is left out. With ``--main-job`` the fixed-graph table
alone, on the step of ``pyg-maxk train --compare`` with its defaults: the
embedded 5,000-node graph, two convs 64 wide, MaxK k=16, dropout 0.2 (on
the kept values with MaxK, after ReLU in the stock model), GCN's
normalisation cached on both sides.

Writes ``benchmarks/results/overhead[-tiny][-small|-main-job].json`` and ``.png``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import time
import traceback
import types
import warnings
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from common import RESULTS, environment, paired_speedup, pyplot, rel_error, save, time_interleaved
from torch_geometric.nn import MessagePassing
from train import adjacency, check_compiled, prepared_graph

import pyg_maxk
from pyg_maxk import CSRGraph
from pyg_maxk.app.datasets import PRESETS, power_law_edge_index, preset_dataset
from pyg_maxk.app.training import flush_denormals
from pyg_maxk.nn import MaxKGCN, MaxKGIN, MaxKGraphSAGE

STEP_MODELS = {"sage": MaxKGraphSAGE, "gcn": MaxKGCN, "gin": MaxKGIN}
#: The stock model's step with PyG's ``propagate`` as the identity (and the
#: stock form after it).
NO_MESSAGE_PASSING = "no message passing, stock"


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
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds of 5 steps (default: 3 with --tiny, else 30)")
    p.add_argument("--blocks", action="store_true",
                   help="time each round's 5 steps together, one sync after the last "
                        "(throughput), instead of one sync per step (latency)")
    p.add_argument("--backward-on-calling-thread", action="store_true",
                   help="run every backward on the calling thread, both sides "
                        "(torch.autograd.set_multithreading_enabled(False)), not on "
                        "autograd's device thread")
    p.add_argument("--small", action="store_true",
                   help="step tables only, on a host-bound graph (module docs)")
    p.add_argument("--main-job", action="store_true",
                   help="the fixed-graph table only, on the step of `pyg-maxk train` "
                        "(module docs)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    dev = torch.device("cpu" if args.tiny else "cuda")
    flush_denormals(dev)  # as train.py and `pyg-maxk train`: both sides alike
    torch.autograd.set_multithreading_enabled(not args.backward_on_calling_thread)
    backend = "cpu" if args.tiny else "numba"
    results = {"backend": backend,
               "backward_thread": "calling" if args.backward_on_calling_thread else "device"}
    if args.small and args.main_job:
        p.error("--small and --main-job choose different step tables: give one")
    step_tables_only = args.small or args.main_job
    if not step_tables_only:
        results.update(op_host_us(dev, backend))
    shape = (SMALL if args.small else MAIN_JOB if args.main_job
             else StepShape("cora-like", 0.2 if args.tiny else 1.0, None, 256, 32))
    results["step_shape"] = shape._asdict()
    results["steps"] = small_graph_steps(dev, backend, shape,
                                         rounds=args.rounds or (3 if args.tiny else 30),
                                         in_blocks=args.blocks,
                                         scenarios=["fixed graph"] if args.main_job else None)
    results["timing"] = "blocks of 5 steps" if args.blocks else "each step"
    if not args.tiny and not step_tables_only:
        results.update(profile_reddit(dev))
    name = ("overhead" + ("-tiny" if args.tiny else "") + ("-small" if args.small else "")
            + ("-main-job" if args.main_job else ""))
    payload = {"benchmark": "overhead", "environment": environment(dev), **results}
    save(name, payload, Path(args.out),
         lambda path, hw: plot_steps(payload["steps"], shape, hw, path))


class StepShape(NamedTuple):
    """The graph and model of the step tables: a preset's shape (``scale``
    times its nodes and edges; ``features`` in place of its own where set),
    two convs ``width`` wide, MaxK's ``k``, the models' dropout, and whether
    GCN caches its normalisation on both sides (as ``pyg-maxk train`` does
    in full batch; otherwise stock's GCN normalises on every step)."""
    preset: str
    scale: float
    features: Optional[int]
    width: int
    k: int
    dropout: float = 0.0
    gcn_cached: bool = False


#: ``--small``: 200 nodes and about 780 edges (Cora's shape, scaled), 64 features, 64 wide.
SMALL = StepShape("cora-like", 200 / 2708, 64, 64, 16)
#: ``--main-job``: the step of ``pyg-maxk train --compare`` with its defaults.
MAIN_JOB = StepShape("small", 1.0, None, 64, 16, 0.2, gcn_cached=True)


def op_host_us(dev, backend: str) -> dict:
    """Host µs per call of each op (and of stock's ops) on a 1,000-node graph."""
    results = {}
    ei = power_law_edge_index(1000, 5000, seed=0, device=dev)
    g = CSRGraph.from_adj(ei, (1000, 1000), normalization="mean")
    x = torch.randn(1000, 256, device=dev)
    results["rel_error_vs_torch_backend"] = check_ops(g, x, 32, backend)
    with pyg_maxk.use_backend(backend):
        h = pyg_maxk.maxk(x, 32)
        results["host_us_maxk_select"] = host_us(lambda: pyg_maxk.maxk(x, 32), dev)
        results["host_us_spgemm"] = host_us(lambda: pyg_maxk.aggregate(g, h), dev)
        results["host_us_to_dense"] = host_us(lambda: h.to_dense(), dev)
        results["host_us_maxk_aggregate"] = host_us(
            lambda: pyg_maxk.ops.maxk_aggregate(x, 32, g), dev)
        results.update(forward_backward_host_us(g, x, dev))
    results["host_us_torch_topk"] = host_us(lambda: torch.topk(x, 32, dim=1), dev)
    results["host_us_torch_sparse_spmm"] = host_us(
        lambda: torch.sparse.mm(g.torch_csr(torch.float32), x), dev)
    print({k: v for k, v in results.items() if k.startswith("host")}, flush=True)
    return results


def forward_backward_host_us(g, x, dev) -> dict:
    """Host µs of each op's forward and backward (a ``backward()`` call of
    its own: its fixed cost is the "view" row), beside the ATen ops that
    stock uses for the same step."""
    xg = x.clone().requires_grad_()
    w = torch.randn(256, 256, device=dev, requires_grad=True)
    csr = g.torch_csr(torch.float32)
    h = pyg_maxk.maxk(x, 32)
    values = h.values.clone().requires_grad_()
    ones = torch.ones(x.size(0), 256, device=dev)
    cases = {
        "view": lambda: xg.view_as(xg).backward(ones),
        "maxk_select": lambda: pyg_maxk.maxk(xg, 32).values.backward(ones[:, :32]),
        "spgemm": lambda: pyg_maxk.aggregate(g, h.with_values(values)).backward(ones),
        "to_dense": lambda: pyg_maxk.ops.to_dense(h.with_values(values)).backward(ones),
        "maxk_aggregate": lambda: pyg_maxk.ops.maxk_aggregate(xg, 32, g)[0].backward(ones),
        "maxk_select_then_spgemm": lambda: pyg_maxk.aggregate(g, pyg_maxk.maxk(xg, 32))
        .backward(ones),
        "cbsr_linear": lambda: pyg_maxk.ops.cbsr_linear(h.with_values(values), w)
        .backward(ones),
        "torch_topk": lambda: torch.topk(xg, 32, dim=1).values.backward(ones[:, :32]),
        "torch_sparse_spmm": lambda: torch.sparse.mm(csr, xg).backward(ones),
        "torch_linear": lambda: F.linear(xg, w).backward(ones),
    }
    return {f"host_us_fwd_bwd_{name}": host_us(fn, dev) for name, fn in cases.items()}


def _compiled_train_step(model, x, adj, y, mode: str):
    """One step of ``torch.compile(model, mode=mode)`` (fullgraph on a
    prepared MaxK graph), after checking its loss and gradients against
    eager's."""
    cudagraphs = mode == "reduce-overhead"
    _forward_of_its_own(model)
    compiled = torch.compile(model, mode=None if mode == "default" else mode,
                             fullgraph=isinstance(adj, CSRGraph))
    check_compiled(model, compiled, x, adj, y, cudagraphs)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step():
        if cudagraphs:  # a new iteration of CUDA-graph replays
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(compiled(x, adj), y).backward()
        opt.step()
    return step


def _forward_of_its_own(model) -> None:
    """Give ``model`` a forward with a code object of its own. Dynamo keeps
    compiled code per code object, and the MaxK and stock models share their
    class's forward: compiled one after the other, the stock model's graph
    breaks would reach the MaxK model's ``fullgraph`` code."""
    f = type(model).forward
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                             f.__closure__)
    own.__kwdefaults__ = f.__kwdefaults__
    model.forward = types.MethodType(own, model)


def _train_step(model, x, adj_of, y, without_message_passing=False):
    """One step of ``model``; ``adj_of()`` gives the adjacency of each step.
    ``without_message_passing``: PyG's ``propagate`` returns its input
    features unchanged (a stock model's step minus its aggregations)."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        with (_identity_propagate(model) if without_message_passing
              else contextlib.nullcontext()):
            F.cross_entropy(model(x, adj_of()), y).backward()
        opt.step()
    return step


@contextlib.contextmanager
def _identity_propagate(model: torch.nn.Module):
    """Every conv of ``model`` with ``propagate`` as the identity on its
    source features. Set on each conv itself: PyG gives every conv class a
    generated ``propagate`` of its own, which a patch of
    ``MessagePassing.propagate`` would not reach."""
    def propagate(edge_index, size=None, **kwargs):
        x = kwargs["x"]
        return x[0] if isinstance(x, tuple) else x
    convs = [m for m in model.modules() if isinstance(m, MessagePassing)]
    for conv in convs:
        conv.propagate = propagate
    try:
        yield
    finally:
        for conv in convs:
            del conv.propagate


def host_syncs(step) -> dict:
    """The synchronising CUDA calls of one ``step``, by the package's lines
    that make them (innermost first)."""
    sites = collections.Counter()

    def record(message, *args, **kwargs):
        # The sync warnings' own text: turning the mode on also warns once
        # that it "does not yet detect all synchronizing operations".
        if "called a synchronizing CUDA operation" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "pyg_maxk" in f.filename]
            sites[" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                              for f in frames[::-1][:3]) or "(no pyg_maxk frame)"] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        warnings.showwarning = shown
    return {"count": sum(sites.values()), "sites": dict(sites)}


def kernel_launches(step) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def small_graph_steps(dev, backend: str, shape: StepShape, rounds: int,
                      in_blocks: bool = False, scenarios: Optional[list] = None) -> dict:
    """MaxK against stock training steps on a small graph (module docs):
    every scenario, or those named in ``scenarios``."""
    data = preset_dataset(shape.preset, scale=shape.scale, seed=0).to(dev)
    x, y, n = data.x, data.y, data.num_nodes
    if shape.features is not None:
        x = x[:, :shape.features].contiguous()
    ei = data.edge_index[:, data.edge_index[1].argsort(stable=True)]
    classes = int(data.num_classes)
    stock_forms = {"edge_index": ei, "csr": adjacency("csr", ei, n)}
    table = {}
    if scenarios is None:
        scenarios = ["fixed graph", "new graph", "compiled default"]
        if dev.type == "cuda":
            scenarios.append("compiled reduce-overhead")
        # Full-batch features never change: as a static input, CUDA graphs
        # read them in place instead of copying them on every replay.
        torch._dynamo.mark_static_address(x)
    for kind, cls in STEP_MODELS.items():
        def model(k):
            torch.manual_seed(0)
            cached = {"cached": True} if kind == "gcn" and shape.gcn_cached else {}
            return cls(x.size(1), shape.width, 2, classes, k=k, dropout=shape.dropout,
                       **cached).to(dev)
        for scenario in scenarios:
            with pyg_maxk.use_backend(backend):
                steps = _scenario_steps(scenario, kind, model, shape.k, x, ei, y, stock_forms)
                times = time_interleaved(steps, dev, rounds=rounds, per_round=5, warmup=5,
                                         in_blocks=in_blocks)
                entry = {"times": times, "nodes": n}
                stock = {name: t["median_ms"] for name, t in times.items()
                         if name.startswith("stock")}
                fastest = min(stock, key=stock.get)
                entry["fastest_stock"] = fastest[len("stock "):]
                maxk = maxk_label(shape.k)
                entry["speedup"] = paired_speedup(times[fastest], times[maxk])
                floor = f"{NO_MESSAGE_PASSING} {entry['fastest_stock']}"
                if floor in times:
                    # What removing every aggregation of the fastest stock
                    # step would gain: a bound on what a faster aggregation
                    # alone gains (GCN's MaxK also skips stock's per-step
                    # normalisation, which stays in this step).
                    entry["speedup_without_message_passing"] = paired_speedup(
                        times[fastest], times[floor])
                if maxk + EAGER in times:
                    entry["compiled_over_eager"] = paired_speedup(times[maxk + EAGER],
                                                                  times[maxk])
                if dev.type == "cuda":
                    for name, step in steps.items():
                        entry.setdefault("syncs", {})[name] = host_syncs(step)
                        entry.setdefault("launches", {})[name] = kernel_launches(step)
            table[f"{kind} {scenario}"] = entry
            _print_step(kind, scenario, entry, stock[fastest], maxk)
            if scenario.startswith("compiled"):
                torch._dynamo.reset()  # the next models compile afresh
    return table


def maxk_label(k: int) -> str:
    """The MaxK step's name in the tables."""
    return f"maxk k={k}"


#: The suffix of the eager MaxK step timed beside the compiled ones.
EAGER = " eager"


def _scenario_steps(scenario: str, kind: str, model, k: int, x, ei, y,
                    stock_forms: dict) -> dict:
    """The steps timed together in ``scenario``: MaxK's first."""
    maxk = maxk_label(k)
    if scenario.startswith("compiled"):
        mode = scenario[len("compiled "):]
        graph = prepared_graph(kind, ei, x.size(0), k)
        return {maxk: _compiled_train_step(model(k), x, graph, y, mode),
                f"stock edge_index compiled {mode}": _compiled_train_step(
                    model(None), x, ei, y, mode),
                maxk + EAGER: _train_step(model(k), x, lambda: graph, y)}
    new = scenario == "new graph"
    steps = {maxk: _train_step(model(k), x, (lambda: ei.clone()) if new else (lambda: ei), y)}
    for form, adj in stock_forms.items():
        if new and form != "edge_index":
            continue
        steps[f"stock {form}"] = _train_step(
            model(None), x, (lambda: ei.clone()) if new else (lambda a=adj: a), y)
        if not new:
            steps[f"{NO_MESSAGE_PASSING} {form}"] = _train_step(
                model(None), x, lambda a=adj: a, y, without_message_passing=True)
    return steps


def _print_step(kind: str, scenario: str, entry: dict, stock_ms: float, maxk: str) -> None:
    times, s = entry["times"], entry["speedup"]
    bound = entry.get("speedup_without_message_passing")
    eager = entry.get("compiled_over_eager")
    line = (f"{kind:4s} {scenario:24s}: MaxK {times[maxk]['median_ms']:.3f} ms, "
            f"stock {entry['fastest_stock']} {stock_ms:.3f} ms: "
            f"{s['speedup']:.2f}x ({s['ci95'][0]:.2f}-{s['ci95'][1]:.2f})")
    if bound:
        line += f"; without message passing {bound['speedup']:.2f}x"
    if eager:
        line += f"; MaxK compiled over eager {eager['speedup']:.2f}x"
    if "syncs" in entry:
        stock = "stock " + entry["fastest_stock"]
        line += (f"; syncs {entry['syncs'][maxk]['count']} vs "
                 f"{entry['syncs'][stock]['count']}, launches "
                 f"{entry['launches'][maxk]} vs {entry['launches'][stock]}")
    print(line, flush=True)


def plot_steps(steps: dict, shape: StepShape, hardware: str, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = list(steps)
    speedups = [steps[label]["speedup"]["speedup"] for label in labels]
    errors = [[s - steps[label]["speedup"]["ci95"][0] for label, s in zip(labels, speedups)],
              [steps[label]["speedup"]["ci95"][1] - s for label, s in zip(labels, speedups)]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(range(len(labels)), speedups, yerr=errors, color="tab:green")
    bounds = [(i, steps[label]["speedup_without_message_passing"]["speedup"])
              for i, label in enumerate(labels)
              if "speedup_without_message_passing" in steps[label]]
    if bounds:
        ax.scatter(*zip(*bounds), marker="_", s=400, color="black",
                   label="stock without message passing (bound)")
        ax.legend(fontsize=8)
    ax.axhline(1, color="grey", lw=0.8)
    names = [f"{label}\n(stock {steps[label]['fastest_stock']})" for label in labels]
    ax.set_xticks(range(len(labels)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("MaxK speedup over the fastest stock form")
    nodes = next(iter(steps.values()))["nodes"]
    dropout = f", dropout {shape.dropout}" if shape.dropout else ""
    ax.set_title(f"{nodes}-node training step, 2 x {shape.width}, k={shape.k}{dropout}: "
                 f"{hardware}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
