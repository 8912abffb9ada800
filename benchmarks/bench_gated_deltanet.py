"""Gated DeltaNet mixer: moelens's forward against transformers' torch path on the same weights and input.

Times a prefill (one chunked forward over --prefill positions, no cache) and decode steps (--steps one-token
forwards after a cached prefill of --context positions, the token-by-token form), each the median of
--repeat runs, moelens's and transformers' alternating in the same process, and prints each time and their
ratio (moelens / transformers), with the largest difference between the two outputs. Default sizes are
Qwen3-Next-80B-A3B's linear-attention layer (hidden 2048, 16 key heads and 32 value heads of 128, kernel 4).
Usage: python benchmarks/bench_gated_deltanet.py [--family qwen3_next|qwen3_5_moe] [--dtype float32|bfloat16]
       [--batch 1] [--prefill 1024] [--context 256] [--steps 16] [--repeat 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3NextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moelens.models.context import LayerInputs  # noqa: E402
from moelens.models.mixers.gated_deltanet import (  # noqa: E402
    FusedProjectionsGatedDeltaNet,
    GatedDeltaNetSizes,
    SeparateProjectionsGatedDeltaNet,
)

FAMILIES = {
    "qwen3_next": (Qwen3NextConfig, Qwen3NextGatedDeltaNet, FusedProjectionsGatedDeltaNet),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeGatedDeltaNet, SeparateProjectionsGatedDeltaNet),
}


def inputs(batch: int, n_pos: int, state=None) -> LayerInputs:
    return LayerInputs(positions=torch.arange(n_pos).expand(batch, n_pos), cos=None, sin=None,
                       allowed=torch.ones(1, 1, 1, 1, dtype=torch.bool), state=state)


def alternating_medians(fn_a, fn_b, repeat: int) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """Median times of fn_a and fn_b, run alternately after one warm-up each (a busy machine slows both alike),
    and their last outputs."""
    out_a, out_b = fn_a(), fn_b()
    times_a, times_b = [], []
    for _ in range(repeat):
        for fn, times in ((fn_a, times_a), (fn_b, times_b)):
            start = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - start)
            out_a, out_b = (out, out_b) if fn is fn_a else (out_a, out)
    return statistics.median(times_a), statistics.median(times_b), out_a, out_b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="qwen3_next")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--key-heads", type=int, default=16)
    parser.add_argument("--value-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    config_cls, hf_cls, ours_cls = FAMILIES[args.family]
    config = config_cls(hidden_size=args.hidden, linear_num_key_heads=args.key_heads,
                        linear_num_value_heads=args.value_heads, linear_key_head_dim=args.head_dim,
                        linear_value_head_dim=args.head_dim, linear_conv_kernel_dim=4, num_hidden_layers=1,
                        layer_types=["linear_attention"])
    sizes = GatedDeltaNetSizes(args.hidden, args.key_heads, args.value_heads, args.head_dim, args.head_dim, 4,
                               config.rms_norm_eps)
    torch.manual_seed(0)
    theirs = hf_cls(config, 0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name != "A_log":
                p.normal_(0, 0.02 if p.dim() > 1 and "conv" not in name else 0.3)
    ours = ours_cls(sizes, 0)
    ours.load_state_dict(theirs.state_dict())
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = torch.randn(args.batch, max(args.prefill, args.context + args.steps), args.hidden).to(dtype)

    print(f"{args.family} {args.dtype}, batch {args.batch}, {args.threads} thread(s): hidden {args.hidden}, "
          f"{args.key_heads} key / {args.value_heads} value heads of {args.head_dim}")
    with torch.no_grad():
        prefill = x[:, : args.prefill]
        t_ours, t_theirs, out_ours, out_theirs = alternating_medians(
            lambda: ours(prefill, inputs(args.batch, args.prefill)), lambda: theirs(prefill), args.repeat)
        diff = (out_ours.float() - out_theirs.float()).abs().max().item()
        print(f"prefill {args.prefill:5d} positions: moelens {t_ours * 1e3:8.2f} ms, transformers "
              f"{t_theirs * 1e3:8.2f} ms, ratio {t_ours / t_theirs:.3f} (max |difference| {diff:.3g})")

        def decode_theirs():
            cache = DynamicCache(config=config)
            theirs(x[:, : args.context], cache=cache)
            start = time.perf_counter()
            outs = [theirs(x[:, t : t + 1], cache=cache) for t in range(args.context, args.context + args.steps)]
            return time.perf_counter() - start, torch.cat(outs, 1)

        def decode_ours():
            state = ours.new_state()
            ours(x[:, : args.context], inputs(args.batch, args.context, state))
            start = time.perf_counter()
            outs = [ours(x[:, t : t + 1], inputs(args.batch, 1, state)) for t in range(args.context, args.context + args.steps)]
            return time.perf_counter() - start, torch.cat(outs, 1)

        runs_theirs, runs_ours = [], []
        for _ in range(args.repeat):
            runs_theirs.append(decode_theirs())
            runs_ours.append(decode_ours())
        step_theirs = statistics.median(t for t, _ in runs_theirs) / args.steps
        step_ours = statistics.median(t for t, _ in runs_ours) / args.steps
        diff = (runs_ours[-1][1].float() - runs_theirs[-1][1].float()).abs().max().item()
        print(f"decode step after {args.context}: moelens {step_ours * 1e3:8.3f} ms, transformers "
              f"{step_theirs * 1e3:8.3f} ms, ratio {step_ours / step_theirs:.3f} (max |difference| {diff:.3g})")


if __name__ == "__main__":
    main()
