"""expert_loss_effects for every expert of one layer vs the naive loop (one full forward per removed expert).

The benchmark model of bench_qwen2_moe.py (~70M-parameter Qwen2-MoE, 8 layers, 16 experts, top 4, random
weights built with transformers), a batch of --batch x --pos tokens, CPU. Both ways run in this one process,
interleaved, and must agree (max difference printed); the ratio is naive time / expert_loss_effects time.

Usage: python benchmarks/bench_expert_loss_effects.py [--layer 4] [--mode zero] [--batch 2] [--pos 128]
       [--runs 3] [--threads N] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # run from a checkout without installing moelens
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from bench_qwen2_moe import CONFIG, build_checkpoint, load_moelens  # noqa: E402

from moelens.analysis import expert_loss_effects  # noqa: E402


def naive(model, tokens: torch.Tensor, layer: int, mode: str) -> torch.Tensor:
    """One full forward per expert, the removal written out as hooks (the tests' oracle)."""
    name = f"blocks.{layer}.mlp.hook_"
    base, cache = model.run_with_cache(tokens, names_filter=[name + "expert_indices"], return_type="loss", loss_per_token=True)
    clean = cache[name + "expert_indices"]
    out = torch.zeros(model.cfg.n_routable_experts)
    for e in range(model.cfg.n_routable_experts):
        if mode == "zero":
            seen = {}
            hooks = [(name + "expert_indices", lambda x, hook, seen=seen: seen.__setitem__("i", x)),
                     (name + "expert_weights", lambda w, hook, seen=seen, e=e: w.masked_fill(seen["i"] == e, 0))]
        else:
            def minus_inf(x, hook, e=e):
                x = x.clone()
                column = x[..., e]
                column[(clean == e).any(-1)] = float("-inf")
                x[..., e] = column
                return x
            hooks = [(name + "router_logits", minus_inf)]
        loss = model.run_with_hooks(tokens, fwd_hooks=hooks, return_type="loss", loss_per_token=True)
        out[e] = (loss - base).mean()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, default=CONFIG["num_hidden_layers"] // 2)
    parser.add_argument("--mode", choices=["zero", "reroute"], default="zero")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--pos", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--out", type=Path, help="checkpoint folder (default: a temporary directory)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp)
        if not (folder / "config.json").exists():
            build_checkpoint(folder)
        model = load_moelens(folder, torch.float32)
    tokens = torch.randint(0, CONFIG["vocab_size"], (args.batch, args.pos), generator=torch.Generator().manual_seed(0))
    fast_fn = lambda: expert_loss_effects(model, tokens, layers=args.layer, mode=args.mode, progress=False)[0]  # noqa: E731
    naive_fn = lambda: naive(model, tokens, args.layer, args.mode)  # noqa: E731
    times: dict[str, list[float]] = {"expert_loss_effects": [], "naive": []}
    with torch.no_grad():
        got, want = fast_fn(), naive_fn()  # warmup, and the check
        for _ in range(args.runs):
            for name, fn in (("expert_loss_effects", fast_fn), ("naive", naive_fn)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    fast, slow = statistics.median(times["expert_loss_effects"]), statistics.median(times["naive"])
    n_layers, E = CONFIG["num_hidden_layers"], CONFIG["num_experts"]
    print(f"Qwen2-MoE benchmark model ({n_layers} layers, {E} experts, top {CONFIG['num_experts_per_tok']}), "
          f"tokens {args.batch}x{args.pos}, layer {args.layer}, mode {args.mode}, {torch.get_num_threads()} threads")
    print(f"max |expert_loss_effects - naive| = {float((got - want).abs().max()):.2e} nats")
    print(f"expert_loss_effects: {fast:.3f} s   naive ({E} full forwards): {slow:.3f} s   ratio {slow / fast:.2f}x")


if __name__ == "__main__":
    main()
