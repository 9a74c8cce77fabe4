"""End-to-end training benchmark: full-batch MaxK epochs against stock PyG.

    python benchmarks/train.py                 # Reddit-, products- and Cora-shaped graphs (GPU)
    python benchmarks/train.py --tiny          # CPU smoke run on a small graph (CI)
    python benchmarks/train.py --graphs reddit --models sage --k 8,32
    python benchmarks/train.py --graphs arxiv --out benchmarks/results/arxiv   # ogbn-arxiv's shape
    python benchmarks/train.py --device cpu --graphs reddit --scale 0.02 --forms edge_index,csr
    python benchmarks/train.py --graphs products --models sage --tf32   # TF32 matmuls, both sides
    python benchmarks/train.py --graphs cora,arxiv --models sage,gin --deterministic
    python benchmarks/train.py --graphs cora --compile default,reduce-overhead,cuda-graph
    python benchmarks/train.py --graphs reddit,products --models sage --autocast bf16

For every graph and model (SAGE, GCN, GIN: an input linear map, L convs of
width 256, an output linear map, Adam) it times one training epoch (forward,
cross-entropy, backward, optimizer step)

* of the stock PyG model (ReLU) with every stock input form: ``edge_index``,
  ``EdgeIndex``, a ``torch.sparse`` CSR ``adj_t`` with int64 indices
  (``csr``) and with int32 ones (``csr-int32``), and ``SparseTensor`` when
  torch_sparse is present (and works on the device);
* of the stock model on the same nodes with *no edges* (same input form as
  the CSR run): the time spent outside message passing, from which the
  Amdahl limit ``stock epoch / outside time`` follows;
* of the MaxK model (the same model with MaxK convs), after checking that its
  output matches the ``"torch"`` backend's;
* with ``--compile MODES``, of both models under ``torch.compile(model,
  mode=MODE)`` for each mode (``default``, ``reduce-overhead``: CUDA graphs):
  the stock model with ``edge_index`` (the form dynamo compiles), the MaxK
  model on a graph prepared by :class:`pyg_maxk.ToCSRGraph` with
  ``fullgraph=True``; each after checking that the compiled model's output
  and gradients match eager's, and with its first (compiling) step timed;
  the mode ``cuda-graph`` (GPU only) instead captures the whole eager step
  (forward, loss, backward, ``Adam(capturable=True)``) in one
  ``torch.cuda.graph`` on both sides and times its replay, after checking
  the replayed loss against eager's: the GPU time of the step, with no host
  time at all, reported as ``captured step``;
* with ``--autocast bf16`` (or ``fp16``), of the MaxK model under
  ``torch.autocast`` (checked against the ``"torch"`` backend under the same
  autocast), and of the stock model in every form both in float32 and under
  the same autocast (a form that fails under it is reported with its error);
  with ``--half-reductions`` too, of the MaxK model under that autocast once
  more with :func:`pyg_maxk.allow_half_reductions` (``autocast bf16 half
  reductions``: packed half sums in the backward, checked the same way).

Stock GCN runs with ``cached=True`` (its normalised graph computed once, as a
full-batch PyG user writes it), as the MaxK GCN caches its graph.

On small graphs (:data:`HOST_BOUND`: the Cora-sized one) an epoch is a few
milliseconds of host time, which drifts by tens of percent between runs a
minute apart; there the stock forms and the MaxK model are timed once more
round-robin in one loop (``"interleaved"`` in the JSON), and the speedups
come from that loop.

Times are CUDA-event medians after warm-up (``perf_counter`` on the CPU);
peak memory is ``torch.cuda.max_memory_allocated`` over the timed epochs.
Float32 matmuls are full IEEE float32 (PyTorch's default) unless ``--tf32``
lets cuBLAS use TF32 tensor cores, for the stock and the MaxK models alike.
On a CPU, denormal floats are flushed to zero for both
(:func:`pyg_maxk.app.training.flush_denormals`, as ``pyg-maxk train`` does):
gradients that decay into that range would otherwise slow later epochs'
matrix products several times.
Every speedup in the summary (``vs_fastest_stock``) is against the fastest
stock entry of the same run, which it names.
``--deterministic`` runs both sides under
``torch.use_deterministic_algorithms(True)``.
Writes ``benchmarks/results/train[-tiny|-cpu][-tf32][-deterministic][-compile]``
``[-autocast-bf16].json`` and a ``.png`` of the same name.
"""
from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from common import (
    RESULTS,
    check_against_torch_backend,
    environment,
    paired_speedup,
    pyplot,
    rel_error,
    time_interleaved,
    time_ms,
    write_json,
)
from torch_geometric.utils import coalesce

