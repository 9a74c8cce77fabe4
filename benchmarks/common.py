"""Timing, environment capture and result files shared by the benchmarks."""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def time_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 3,
            repeats: int = 10) -> Dict[str, float]:
    """Median (and spread) of ``fn``'s time in ms: CUDA events on a GPU,
    ``perf_counter`` on the CPU, after ``warmup`` untimed calls."""
    return time_interleaved({"fn": fn}, device, rounds=1, per_round=repeats,
                            warmup=warmup)["fn"]


def _elapsed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call of ``fn``, timed with CUDA events on a GPU, else on the host."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_interleaved(fns: Dict[str, Callable[[], object]], device: torch.device, *,
                     rounds: int = 30, per_round: int = 5, warmup: int = 10,
                     in_blocks: bool = False) -> Dict[str, Dict[str, float]]:
    """Like :func:`time_ms` for several functions at once, timed round-robin
    (``per_round`` calls of each, ``rounds`` times): host-bound work drifts
    by tens of percent within a minute, and interleaving exposes every
    function to the same drift. Each call is timed to its own end (a sync
    after each), or with ``in_blocks`` each round's ``per_round`` calls
    together, one sync after the last (each counted as the block's mean):
    a training loop's throughput, where the host queues the next call while
    the GPU runs the last."""
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for _ in range(rounds):
        for name, fn in fns.items():
            if in_blocks:
                block = _elapsed_ms(lambda f=fn: [f() for _ in range(per_round)], device)
                samples[name] += [block / per_round] * per_round
            else:
                samples[name] += [_elapsed_ms(fn, device) for _ in range(per_round)]
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
                   "repeats": len(t),
                   "round_medians_ms": [statistics.median(t[i:i + per_round])
                                        for i in range(0, len(t), per_round)]}
            for name, t in samples.items()}


def paired_speedup(slow: Dict[str, object], fast: Dict[str, object], *,
                   resamples: int = 2000, seed: int = 0) -> Dict[str, object]:
    """The speedup of ``fast`` over ``slow`` (two :func:`time_interleaved`
    entries) paired by round: the median over rounds of the ratio of their
    round medians, which cancels the drift the two share within a round, with
    a 95% bootstrap interval over rounds. An interval that holds 1 is a tie."""
    import random
    ratios = [a / b for a, b in zip(slow["round_medians_ms"], fast["round_medians_ms"])]
    rng = random.Random(seed)
    boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                   for _ in range(resamples))
    return {"speedup": statistics.median(ratios), "rounds": len(ratios),
            "ci95": [boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]]}


def ceiling_setup(description: str, argv=None):
    """``(args, device, graph)`` of the two floor benchmarks
    (``gather_ceiling.py``, ``reduction_ceiling.py``): their shared flags,
    and the mean-normalised Reddit-shaped graph on a GPU, or with ``--tiny`` a
    100-node one on the CPU (Numba's simulator). ``args.ks`` and
    ``args.repeats`` come back resolved (``--tiny``: k 4 and 16, one repeat)."""
    import argparse

    from pyg_maxk import CSRGraph
    from pyg_maxk.app.datasets import PRESETS, power_law_edge_index

    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small CPU smoke run (simulator)")
    p.add_argument("--ks", default="2,4,8,16,32,64")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.tiny:
        device, nodes, edges, max_deg = torch.device("cpu"), 100, 500, 50
        args.ks, args.repeats = [4, 16], 1
    else:
        device = torch.device("cuda")
        reddit = PRESETS["reddit-like"]
        nodes, edges, max_deg = reddit.num_nodes, reddit.num_edges, reddit.max_degree
        args.ks = [int(k) for k in args.ks.split(",")]
    edge_index = power_law_edge_index(nodes, edges, max_degree=max_deg, seed=0, device=device)
    graph = CSRGraph.from_adj(edge_index, (nodes, nodes), normalization="mean")
    return args, device, graph


