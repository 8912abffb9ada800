"""Expert parallelism on CPU with gloo: forward time and per-rank expert bytes for 1, 2 and 4 ranks.

Uses the checkpoint of bench_offload.py (8 layers x 64 experts, float32). Each rank runs with one intra-op
thread (CPU GEMMs round differently with other thread counts); the 1-rank row is the resident model in one
process with one thread. Prefill batch 1 x 256 after a warm-up; the median of 5 forwards. Ranks are
processes on this machine, so above its core count they share cores: the numbers show the overhead of the
gathers, not a speed-up. Checks that every rank's logits equal the single-process ones bit for bit, and
times the ranks' fingerprint checks before each exchange (forwards with them over forwards without).
Usage: python benchmarks/bench_expert_parallel.py
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
import bench_offload  # noqa: E402

from moelens import HookedTransformer  # noqa: E402

PROMPT = torch.randint(0, bench_offload.CONFIG["vocab_size"], (1, 256), generator=torch.Generator().manual_seed(0))


def timed_forwards(model) -> tuple[torch.Tensor, float]:
    with torch.no_grad():
        logits = model(PROMPT)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            model(PROMPT)
            times.append(time.perf_counter() - start)
    return logits, statistics.median(times)


def checks_cost(model) -> float:
    """Median forward time with the ranks' fingerprint checks over that without them (the data exchanged on
    the default group instead), alternating the two, 5 of each."""
    shards = [b.mlp.experts.shard for b in model.blocks if b.is_moe]
    exchange = shards[0].exchange
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.no_grad():
        for _ in range(5):
            for checked in (True, False):
                for shard in shards:
                    shard.exchange = exchange if checked else None
                start = time.perf_counter()
                model(PROMPT)
                times[checked].append(time.perf_counter() - start)
    for shard in shards:
        shard.exchange = exchange
    return statistics.median(times[True]) / statistics.median(times[False])


def worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    model = HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True)
    held = sum(b.mlp.experts.shard.tensors.nbytes for b in model.blocks if b.is_moe)
    logits, seconds = timed_forwards(model)
    checks = checks_cost(model)
    torch.save({"logits": logits, "seconds": seconds, "held": held, "checks": checks}, os.path.join(out, f"{world}-{rank}.pt"))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    folder = Path(tempfile.mkdtemp()) / "ckpt"
    sizes = bench_offload.build(folder)
    torch.set_num_threads(1)
    reference, single = timed_forwards(HookedTransformer.from_pretrained(folder, progress=False))
    out = tempfile.mkdtemp()
    print(f"{datetime.date.today()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo; prefill 1 x 256, 1 thread per rank\n")
    print("| ranks | forward | vs 1 process | expert MB per rank | logits equal on every rank | with / without the checks |")
    print("|---:|---:|---:|---:|---|---:|")
    print(f"| 1 | {single * 1e3:.0f} ms | 1.00x | {sizes['experts'] / 1e6:.0f} | - | - |")
    for world in (2, 4):
        mp.start_processes(worker, args=(world, free_port(), str(folder), out), nprocs=world, start_method="spawn")
        ranks = [torch.load(os.path.join(out, f"{world}-{r}.pt")) for r in range(world)]
        seconds = max(r["seconds"] for r in ranks)
        equal = all(torch.equal(r["logits"], reference) for r in ranks)
        checks = max(r["checks"] for r in ranks)
        print(f"| {world} | {seconds * 1e3:.0f} ms | {seconds / single:.2f}x | {max(r['held'] for r in ranks) / 1e6:.0f} | {equal} | {checks:.2f}x |")


if __name__ == "__main__":
    main()
