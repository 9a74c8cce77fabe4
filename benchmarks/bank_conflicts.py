"""Shared-memory bank conflicts of the forward SpGEMM's accumulation, simulated.

    python benchmarks/bank_conflicts.py          # k 2-64, dim 256, 4,000 rows
    python benchmarks/bank_conflicts.py --tiny   # a quick CI run
    python benchmarks/bank_conflicts.py --time   # and the kernels timed per order (GPU)

Each shared-memory instruction of the SpGEMM's accumulation has its 32 lanes
add one slot each of ``32 / lanes`` neighbours' CBSR rows (lanes and slots as
in :mod:`pyg_maxk.kernels.spgemm`) to the columns those slots name, each
group of lanes in its own shared row. A bank (4 bytes wide, 32 of them)
serves one address per cycle, so an instruction takes as many cycles
("wavefronts") as the most distinct addresses it asks of one bank. Numba's
code issues a load and a store per slot, so the accumulation costs ``2 * k /
32`` instructions per edge times the wavefronts of each.

This counts the wavefronts of random rows (``k`` distinct columns drawn
uniformly from ``dim``: what MaxK keeps of random features) for several slot
orders within a row:

* ``column``: by column;
* ``bank-major``: by column modulo 32, then column (what ``maxk`` writes);
* ``bank-aligned``: slot ``p`` holds a column of bank ``p`` where the row has
  one, the others fill the slots left free;
* ``random``: any order.

An instruction takes at least one wavefront; the neighbours of one
instruction are independent rows, so no order within rows can line their
banks up across groups, and ~2.85 wavefronts is what independent groups of
8 distinct banks each give. On an H200 the SpGEMM at k=32 keeps the
L1/shared-memory pipeline 97% busy (Nsight Compute), so these wavefronts set
its time (``docs/design.md``).

With ``--time`` (a GPU) the package's SpGEMM and SSpMM run on the
Reddit-shaped graph at ``--time-k`` (32) over the same MaxK'd random features
laid out in each order (the same columns and values, only their slots
differ), and over ``conflict-free`` rows: slot ``j`` holds a column of bank
``j`` (a random one of the 8), which makes every accumulation instruction
touch 32 distinct banks. That last time is what this design of the SpGEMM
could reach with no bank conflicts at all, whatever the layout or kernel
that got it there. In bf16 the SSpMM is also timed with packed half
reductions (:func:`pyg_maxk.allow_half_reductions`), whose groups read one
staged row together: rows whose slots follow their banks make them collide.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Dict

if "--tiny" in sys.argv:  # before Numba is imported: --time runs in the simulator
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

import numpy as np
import torch
from common import RESULTS, environment, pyplot, rel_error, time_interleaved, write_json

from pyg_maxk.kernels.spgemm import ROW_PAD, neighbour_lanes, spgemm_vector_width

ORDERS = ("column", "bank-major", "bank-aligned", "random")
#: The timed layouts: the orders above, and rows of one column per bank.
LAYOUTS = ORDERS + ("conflict-free",)
BANKS = 32


def ordered(columns: np.ndarray, order: str, rng: np.random.Generator) -> np.ndarray:
    """One row's columns in slot order ``order``."""
    if order == "column":
        return np.sort(columns)
    bank_major = columns[np.lexsort((columns, columns % BANKS))]
    if order == "bank-major":
        return bank_major
    if order == "random":
        return rng.permutation(columns)
    slots = np.full(len(columns), -1)
    spare = []
    for c in bank_major:
        b = c % BANKS
        if b < len(slots) and slots[b] < 0:
            slots[b] = c
        else:
            spare.append(c)
    slots[slots < 0] = spare
    return slots


