"""CPU torch path of the routed experts: one grouped_mm call vs a loop of per-expert matmuls.

Prints, for a few token counts, the time of each way on the same slots and the rows per expert, so the
crossover that moelens.kernels.experts.GROUPED_MM_MAX_ROWS_PER_EXPERT encodes can be checked on a machine.
Usage: python benchmarks/bench_torch_experts.py [--experts 16] [--top-k 4] [--hidden 512] [--expert-width 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def loop(rows, weight, counts):
    out, start = rows.new_empty(rows.shape[0], weight.shape[1]), 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = F.linear(rows[start : start + n], weight[e])
        start += n
    return out


def grouped(rows, weight, counts):
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return F.grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)


def timed(fn, *args, repeat=7):
    fn(*args)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-width", type=int, default=256)
    args = parser.parse_args()
    E, k, H, I = args.experts, args.top_k, args.hidden, args.expert_width
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, E={E} k={k} H={H} I={I}")
    print(f"{'dtype':>9} {'tokens':>7} {'rows/expert':>11} {'loop ms':>8} {'grouped_mm ms':>13} {'loop/grouped':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        W = torch.randn(E, 2 * I, H, dtype=dtype)
        for tokens in (1, 8, 32, 128, 512, 1024, 4096):
            idx = torch.stack([torch.randperm(E)[:k] for _ in range(tokens)]).flatten()
            order = idx.argsort(stable=True)
            counts = torch.bincount(idx, minlength=E).tolist()
            rows = torch.randn(tokens * k, H, dtype=dtype)[order]
            a, b = timed(loop, rows, W, counts), timed(grouped, rows, W, counts)
            print(f"{str(dtype)[6:]:>9} {tokens:>7} {tokens * k / E:>11.1f} {a * 1e3:>8.3f} {b * 1e3:>13.3f} {a / b:>12.2f}")


if __name__ == "__main__":
    main()
