"""Throughput and memory of `moelens trace`.

    python benchmarks/bench_trace.py [--tokens 100000] [--seq-len 256] [--batch-size 8] [--threads 1]

1. Trace throughput against a plain no-grad forward (return_type=None) over the very same windows, batches
   and padding: the ratio is the share of the forward's speed the trace keeps (target >= 0.8).
2. Peak RSS of tracing 1x and 4x the corpus, and 4x as one document on a single line, each in a fresh
   process (target: flat, i.e. the trace holds no more than a part's rows and a piece of a document
   however large the corpus or its documents).

Uses the embedded default model (tiny-qwen2-moe) and a synthetic corpus of random-word text files.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def make_corpus(folder: Path, n_tokens: int, seed: int = 0) -> None:
    """Text files of random words, about n_tokens bytes (the default model's tokenizer is byte-level)."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    written, i = 0, 0
    while written < n_tokens:
        size = int(min(gen.integers(500, 5000), n_tokens - written))
        words, length = [], 0
        while length < size:
            word = "".join(letters[gen.integers(0, 26, size=int(gen.integers(1, 9)))])
            words.append(word)
            length += len(word) + 1
        text = " ".join(words)[:size]
        (folder / f"doc{i:05d}.txt").write_text(text)
        written += len(text.encode())
        i += 1


def make_one_line(folder: Path, n_tokens: int, seed: int = 2) -> None:
    """One document of random words on a single line, about n_tokens bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(letters[gen.integers(0, 26, size=int(gen.integers(1, 9)))]) for _ in range(n_tokens // 5 + 1)]
    (folder / "one_line.txt").write_text(" ".join(words)[:n_tokens])


def plain_forward_seconds(model, corpus: Path, seq_len: int, batch_size: int) -> tuple[float, int]:
    """The forward alone over the trace's windows, batched and padded the same way."""
    from moelens.traces.run import pad_windows
    from moelens.traces.sources import FileDocuments, resolve_files, windows
    from moelens.traces.tokenize import DocumentTokenizer

    files, _ = resolve_files(corpus)
    all_windows = list(windows(FileDocuments(files), DocumentTokenizer(model.tokenizer), seq_len, model.cfg.d_vocab))
    pad = model.tokenizer.pad_token_id
    batches = [pad_windows(all_windows[i : i + batch_size], pad) for i in range(0, len(all_windows), batch_size)]
    n_tokens = sum(len(w.tokens) for w in all_windows)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for tokens, mask in batches:
            model(tokens, attention_mask=mask, return_type=None)
    return (time.perf_counter() - start, time.process_time() - cpu), n_tokens


def trace_seconds(model, corpus: Path, out: Path, seq_len: int, batch_size: int, windows_per_part: int | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: every thread, so Parquet's compression threads count)."""
    from moelens.traces import trace

    shutil.rmtree(out, ignore_errors=True)
    start, cpu = time.perf_counter(), time.process_time()
    trace(model, corpus, out, seq_len=seq_len, batch_size=batch_size, windows_per_part=windows_per_part, progress=False)
    return time.perf_counter() - start, time.process_time() - cpu


def child(args) -> None:
    """One trace in this fresh process; prints its peak RSS."""
    from moelens import HookedTransformer

    torch.set_num_threads(args.threads)
    model = HookedTransformer.from_pretrained(args.model, progress=False)
    seconds, _ = trace_seconds(model, Path(args.child_corpus), Path(args.child_out), args.seq_len, args.batch_size, args.windows_per_part)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"seconds": seconds, "peak_rss": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-qwen2-moe", help="checkpoint folder or embedded default (README's numbers: tiny-qwen2-moe)")
    parser.add_argument("--tokens", type=int, default=100_000, help="corpus size for the 1x runs")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--windows-per-part", type=int, default=32, help="small parts, so that even 1x spans several")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for the tiny model on shared CPUs)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side; the fastest counts")
    parser.add_argument("--child-corpus", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_corpus:
        return child(args)

    from moelens import HookedTransformer

    torch.set_num_threads(args.threads)
    model = HookedTransformer.from_pretrained(args.model, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_corpus(root / "x1", args.tokens)
        make_corpus(root / "x4", 4 * args.tokens, seed=1)
        make_one_line(root / "x4-one-line", 4 * args.tokens)

        plain_forward_seconds(model, root / "x1", args.seq_len, args.batch_size)  # warm-up
        plains, traces = [], []
        for _ in range(args.repeats):  # interleaved, so that load from other processes hits both sides alike
            seconds, n_tokens = plain_forward_seconds(model, root / "x1", args.seq_len, args.batch_size)
            plains.append(seconds)
            traces.append(trace_seconds(model, root / "x1", root / "out", args.seq_len, args.batch_size, args.windows_per_part))
        print(f"model {args.model}, {n_tokens} tokens, seq_len {args.seq_len}, batch {args.batch_size}, "
              f"{args.windows_per_part} windows per part, {args.threads} thread(s), fastest of {args.repeats}")
        for i, clock in enumerate(("wall clock", "CPU time")):  # CPU time: robust where other processes share the cores
            plain, traced = min(p[i] for p in plains), min(t[i] for t in traces)
            print(f"{clock:>10}: plain no-grad forward {n_tokens / plain:8.0f} tokens/s, trace {n_tokens / traced:8.0f} "
                  f"tokens/s, ratio {plain / traced:.2f}x")

        rss = {}
        for scale in ("x1", "x4", "x4-one-line"):
            run = subprocess.run(
                [sys.executable, __file__, "--child-corpus", str(root / scale), "--child-out", str(root / f"rss-{scale}"),
                 "--model", args.model, "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--threads", str(args.threads),
                 "--windows-per-part", str(args.windows_per_part)],
                capture_output=True, text=True, check=True,
            )
            rss[scale] = json.loads(run.stdout.strip().splitlines()[-1])
            tokens = sum(p["tokens"] for p in json.loads((root / f"rss-{scale}" / "manifest.json").read_text())["parts"].values())
            size = sum(p.stat().st_size for p in (root / f"rss-{scale}").glob("*.parquet"))
            what = scale[1:].replace("-one-line", "x corpus as one single-line document") if "one-line" in scale else f"{scale[1:]}x corpus"
            print(f"peak RSS tracing {what} ({tokens} tokens, {size / 2**20:.1f} MiB of Parquet): "
                  f"{rss[scale]['peak_rss'] / 2**20:.0f} MiB")
        print(f"peak RSS 4x / 1x: {rss['x4']['peak_rss'] / rss['x1']['peak_rss']:.2f}; "
              f"4x on one line / 1x: {rss['x4-one-line']['peak_rss'] / rss['x1']['peak_rss']:.2f}")


if __name__ == "__main__":
    main()
