"""Decode-step time over a long generation: moelens's cache (keys and values written in place into buffers
reserved up front) against transformers' DynamicCache, on the benchmark Qwen2-MoE checkpoint, CPU, one thread.

Each side prefills the same prompt, then runs STEPS greedy decode steps of one token, each timed alone. Printed:
the median step time of the first and of the last WINDOW steps for each library, their ratio (how much a step
grew with the prefix), and moelens / transformers per window, measured in the same run (steps alternate
between the libraries, so a change in the machine's load hits both).

Usage: python benchmarks/bench_decode.py [--steps 512] [--prompt 16] [--threads 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # run from a checkout without installing moelens
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
from bench_qwen2_moe import build_checkpoint  # noqa: E402

import moelens  # noqa: E402
from moelens.kv_cache import KVCache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="folder for the checkpoint (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, DynamicCache

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp) / "ckpt"
        if not (folder / "config.json").exists():
            build_checkpoint(folder)
        ours = moelens.HookedTransformer.from_pretrained(str(folder), progress=False)
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        prompt = torch.randint(0, ours.cfg.d_vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))

        with torch.no_grad():
            cache = KVCache.for_model(ours, reserve=args.prompt + args.steps)
            our_next = ours(prompt, past_kv_cache=cache)[:, -1].argmax(-1, keepdim=True)
            hf_cache = DynamicCache(config=theirs.config)
            out = theirs(prompt, past_key_values=hf_cache, use_cache=True)
            hf_next = out.logits[:, -1].argmax(-1, keepdim=True)
            ours_t, theirs_t, same = [], [], 0
            for _ in range(args.steps):
                start = time.perf_counter()
                logits = ours(our_next, past_kv_cache=cache)[:, -1]
                ours_t.append(time.perf_counter() - start)
                start = time.perf_counter()
                hf_logits = theirs(hf_next, past_key_values=hf_cache, use_cache=True).logits[:, -1]
                theirs_t.append(time.perf_counter() - start)
                same += int(torch.equal(our_next, hf_next))
                our_next, hf_next = logits.argmax(-1, keepdim=True), hf_logits.argmax(-1, keepdim=True)

    w = args.window

    def med(ts: list[float]) -> float:
        return statistics.median(ts) * 1e3

    print(f"# decode steps, {datetime.date.today()}, {platform.machine()} {platform.processor() or ''}, "
          f"torch {torch.__version__}, {args.threads} thread(s), prompt {args.prompt}, {args.steps} steps")
    print(f"tokens equal at {same} of {args.steps} steps (greedy, float32)")
    print("| | first steps (ms) | last steps (ms) | last / first |")
    print("|---|---|---|---|")
    for name, ts in (("moelens", ours_t), ("transformers", theirs_t)):
        print(f"| {name} | {med(ts[:w]):.2f} | {med(ts[-w:]):.2f} | {med(ts[-w:]) / med(ts[:w]):.2f}x |")
    print(f"| moelens / transformers | {med(ours_t[:w]) / med(theirs_t[:w]):.2f}x | "
          f"{med(ours_t[-w:]) / med(theirs_t[-w:]):.2f}x | |")


if __name__ == "__main__":
    main()