def wavefronts(rows: np.ndarray, k: int, dim: int) -> float:
    """Mean wavefronts per accumulation instruction over ``rows`` ([n, k]
    slot-ordered columns), taken ``groups`` rows per instruction."""
    width = spgemm_vector_width(k)
    lanes = neighbour_lanes(k, width)
    groups = BANKS // lanes
    stride = dim + ROW_PAD
    chunks = -(-k // (lanes * width))
    total, count = 0, 0
    for first in range(0, len(rows) - groups + 1, groups):
        for c in range(chunks):
            for w in range(width):
                addresses = []
                for g in range(groups):
                    slots = [j * width + w + c * lanes * width for j in range(lanes)]
                    addresses += [g * stride + rows[first + g, s] for s in slots if s < k]
                banks = np.asarray(addresses) % BANKS
                total += np.bincount(banks, minlength=BANKS).max()
                count += 1
    return total / count


def slot_permutation(columns: torch.Tensor, order: str) -> torch.Tensor:
    """``[N, k]``: for each row of ``columns`` (``[N, k]`` int64) and slot,
    the current slot of the entry :func:`ordered` puts there (vectorised)."""
    n, k = columns.shape
    if order == "column":
        return columns.argsort(dim=1)
    if order == "random":
        return torch.rand(n, k, device=columns.device).argsort(dim=1)
    bank_major = (columns % BANKS * columns.max().add(1) + columns).argsort(dim=1)
    if order == "bank-major":
        return bank_major
    # bank-aligned: the first column of bank b goes to slot b (b < k), the
    # others fill the free slots in bank-major order.
    banks = (columns.gather(1, bank_major) % BANKS)
    first = torch.ones_like(banks, dtype=torch.bool)
    first[:, 1:] = banks[:, 1:] != banks[:, :-1]
    aligned = first & (banks < k)
    slot = torch.arange(k, device=columns.device).expand(n, k)
    taken = torch.zeros_like(banks).scatter_add_(1, torch.where(aligned, banks, 0),
                                                 aligned.long()) > 0
    free = (taken.long() * k + slot).argsort(dim=1)  # free slots first, ascending
    spare_rank = ((~aligned).long().cumsum(dim=1) - 1).clamp(min=0)
    dest = torch.where(aligned, banks, free.gather(1, spare_rank))
    return torch.empty_like(bank_major).scatter_(1, dest, bank_major)


def conflict_free_columns(n: int, k: int, dim: int, device) -> torch.Tensor:
    """``[N, k]`` distinct columns per row, slot ``j`` one of bank ``j``
    (needs ``k <= 32`` and ``dim`` a multiple of 32)."""
    if k > BANKS or dim % BANKS:
        raise ValueError(f"conflict-free rows need k <= {BANKS} and dim a multiple of {BANKS}")
    high = torch.randint(0, dim // BANKS, (n, k), device=device)
    return torch.arange(k, device=device) + BANKS * high


def laid_out(h) -> Dict[str, tuple]:
    """``{layout: (columns, values)}``: the CBSR ``h``'s rows in each order of
    :data:`ORDERS`, and its values on ``conflict-free`` columns."""
    columns, values = h.indices.long(), h.values.detach()
    layouts = {}
    for name in ORDERS:
        perm = slot_permutation(columns, name)
        layouts[name] = (columns.gather(1, perm), values.gather(1, perm))
    n, k = columns.shape
    layouts["conflict-free"] = (conflict_free_columns(n, k, h.dim, columns.device), values)
    return layouts


def time_layouts(k: int, dim: int, tiny: bool, repeats: int) -> Dict[str, object]:
    """The SpGEMM (forward) and SSpMM (backward) of ``aggregate`` on the
    mean-normalised Reddit-shaped graph (``tiny``: 100 nodes, simulator)
    over the layouts of MaxK'd random features, in bf16 and float32, timed
    round-robin; each reordered layout's results checked against column order's.
    In a half type at ``k`` a multiple of 8 the SSpMM is also timed with
    :func:`pyg_maxk.allow_half_reductions`."""
    import pyg_maxk
    from pyg_maxk import CBSR, CSRGraph
    from pyg_maxk.app.datasets import PRESETS, power_law_edge_index

    if tiny:
        device, nodes, edges, max_deg = torch.device("cpu"), 100, 500, 50
        dtypes = (torch.float32, torch.bfloat16)
    else:
        device = torch.device("cuda")
        reddit = PRESETS["reddit-like"]
        nodes, edges, max_deg = reddit.num_nodes, reddit.num_edges, reddit.max_degree
        dtypes = (torch.bfloat16, torch.float32)
    edge_index = power_law_edge_index(nodes, edges, max_degree=max_deg, seed=0, device=device)
    graph = CSRGraph.from_adj(edge_index, (nodes, nodes), normalization="mean")
    del edge_index
    torch.manual_seed(0)
    timed = {"k": k, "graph": {"nodes": nodes, "edges": graph.num_edges}, "dtypes": {}}
    for dtype in dtypes:
        h = pyg_maxk.maxk(torch.randn(nodes, dim, device=device, dtype=dtype), k)
        layouts = laid_out(h)
        fns, checks, sim = {}, {}, {}
        grad_out = torch.randn(nodes, dim, device=device, dtype=dtype)
        packed = dtype != torch.float32 and k % 8 == 0  # allow_half_reductions' SSpMM
        reference = None
        for name, (cols, vals) in layouts.items():
            leaf = vals.clone().requires_grad_()
            cbsr = CBSR(leaf, cols.to(h.indices.dtype), dim)
            out = pyg_maxk.aggregate(graph, cbsr)
            (grad,) = torch.autograd.grad(out, leaf, grad_out, retain_graph=True)
            if name != "conflict-free":  # the same matrix, its slots in another order
                dense_grad = torch.zeros(nodes, dim, device=device, dtype=torch.float64)
                dense_grad.scatter_(1, cols, grad.double())
                if reference is None:
                    reference = (out.detach().double(), dense_grad)
                checks[name] = {"forward": rel_error(out.detach(), reference[0]),
                                "backward": rel_error(dense_grad, reference[1])}
            sim[name] = wavefronts(cols[:4000].cpu().numpy(), k, dim)

            def forward(cbsr=cbsr):
                with torch.no_grad():
                    return pyg_maxk.aggregate(graph, cbsr)

            def backward(out=out, leaf=leaf):
                return torch.autograd.grad(out, leaf, grad_out, retain_graph=True)

            fns[f"{name}/forward"], fns[f"{name}/backward"] = forward, backward
            if packed:
                def backward_half_reductions(out=out, leaf=leaf):
                    pyg_maxk.allow_half_reductions(True)
                    try:
                        return torch.autograd.grad(out, leaf, grad_out, retain_graph=True)
                    finally:
                        pyg_maxk.allow_half_reductions(False)

                fns[f"{name}/backward_half_reductions"] = backward_half_reductions
        tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
        worst = max(max(c.values()) for c in checks.values())
        if not worst < tolerance:
            raise AssertionError(f"{dtype}: a reordered layout's result differs by {worst:.3g}")
        ms = time_interleaved(fns, device, rounds=repeats, per_round=5, warmup=3)
        timed["dtypes"][str(dtype).replace("torch.", "")] = {
            name: {"wavefronts_per_instruction": sim[name],
                   "forward_ms": ms[f"{name}/forward"]["median_ms"],
                   "backward_ms": ms[f"{name}/backward"]["median_ms"],
                   **({"backward_half_reductions_ms":
                       ms[f"{name}/backward_half_reductions"]["median_ms"]} if packed else {}),
                   **({"rel_error": checks[name]} if name in checks else {})}
            for name in LAYOUTS}
    return timed


def print_timed(timed: Dict[str, object]) -> None:
    print(f"k={timed['k']}, {timed['graph']['edges']:,} edges: layout, simulated wavefronts "
          "per instruction, SpGEMM ms, SSpMM ms (with half reductions)")
    for dtype, rows in timed["dtypes"].items():
        for name, r in rows.items():
            half = r.get("backward_half_reductions_ms")
            print(f"  {dtype:8s} {name:14s} {r['wavefronts_per_instruction']:5.2f} "
                  f"{r['forward_ms']:8.3f} {r['backward_ms']:8.3f}"
                  + (f" ({half:.3f})" if half else ""))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a few hundred rows, k 8 and 32")
    p.add_argument("--ks", default="2,4,8,16,32,64")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--time", action="store_true",
                   help="also time the kernels per layout (GPU; --tiny: the simulator)")
    p.add_argument("--time-k", type=int, default=32)
    p.add_argument("--repeats", type=int, default=10, help="rounds of the timing")
    args = p.parse_args(argv)
    ks = [8, 32] if args.tiny else [int(k) for k in args.ks.split(",")]
    n = 200 if args.tiny else args.rows
    rng = np.random.default_rng(0)
    results = []
    for k in ks:
        raw = [rng.choice(args.dim, k, replace=False) for _ in range(n)]
        row = {"k": k}
        for order in ORDERS:
            w = wavefronts(np.array([ordered(c, order, rng) for c in raw]), k, args.dim)
            row[order] = {"per_instruction": w, "per_edge": 2 * k / BANKS * w}
        results.append(row)
        print(f"k {k:3d}: " + ", ".join(f"{o} {row[o]['per_instruction']:.2f}" for o in ORDERS)
              + " wavefronts per instruction", flush=True)
    name = "bank_conflicts-tiny" if args.tiny else "bank_conflicts"
    timed = None
    if args.time:
        timed = time_layouts(args.time_k, args.dim, args.tiny, 1 if args.tiny else args.repeats)
        print_timed(timed)
    device = torch.device("cuda" if args.time and not args.tiny else "cpu")
    payload = {"benchmark": "bank_conflicts", "environment": environment(device),
               "dim": args.dim, "rows": n, "ks": results}
    if timed:
        payload["timed"] = timed
    path = write_json(name, payload, Path(args.out))
    plot(results, path.with_suffix(".png"), args.dim, timed)
    print(f"wrote {path}")


def plot(results, path, dim, timed=None):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(13 if timed else 7, 4),
                             squeeze=False)
    ax = axes[0, 0]
    for order in ORDERS:
        ax.plot([r["k"] for r in results], [r[order]["per_instruction"] for r in results],
                marker="o", label=order)
    ax.axhline(1, color="grey", linestyle=":", label="conflict-free")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("wavefronts per shared-memory instruction")
    ax.set_title(f"SpGEMM accumulation bank conflicts, random rows, dim {dim}")
    ax.legend(fontsize=8)
    if timed:
        ax = axes[0, 1]
        for dtype, rows in timed["dtypes"].items():
            for kernel, marker, label in (("forward", "o", "SpGEMM"), ("backward", "s", "SSpMM"),
                                          ("backward_half_reductions", "^",
                                           "SSpMM, half reductions")):
                have = [r for r in rows.values() if f"{kernel}_ms" in r]
                if have:
                    ax.scatter([r["wavefronts_per_instruction"] for r in have],
                               [r[f"{kernel}_ms"] for r in have], marker=marker,
                               label=f"{dtype} {label}")
            for name, r in rows.items():
                ax.annotate(name, (r["wavefronts_per_instruction"], r["forward_ms"]),
                            fontsize=6)
        ax.set_xlabel("simulated wavefronts per instruction (k=%d)" % timed["k"])
        ax.set_ylabel("ms")
        ax.set_title("kernels timed per layout, Reddit-shaped graph")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
