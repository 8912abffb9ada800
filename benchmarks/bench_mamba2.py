"""The Mamba-2 mixer (moelens.models.mixers.mamba2) against transformers' NemotronHMamba2Mixer on its torch path,
one layer with the same weights and inputs: a prefill of --tokens positions (the chunked scan) and --steps
decode steps after it (the one-step recurrence), median of --repeat runs each, in the same process, with the
ratio transformers / moelens (above 1: moelens is faster). Sizes default to Nemotron-3 Nano's Mamba layers.

Usage: python benchmarks/bench_mamba2.py [--tokens 512] [--steps 16] [--batch 1] [--dtype float32 bfloat16]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from transformers.cache_utils import DynamicCache
from transformers.models.nemotron_h import modeling_nemotron_h as hf
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

from moelens.models.context import LayerInputs
from moelens.models.mixers.mamba2 import Mamba2Config, Mamba2Mixer


def layer_inputs(x: torch.Tensor, state) -> LayerInputs:
    b, t, _ = x.shape
    return LayerInputs(positions=torch.zeros(b, t, dtype=torch.long), cos=None, sin=None,
                       allowed=torch.ones(1, 1, 1, 1, dtype=torch.bool), state=state)


def timed_pair(theirs, ours, repeat: int) -> tuple[float, float]:
    """Median seconds of each, run alternately (on a shared machine, load drifts alike over both)."""
    theirs(), ours()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for fn, kept in zip((theirs, ours), times):
            t0 = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=2688)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--state", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()

    hc = NemotronHConfig(hidden_size=args.hidden, mamba_num_heads=args.heads, mamba_head_dim=args.head_dim,
                         n_groups=args.groups, ssm_state_size=args.state, chunk_size=args.chunk,
                         layers_block_type=["mamba"])
    cfg = Mamba2Config(
        d_model=hc.hidden_size, mamba_n_heads=hc.mamba_num_heads, mamba_d_head=hc.mamba_head_dim,
        mamba_n_groups=hc.n_groups, mamba_d_state=hc.ssm_state_size, mamba_d_conv=hc.conv_kernel,
        mamba_chunk_size=hc.chunk_size, mamba_conv_bias=hc.use_conv_bias, mamba_proj_bias=hc.use_bias,
        mamba_norm_eps=hc.layer_norm_epsilon, mamba_time_step_limit=(hc.time_step_min, math.inf),
        mamba_decode_time_step_limit=(0.0, math.inf),
    )
    torch.manual_seed(0)
    ref = hf.NemotronHMamba2Mixer(hc, layer_idx=0).eval()
    mine = Mamba2Mixer(cfg, layer=0)
    mine.load_state_dict(ref.state_dict())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; hidden {args.hidden}, {args.heads} heads x "
          f"{args.head_dim}, {args.groups} groups, state {args.state}, chunk {args.chunk}; batch {args.batch}")
    print(f"{'dtype':>9} {'what':>22} {'transformers ms':>15} {'moelens ms':>10} {'ratio':>6}")
    for name in args.dtype:
        dtype = getattr(torch, name)
        ref.to(dtype), mine.to(dtype)
        x = torch.randn(args.batch, args.tokens, args.hidden).to(dtype)
        steps = torch.randn(args.steps, args.batch, 1, args.hidden).to(dtype)

        def hf_prefill():
            return ref(x, cache=DynamicCache(config=hc))

        def our_prefill():
            return mine(x, layer_inputs(x, mine.new_state()))

        hf_cache = DynamicCache(config=hc)
        ref(x, cache=hf_cache)
        our_state = mine.new_state()
        mine(x, layer_inputs(x, our_state))

        def hf_decode():  # the cache moves on: each run decodes the next steps (same work)
            for s in steps:
                ref(s, cache=hf_cache)

        def our_decode():
            for s in steps:
                mine(s, layer_inputs(s, our_state))

        with torch.inference_mode():
            for what, theirs, ours, per in (
                (f"prefill {args.tokens}", hf_prefill, our_prefill, 1),
                (f"decode step (of {args.steps})", hf_decode, our_decode, args.steps),
            ):
                a, b = (seconds / per for seconds in timed_pair(theirs, ours, args.repeat))
                print(f"{name:>9} {what:>22} {a * 1e3:>15.2f} {b * 1e3:>10.2f} {a / b:>6.2f}")


if __name__ == "__main__":
    main()