def environment(device: torch.device) -> Dict[str, object]:
    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "device": str(device),
    }
    try:
        import torch_geometric
        env["torch_geometric"] = torch_geometric.__version__
    except ImportError:
        pass
    try:
        from pyg_maxk.kernels import cuda_module
        cuda_module()
        import numba
        import numpy
        env["numba"] = numba.__version__
        env["numpy"] = numpy.__version__
        from importlib.metadata import version
        env["numba_cuda"] = version("numba-cuda")
    except Exception as err:  # pragma: no cover
        env["numba"] = f"unavailable: {err}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu"] = props.name
        env["gpu_memory_gb"] = round(props.total_memory / 2**30, 1)
        env["multiprocessors"] = props.multi_processor_count
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def write_json(name: str, payload: Dict[str, object], out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False))
    return path


def save(name: str, payload: Dict[str, object], out_dir, draw) -> Path:
    """Write ``name.json`` and, through ``draw(png_path, hardware)``,
    ``name.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    path = write_json(name, payload, out_dir)
    draw(out_dir / f"{name}.png", payload["environment"].get("gpu", "CPU"))
    print(f"wrote {path}")
    return path


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or None (with
    a message) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        print("matplotlib missing: no plot")
        return None
    return plt


def plot_ms_against_k(rows, series, title: str, path) -> None:
    """A log-log plot of milliseconds against ``k``, one line per ``(key,
    label)`` of ``series`` over the rows that have ``key``."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8.5, 4))
    for key, label in series:
        have = [r for r in rows if key in r]
        if have:
            ax.plot([r["k"] for r in have], [r[key] for r in have], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("k")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


#: Relative size of the parameter perturbation whose effect on the reference
#: measures a workload's rounding sensitivity (a few float32 ulps).
ROUNDING_PERTURBATION = 1e-6
#: How far beyond that sensitivity the backends may differ.
SENSITIVITY_MARGIN = 4.0


def check_against_torch_backend(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor],
                                rtol: float) -> Dict[str, float]:
    """The largest norm-relative difference, over the loss and every
    parameter's gradient, of one training-mode step of ``model`` (``loss_fn``
    runs its forward and returns the loss) on the active backend against the
    ``"torch"`` reference backend. Gradients are left zeroed.

    Summation orders differ between backends, and each MaxK layer may then
    keep the other of two nearly equal entries: on a large deep model the
    backends agree to the model's sensitivity to rounding, not to rounding.
    So the reference runs a second time with every parameter perturbed by
    :data:`ROUNDING_PERTURBATION` (relative, random signs), and the check
    raises when the backends differ by more than ``rtol`` *and* by more than
    :data:`SENSITIVITY_MARGIN` times that perturbation's effect. A wrong
    kernel or wiring differs by orders of magnitude more.

    Returns ``{"rel_error": ..., "rounding_sensitivity": ...}``."""
    import pyg_maxk

    def step(backend, perturb=False):
        model.zero_grad(set_to_none=True)
        saved = [p.detach().clone() for p in model.parameters()] if perturb else None
        if perturb:
            gen = torch.Generator(device="cpu").manual_seed(0)
            with torch.no_grad():
                for p in model.parameters():
                    sign = torch.randint(0, 2, p.shape, generator=gen).to(p.device) * 2 - 1
                    p.mul_(1 + ROUNDING_PERTURBATION * sign)
        try:
            if backend is None:
                loss = loss_fn()
            else:
                with pyg_maxk.use_backend(backend):
                    loss = loss_fn()
            loss.backward()
            return [loss.detach()] + [p.grad.detach().clone() for p in model.parameters()
                                      if p.grad is not None]
        finally:
            if perturb:
                with torch.no_grad():
                    for p, q in zip(model.parameters(), saved):
                        p.copy_(q)

    ours, ref, perturbed = step(None), step("torch"), step("torch", perturb=True)
    model.zero_grad(set_to_none=True)
    if len(ours) != len(ref):
        raise AssertionError("the backends give gradients to different parameters")
    err = max(rel_error(a, b) for a, b in zip(ours, ref))
    sensitivity = max(rel_error(a, b) for a, b in zip(perturbed, ref))
    if not (err < rtol or err < SENSITIVITY_MARGIN * sensitivity):
        raise AssertionError(
            f"MaxK loss or gradients differ from the torch backend's by {err:.3g}: more than "
            f"{rtol:g} and than {SENSITIVITY_MARGIN:g}x the reference's own change "
            f"({sensitivity:.3g}) under a {ROUNDING_PERTURBATION:g} relative perturbation "
            f"of the parameters")
    return {"rel_error": err, "rounding_sensitivity": sensitivity}