import pyg_maxk
from pyg_maxk import clear_graph_cache
from pyg_maxk.app.datasets import PRESETS, power_law_edge_index
from pyg_maxk.app.training import flush_denormals
from pyg_maxk.dispatch import resolve_backend
from pyg_maxk.nn import MaxKGCN, MaxKGIN, MaxKGraphSAGE

MODELS = {"sage": MaxKGraphSAGE, "gcn": MaxKGCN, "gin": MaxKGIN}
#: Each model's conv arguments (both sides) and the normalisation of its graph.
CONV_KWARGS = {"sage": {}, "gcn": {"cached": True}, "gin": {}}
NORMALIZATION = {"sage": "mean", "gcn": "gcn", "gin": "sum"}
#: Graph shape and model depth of each workload (the MaxK-GNN paper's models).
WORKLOADS = {
    "reddit": ("reddit-like", 4),
    "products": ("products-like", 3),
    "arxiv": ("arxiv-like", 3),
    "cora": ("cora-like", 2),
}
FORMS = ("edge_index", "EdgeIndex", "csr", "csr-int32", "SparseTensor")
#: ``--autocast`` names and their dtypes.
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Norm-relative agreement of a whole MaxK model under autocast with the
#: torch backend under the same autocast (half-precision roundings).
AUTOCAST_RTOL = 5e-2
#: Workloads whose epochs are host-bound: also timed interleaved.
HOST_BOUND = ("cora",)
HIDDEN = 256
#: A whole MaxK model's loss and gradients within this of the torch backend's
#: always pass; beyond it, the check bounds them by the model's rounding
#: sensitivity (:func:`~common.check_against_torch_backend`).
MODEL_RTOL = 2e-3


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small CPU smoke run")
    p.add_argument("--graphs", default="reddit,products,cora")
    p.add_argument("--models", default="sage,gcn,gin")
    p.add_argument("--forms", default=",".join(FORMS), help="stock input forms")
    p.add_argument("--large-forms", default=None,
                   help="stock input forms on the large (not host-bound) workloads "
                        "(default: --forms); the others are reported as not requested")
    p.add_argument("--k", default="32", help="MaxK k values, comma separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the graphs' nodes and edges (e.g. 0.02 for a CPU run)")
    p.add_argument("--device", default=None)
    p.add_argument("--tf32", action="store_true",
                   help="allow TF32 in float32 matmuls (both sides; default: IEEE float32)")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) for both sides (and a "
                        "fixed cuBLAS workspace, CUBLAS_WORKSPACE_CONFIG=:4096:8)")
    p.add_argument("--compile", default="",
                   help="torch.compile modes to time too, e.g. default,reduce-overhead; "
                        "cuda-graph: the whole step captured in one CUDA graph (GPU)")
    p.add_argument("--autocast", choices=sorted(AUTOCAST), default=None,
                   help="also time both models under torch.autocast with this dtype")
    p.add_argument("--half-reductions", action="store_true",
                   help="with --autocast, also time MaxK with pyg_maxk.allow_half_reductions")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def make_graph(preset: str, device: torch.device, scale: float = 1.0) -> Dict[str, object]:
    p = PRESETS[preset]
    n = max(16, int(p.num_nodes * scale))
    e = max(n, int(p.num_edges * scale))
    max_deg = None if p.max_degree is None else max(1, min(int(p.max_degree * scale), e // 4))
    g = torch.Generator(device=device).manual_seed(0)
    # One graph for every input form: without duplicate edges (which some
    # stock forms would merge and others not).
    edge_index = coalesce(power_law_edge_index(n, e, max_degree=max_deg, seed=0, device=device),
                          num_nodes=n, sort_by_row=False)
    return {
        "edge_index": edge_index,
        "x": torch.randn(n, p.num_features, device=device, generator=g),
        "y": torch.randint(0, p.num_classes, (n,), device=device, generator=g),
        "num_nodes": n, "num_classes": p.num_classes,
    }


def adjacency(form: str, edge_index: torch.Tensor, n: int):
    """The stock input form of ``edge_index`` (sorted by target)."""
    if form == "edge_index":
        return edge_index
    if form == "EdgeIndex":
        from torch_geometric import EdgeIndex
        return EdgeIndex(edge_index, sparse_size=(n, n), sort_order="col")
    src, dst = edge_index
    if form in ("csr", "csr-int32"):
        int32 = form == "csr-int32"
        rowptr = torch.ops.aten._convert_indices_from_coo_to_csr(dst, n, out_int32=int32)
        ones = torch.ones(src.numel(), device=src.device)
        return torch.sparse_csr_tensor(rowptr, src.int() if int32 else src, ones, (n, n),
                                       check_invariants=False)
    if form == "SparseTensor":
        from torch_sparse import SparseTensor
        return SparseTensor(row=dst, col=src, sparse_sizes=(n, n), is_sorted=True,
                            trust_data=True)
    raise ValueError(form)


def forward_loss(model, x, adj, y, autocast: Optional[torch.dtype] = None):
    """The cross-entropy loss of ``model(x, adj)``, under ``torch.autocast``
    with ``autocast`` (a half dtype) when given."""
    with torch.autocast(x.device.type, dtype=autocast or torch.float32,
                        enabled=autocast is not None):
        return F.cross_entropy(model(x, adj), y)


def epoch_fn(model, opt, x, adj, y, cudagraphs: bool = False,
             autocast: Optional[torch.dtype] = None):
    def step():
        if cudagraphs:  # a new iteration of CUDA-graph replays
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        forward_loss(model, x, adj, y, autocast).backward()
        opt.step()
    return step


def time_epoch(model, x, adj, y, device, repeats,
               autocast: Optional[torch.dtype] = None) -> Dict[str, object]:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = epoch_fn(model, opt, x, adj, y, autocast=autocast)
    if device.type == "cuda":
        # Peak memory counts what is still allocated: collect the cyclic
        # garbage first (an out-of-memory error caught in guarded() leaves
        # traceback cycles holding the failed run's tensors).
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    first_s = _first_call_s(step, device)
    t = time_ms(step, device, warmup=2, repeats=repeats)
    t["first_call_s"] = first_s
    if device.type == "cuda":
        t["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return t


def _first_call_s(step, device) -> float:
    """Seconds of ``step``'s first call (kernel compilation included)."""
    import time
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def guarded(fn, what: str) -> Dict[str, object]:
    """Run a stock-side measurement; out-of-memory and missing ops become a
    note (a stock form that cannot run here is reported as such). The MaxK
    side is never guarded: an error there fails the run."""
    try:
        return fn()
    except (torch.cuda.OutOfMemoryError, RuntimeError, ImportError, NotImplementedError) as err:
        msg = str(err).splitlines()[0][:200]
        print(f"  {what}: skipped ({type(err).__name__}: {msg})", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"skipped": f"{type(err).__name__}: {msg}"}


def messages_fit(form: str, num_edges: int, device: torch.device) -> Optional[str]:
    """Why the gather/scatter path would not fit in GPU memory, or None."""
    if form != "edge_index" or device.type != "cuda":
        return None
    need = num_edges * HIDDEN * 4 * 3  # messages, their gradient, the scatter's copy
    have = torch.cuda.get_device_properties(device).total_memory
    if need > 0.8 * have:
        return f"would materialise [E, {HIDDEN}] messages ({need / 1e9:.0f} GB)"
    return None


def check_maxk_output(model, x, adj, y, autocast: Optional[torch.dtype] = None
                      ) -> Dict[str, float]:
    """The MaxK model's loss and gradients (one training step, train mode)
    on the active backend against the ``"torch"`` reference backend (same
    parameters, same autocast): :func:`~common.check_against_torch_backend`."""
    return check_against_torch_backend(
        model, lambda: forward_loss(model, x, adj, y, autocast),
        MODEL_RTOL if autocast is None else AUTOCAST_RTOL)


def prepared_graph(kind: str, edge_index, n: int, k: int):
    """The MaxK model's graph, built outside the model (no graph break)."""
    from torch_geometric.data import Data
    return pyg_maxk.ToCSRGraph(NORMALIZATION[kind], k=k)(
        Data(edge_index=edge_index, num_nodes=n)).adj_t


#: The ``--compile`` mode that captures the whole step in a CUDA graph.
CAPTURE = "cuda-graph"


def variant(mode: str) -> str:
    """The label of a ``--compile`` mode's runs in the JSON."""
    return "captured step" if mode == CAPTURE else f"compiled {mode}"


def compiled_step(model, x, adj, y, mode: str):
    """An epoch step of ``torch.compile(model, mode=mode)`` (fullgraph on a
    prepared MaxK graph), after checking that the compiled model's output
    and gradients equal eager's; returns (step, seconds of its first call).
    Mode :data:`CAPTURE`: :func:`captured_step`."""
    import time
    if mode == CAPTURE:
        return captured_step(model, x, adj, y)
    torch._dynamo.reset()
    if mode == "reduce-overhead":
        # Full-batch features never change: as a static input, CUDA graphs
        # read them in place instead of copying them on every replay.
        torch._dynamo.mark_static_address(x)
    fullgraph = isinstance(adj, pyg_maxk.CSRGraph)
    compiled = torch.compile(model, mode=None if mode == "default" else mode,
                             fullgraph=fullgraph)
    cudagraphs = mode == "reduce-overhead"
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = epoch_fn(compiled, opt, x, adj, y, cudagraphs)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    check_compiled(model, compiled, x, adj, y, cudagraphs)
    sync()
    return step, time.perf_counter() - start  # includes one eager step (the check)


def captured_step(model, x, adj, y):
    """The replay of one CUDA graph holding a whole training step (zero_grad,
    forward, cross-entropy, backward, ``Adam(capturable=True)``), after
    checking that a replay's loss equals an eager forward's at the same
    parameters; returns (replay, seconds from warm-up to that check)."""
    import time
    if not x.is_cuda:
        raise RuntimeError("a CUDA-graph capture needs a GPU")
    opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
    step = epoch_fn(model, opt, x, adj, y)
    torch.cuda.synchronize()
    start = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled, caches built
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(model, x, adj, y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        expected = forward_loss(model, x, adj, y)
    graph.replay()
    error = rel_error(loss.detach(), expected)
    assert error < MODEL_RTOL, f"captured step's loss differs from eager's ({error:.2g})"
    torch.cuda.synchronize()
    # The graph reads and writes memory it does not own (parameters, Adam's
    # state, the inputs): the replay holds them for as long as it lives.
    held = (model, opt, x, adj, y, loss)

    def replay():
        graph.replay()
        return held

    return replay, time.perf_counter() - start


def check_compiled(model, compiled, x, adj, y, cudagraphs: bool) -> None:
    """The compiled model's loss and gradients against eager's (the first
    call compiles)."""
    grads = []
    for m in (model, compiled):
        if cudagraphs and m is compiled:
            torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x, adj), y)
        loss.backward()
        grads.append([loss.detach().clone()] + [p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    errors = [rel_error(a, b) for a, b in zip(*grads)]
    # Inductor fuses and reorders float32 sums; a deep model's MaxK may then
    # pick the other of two nearly equal entries (see MODEL_RTOL).
    assert max(errors) < MODEL_RTOL, f"compiled model differs from eager ({max(errors):.2g})"


def time_compiled(model, x, adj, y, device, repeats, mode) -> Dict[str, object]:
    step, first_s = compiled_step(model, x, adj, y, mode)
    t = time_ms(step, device, warmup=3, repeats=repeats)
    t["first_call_s"] = first_s
    return t


def run_workload(name: str, models, forms, ks, device, repeats, scale,
                 compile_modes=(), autocast: Optional[str] = None,
                 half_reductions: bool = False) -> Dict[str, object]:
    preset, layers = WORKLOADS[name]
    data = make_graph(preset, device, scale)
    n, ei, x, y = data["num_nodes"], data["edge_index"], data["x"], data["y"]
    print(f"[{name}] {n} nodes, {ei.size(1)} edges, {x.size(1)} features, "
          f"{data['num_classes']} classes, {layers} layers x {HIDDEN}", flush=True)
    empty = torch.empty(2, 0, dtype=torch.long, device=device)
    result = {"graph": {"preset": preset, "nodes": n, "edges": int(ei.size(1)),
                        "features": int(x.size(1)), "classes": data["num_classes"],
                        "layers": layers, "hidden": HIDDEN}, "models": {}}
    for kind in models:
        cls = MODELS[kind]
        entry: Dict[str, object] = {"stock": {}, "maxk": {}}

        def stock_model():
            torch.manual_seed(0)
            return cls(x.size(1), HIDDEN, layers, data["num_classes"], k=None,
                       **CONV_KWARGS[kind]).to(device)

        casts = [(None, "")] + ([(AUTOCAST[autocast], f" autocast {autocast}")]
                                if autocast else [])
        for form in FORMS if name not in HOST_BOUND else forms:
            reason = ("not requested" if form not in forms
                      else messages_fit(form, ei.size(1), device))
            for dtype, suffix in casts:
                label = form + suffix
                if reason:
                    print(f"  {kind} stock {label}: skipped ({reason})", flush=True)
                    entry["stock"][label] = {"skipped": reason}
                    continue
                entry["stock"][label] = guarded(
                    lambda: time_epoch(stock_model(), x, adjacency(form, ei, n), y, device,
                                       repeats, dtype),
                    f"{kind} stock {label}")
                _report(kind, f"stock {label}", entry["stock"][label])
        entry["stock_outside_mp"] = guarded(
            lambda: time_epoch(stock_model(), x, adjacency("csr", empty, n), y, device, repeats),
            f"{kind} stock without edges")
        _report(kind, "stock, no edges", entry["stock_outside_mp"])
        # With --half-reductions, the MaxK model under autocast once more with
        # pyg_maxk.allow_half_reductions (packed half sums in the backward).
        maxk_casts = [(dtype, suffix, False) for dtype, suffix in casts]
        if autocast and half_reductions:
            maxk_casts.append((AUTOCAST[autocast], f" autocast {autocast} half reductions", True))
        for k in ks:
            for dtype, suffix, reduced in maxk_casts:
                pyg_maxk.allow_half_reductions(reduced)
                torch.manual_seed(0)
                model = cls(x.size(1), HIDDEN, layers, data["num_classes"], k=k,
                            **CONV_KWARGS[kind]).to(device)
                clear_graph_cache()
                # A whole deep model agrees with the reference to its rounding
                # sensitivity (see check_against_torch_backend); single kernels
                # are checked against float64 in kernels.py.
                err = check_maxk_output(model, x, ei, y, dtype)
                clear_graph_cache()  # drop the reference backend's torch CSR copy
                # Unguarded: an error on the MaxK side fails the run.
                t = time_epoch(model, x, ei, y, device, repeats, dtype)
                t["check_vs_torch_backend"] = err
                entry["maxk"][str(k) + suffix] = t
                _report(kind, f"MaxK k={k}{suffix}", t)
        pyg_maxk.allow_half_reductions(False)
        for mode in compile_modes:
            label = variant(mode)
            entry["stock"][label] = guarded(
                lambda: time_compiled(stock_model(), x, ei, y, device, repeats, mode),
                f"{kind} stock {label}")
            _report(kind, f"stock {label}", entry["stock"][label])
            for k in ks:
                torch.manual_seed(0)
                model = cls(x.size(1), HIDDEN, layers, data["num_classes"], k=k,
                            **CONV_KWARGS[kind]).to(device)
                adj = prepared_graph(kind, ei, n, k)
                t = time_compiled(model, x, adj, y, device, repeats, mode)
                entry["maxk"][f"{k} {label}"] = t
                _report(kind, f"MaxK k={k} {label}", t)
        if name in HOST_BOUND:
            ran = [form for form in forms if "median_ms" in entry["stock"].get(form, {})]
            entry["interleaved"] = time_side_by_side(
                kind, data, layers, ran, ks, device, rounds=max(3, 6 * repeats),
                compile_modes=compile_modes)
        summarise(entry)
        _report_paired(kind, entry)
        result["models"][kind] = entry
    data = ei = x = y = None  # freed before the cache is emptied (the lambdas above name them)
    clear_graph_cache()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def time_side_by_side(kind, data, layers, forms, ks, device, rounds,
                      compile_modes=()) -> Dict[str, object]:
    """Epochs of the stock model in ``forms`` and of the MaxK models (and of
    both compiled in ``compile_modes``), timed round-robin
    (:func:`~common.time_interleaved`)."""
    cls = MODELS[kind]
    n, ei, x, y = data["num_nodes"], data["edge_index"], data["x"], data["y"]

    def model(k):
        torch.manual_seed(0)
        return cls(x.size(1), HIDDEN, layers, data["num_classes"], k=k,
                   **CONV_KWARGS[kind]).to(device)

    def eager(m, adj):
        return epoch_fn(m, torch.optim.Adam(m.parameters(), lr=0.01), x, adj, y)

    steps = {f"stock {form}": eager(model(None), adjacency(form, ei, n)) for form in forms}
    for k in ks:
        steps[f"maxk k={k}"] = eager(model(k), ei)
    for mode in compile_modes:
        label = variant(mode)
        stock = guarded(lambda: compiled_step(model(None), x, ei, y, mode)[0],
                        f"stock {label}")
        if callable(stock):
            steps[f"stock {label}"] = stock
        for k in ks:
            steps[f"maxk k={k} {label}"] = compiled_step(
                model(k), x, prepared_graph(kind, ei, n, k), y, mode)[0]
    times = guarded(lambda: time_interleaved(steps, device, rounds=rounds), "interleaved")
    for label, t in times.items():
        if isinstance(t, dict):
            _report("", f"interleaved {label}", t)
    return times


def _report(kind, label, t) -> None:
    if "median_ms" in t:
        mem = f", peak {t['peak_gb']:.2f} GB" if "peak_gb" in t else ""
        print(f"  {kind:5s} {label:30s} {t['median_ms']:10.2f} ms{mem}", flush=True)


def _report_paired(kind, entry) -> None:
    for k, m in entry["maxk"].items():
        best = m.get("vs_fastest_stock_interleaved", {})
        if "paired" in best:
            lo, hi = best["paired"]["ci95"]
            print(f"  {kind:5s} MaxK k={k} vs {best['form']} (interleaved, paired by round): "
                  f"{best['paired']['speedup']:.3f}x, 95% interval {lo:.3f}-{hi:.3f}x",
                  flush=True)


def summarise(entry) -> None:
    """Speedups of every MaxK run over every stock form, and the Amdahl limit."""
    outside = entry["stock_outside_mp"].get("median_ms")
    for m in entry["maxk"].values():
        if "median_ms" not in m:
            continue
        m["speedup"] = {form: s["median_ms"] / m["median_ms"]
                        for form, s in entry["stock"].items() if "median_ms" in s}
        if "peak_gb" in m:
            m["memory_ratio"] = {form: m["peak_gb"] / s["peak_gb"]
                                 for form, s in entry["stock"].items() if "peak_gb" in s}
    side = entry.get("interleaved", {})
    stock_side = {label[len("stock "):]: t["median_ms"] for label, t in side.items()
                  if label.startswith("stock ") and isinstance(t, dict)}
    for k, m in entry["maxk"].items():
        t = side.get(f"maxk k={k}")
        if isinstance(t, dict) and "median_ms" in m:
            m["speedup_interleaved"] = {form: s / t["median_ms"] for form, s in stock_side.items()}
            m["paired_speedup_interleaved"] = {
                form: paired_speedup(side[f"stock {form}"], t) for form in stock_side}
    for m in entry["maxk"].values():
        for key, by_form in (("vs_fastest_stock", m.get("speedup")),
                             ("vs_fastest_stock_interleaved", m.get("speedup_interleaved"))):
            if by_form:  # the slowest-to-beat stock form is the one with the least speedup
                form = min(by_form, key=by_form.get)
                m[key] = {"form": form, "speedup": by_form[form]}
                paired = m.get("paired_speedup_interleaved", {}).get(form)
                if key.endswith("interleaved") and paired:
                    m[key]["paired"] = paired
    if outside:
        entry["amdahl_limit"] = {form: s["median_ms"] / outside
                                 for form, s in entry["stock"].items() if "median_ms" in s}


def main(argv=None):
    args = parse_args(argv)
    if args.tiny:
        device = torch.device(args.device or "cpu")
        graphs, scale, repeats = ["cora"], 1.0, 2
    else:
        device = torch.device(args.device or "cuda")
        graphs, scale, repeats = args.graphs.split(","), args.scale, args.repeats
    models = args.models.split(",")
    forms = args.forms.split(",")
    ks = [int(k) for k in args.k.split(",")]
    compile_modes = [m for m in args.compile.split(",") if m]
    if CAPTURE in compile_modes and device.type != "cuda":
        raise SystemExit(f"--compile {CAPTURE} captures CUDA graphs: it needs a GPU")
    if device.type == "cpu":  # for both sides, before torch's threads start
        flush_denormals(device)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    if args.deterministic:
        # Read when cuBLAS first runs: set before either model does.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    payload = {"benchmark": "train", "environment": environment(device),
               "backend": resolve_backend(torch.empty(0, device=device)),
               "float32_matmul": "tf32" if args.tf32 else "ieee",
               "deterministic_algorithms": args.deterministic,
               "workloads": {}}
    for name in graphs:
        large = args.large_forms.split(",") if args.large_forms else forms
        payload["workloads"][name] = run_workload(
            name, models, forms if name in HOST_BOUND else large, ks, device, repeats, scale,
            compile_modes, args.autocast, args.half_reductions)
    name = "train-tiny" if args.tiny else ("train" if device.type == "cuda" else "train-cpu")
    if args.tf32:
        name += "-tf32"
    if args.deterministic:
        name += "-deterministic"
    if compile_modes and not args.tiny:
        name += "-compile"
    if args.autocast and not args.tiny:
        name += f"-autocast-{args.autocast}"
    out_dir = Path(args.out)
    path = write_json(name, payload, out_dir)
    plot(payload, out_dir / f"{name}.png")
    print(f"wrote {path}")


def plot(payload, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    workloads = payload["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, (wname, w) in zip(axes[0], workloads.items()):
        labels, heights, colors = [], [], []
        for kind, entry in w["models"].items():
            for form, s in entry["stock"].items():
                if "median_ms" in s:
                    labels.append(f"{kind}\nstock {form}")
                    heights.append(s["median_ms"])
                    colors.append("tab:grey")
            for k, m in entry["maxk"].items():
                if "median_ms" in m:
                    labels.append(f"{kind}\nMaxK k={k}")
                    heights.append(m["median_ms"])
                    colors.append("tab:blue")
        ax.bar(range(len(heights)), heights, color=colors)
        ax.set_xticks(range(len(heights)), labels, rotation=90, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("epoch time (ms, log)")
        ax.set_title(f"{wname}: {w['graph']['nodes']} nodes, {w['graph']['edges']} edges")
    fig.suptitle(f"pyg-maxk training epochs on {payload['environment'].get('gpu', 'CPU')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
