"""Shared-memory bank conflicts of the forward SpGEMM's accumulation, simulated.

    python benchmarks/bank_conflicts.py          # k 2-64, dim 256, 4,000 rows
    python benchmarks/bank_conflicts.py --tiny   # a quick CI run

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
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from pyg_maxk.kernels.spgemm import ROW_PAD, neighbour_lanes, spgemm_vector_width

from common import RESULTS, environment, pyplot, write_json

ORDERS = ("column", "bank-major", "bank-aligned", "random")
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a few hundred rows, k 8 and 32")
    p.add_argument("--ks", default="2,4,8,16,32,64")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--out", default=str(RESULTS))
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
    payload = {"benchmark": "bank_conflicts",
               "environment": environment(torch.device("cpu")),
               "dim": args.dim, "rows": n, "ks": results}
    path = write_json(name, payload, Path(args.out))
    plot(results, path.with_suffix(".png"), args.dim)
    print(f"wrote {path}")


def plot(results, path, dim):
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for order in ORDERS:
        ax.plot([r["k"] for r in results], [r[order]["per_instruction"] for r in results],
                marker="o", label=order)
    ax.axhline(1, color="grey", linestyle=":", label="conflict-free")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("wavefronts per shared-memory instruction")
    ax.set_title(f"SpGEMM accumulation bank conflicts, random rows, dim {dim}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
