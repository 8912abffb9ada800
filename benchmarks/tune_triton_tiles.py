"""Offline tile tuning for the Triton expert kernels on this GPU (nothing autotunes on the default path).

For each token-count bucket of moelens.kernels.tiles.DEFAULT_TABLE, times a small grid of tiles on the
given model shape and writes the fastest as a JSON table (load it with moelens.kernels.tiles.load_table).
Usage (CUDA only): python benchmarks/tune_triton_tiles.py --shape 64,8,4096,3072 --out tiles-H100.json
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch

from bench_triton_experts import make_hooks, timer
from moelens.experts.spec import ExpertTensors
from moelens.kernels.tiles import DEFAULT_TABLE, Tile, dump_table
from moelens.kernels.triton_experts import routed_experts_triton

GRID = [Tile(m, n, k, w, s) for m, n, k, w, s in itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="64,8,4096,3072", help="experts,top_k,d_model,d_expert")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tile tuning needs a CUDA GPU")
    E, k, H, I = (int(v) for v in args.shape.split(","))
    W_gate_up = (torch.randn(E, 2 * I, H, device="cuda") / H**0.5).bfloat16()
    W_down = (torch.randn(E, H, I, device="cuda") / I**0.5).bfloat16()
    table = []
    for upper, default in DEFAULT_TABLE:
        T = upper or 4096
        x = torch.randn(T, H, device="cuda").bfloat16()
        weights, idx = torch.randn(T, E, device="cuda").softmax(-1).topk(k, -1)
        hooks = make_hooks(False)
        timings = {}
        for tile in GRID:
            try:
                timings[tile] = timer(lambda: routed_experts_triton(x, idx, weights.bfloat16(), ExpertTensors(W_gate_up, W_down), hooks, (1, T), tile), 5)
            except Exception as err:  # out of shared memory and the like: skip that tile
                print(f"skip {tile}: {type(err).__name__}")
        best = min(timings, key=timings.get)
        print(f"<= {upper} tokens: {best} {timings[best] * 1e3:.3f} ms (default {timings.get(default, float('nan')) * 1e3:.3f} ms)")
        table.append((upper, best))
    args.out.write_text(dump_table(tuple(table)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
