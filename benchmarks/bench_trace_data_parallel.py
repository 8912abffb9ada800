"""What data parallelism costs a trace: 2 ranks tracing a corpus, against 2 separate single-process traces
of half the corpus each, side by side, in one run.

    python benchmarks/bench_trace_data_parallel.py [--tokens 100000] [--seq-len 256] [--batch-size 8]

Both sides run two processes at once, each with one torch thread, on the same model and windows: the
separate traces need no coordination at all, so their combined tokens/s (each one's rate, summed) is what
the 2 ranks could reach.
The ratio (data parallel / separate) is the share of it the data-parallel trace keeps. Its costs: every
rank reads and tokenizes the whole corpus (to cut the same windows as one process), the process group's
set-up, and the gather and manifest at the end. Each side's time runs from the first process's start of
trace() to the last one's end (model loading left out); the fastest of --repeats counts.
"""

from __future__ import annotations

import argparse
import os
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_trace import make_corpus

CHILD = """
import json, sys, time, torch
from pathlib import Path
from moelens import HookedTransformer
from moelens.defaults import default_checkpoint
from moelens.traces import trace
model_name, corpus, out, seq_len, batch, wpp, rank, world, store, ready, n = sys.argv[1:]
torch.set_num_threads(1)
model = HookedTransformer.from_pretrained(default_checkpoint(model_name, root=Path(out).parent / "cache"), progress=False)
if int(world) > 1:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + store, rank=int(rank), world_size=int(world))
(Path(ready) / Path(out).name).with_suffix(f".{rank}").touch()
while len(list(Path(ready).iterdir())) < int(n):  # every process loaded: the clocks start together
    time.sleep(0.001)
start = time.time()
summary = trace(model, Path(corpus), out, seq_len=int(seq_len), batch_size=int(batch), windows_per_part=int(wpp),
                progress=False, data_parallel=int(world) > 1)
end = time.time()
if int(world) > 1:
    dist.destroy_process_group()
print(json.dumps({"start": start, "end": end, "tokens": summary.n_tokens}))
"""


def run_side(runs: list[tuple[str, str, int, int]], args, root: Path, store: Path) -> tuple[float, int]:
    """Start every (corpus, out, rank, world) at once; (tokens/s, tokens)."""
    ready = root / f"ready_{store.name}"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, args.model, corpus, out, str(args.seq_len), str(args.batch_size),
                               str(args.windows_per_part), str(rank), str(world), str(store), str(ready), str(len(runs))],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for corpus, out, rank, world in runs]
    results = []
    for p in procs:
        stdout, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a traced process failed ({p.returncode})")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    if runs[0][3] > 1:  # one trace: its tokens over the time from the first rank's start to the last one's end
        tokens = results[0]["tokens"]
        return tokens / (max(r["end"] for r in results) - min(r["start"] for r in results)), tokens
    # separate traces: each one's own rate, summed (halves of a few thousand-byte files are not exactly equal)
    return sum(r["tokens"] / (r["end"] - r["start"]) for r in results), sum(r["tokens"] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen2-moe", help="embedded default (README's numbers: tiny-qwen2-moe)")
    parser.add_argument("--tokens", type=int, default=100_000, help="corpus size (bytes of text, about tokens)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--windows-per-part", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side; the fastest counts")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench_trace_dp_"))
    try:
        whole = root / "corpus"
        make_corpus(whole, args.tokens)
        files = sorted(whole.iterdir())
        sizes = [f.stat().st_size for f in files]
        cut = next(i for i in range(len(files)) if sum(sizes[: i + 1]) * 2 >= sum(sizes)) + 1  # halves of equal bytes
        halves = [root / "half0", root / "half1"]
        print(f"halves: {sum(sizes[:cut])} and {sum(sizes[cut:])} bytes of text")
        for half, chunk in zip(halves, (files[:cut], files[cut:])):
            half.mkdir()
            for f in chunk:
                shutil.copy(f, half / f.name)
        best = {"separate": None, "data parallel": None}
        for repeat in range(args.repeats):
            for side in best:
                for old in root.glob("out*"):
                    shutil.rmtree(old)
                if side == "separate":
                    runs = [(str(halves[i]), str(root / f"out{i}"), 0, 1) for i in range(2)]
                else:
                    runs = [(str(whole), str(root / "out"), rank, 2) for rank in range(2)]
                rate, tokens = run_side(runs, args, root, root / f"store{repeat}_{side.replace(' ', '_')}")
                print(f"run {repeat + 1}: {side:>13}: {tokens} tokens, {rate:,.0f} tokens/s")
                if best[side] is None or rate > best[side]:
                    best[side] = rate
        print(f"model {args.model}, {args.tokens} tokens, seq_len {args.seq_len}, batch {args.batch_size}, "
              f"{args.windows_per_part} windows per part, 2 processes of 1 thread, fastest of {args.repeats}")
        print(f"2 separate traces of half the corpus: {best['separate']:,.0f} tokens/s")
        print(f"2 data-parallel ranks, whole corpus:  {best['data parallel']:,.0f} tokens/s")
        print(f"ratio data parallel / separate: {best['data parallel'] / best['separate']:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
