"""Routed-expert kernels at the real shapes of the four flagship models, bf16.

For each model and token count: time of moelens's Triton kernels, of its torch path, of transformers'
grouped_mm experts forward and of transformers' per-expert loop ("eager"), achieved TFLOP/s and GB/s of the
kernels against the GPU's peak, and the overhead of hooks on every expert site (prefill). Targets on an
H100/H200: prefill >= 1.5x transformers' grouped_mm and >= 50% of bf16 peak; decode >= 50% of memory
bandwidth on the expert weights touched; hooks-on overhead <= 10% at prefill.

On a machine without CUDA it times the torch path against transformers (at smaller token counts).
Usage: python benchmarks/bench_triton_experts.py [--models qwen1.5,solar] [--peak-tflops 989 --peak-gbps 4800]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch

from moelens.experts.spec import ExpertSpec, ExpertTensors
from moelens.hooks import HookPoint
from moelens.kernels.experts import ExpertHooks, routed_experts

SHAPES = {  # name: (experts, top_k, d_model, d_expert)
    "qwen1.5-moe-a2.7b": (60, 4, 2048, 1408),
    "qwen2-57b-a14b": (64, 8, 3584, 2560),
    "hunyuan-a13b": (64, 8, 4096, 3072),
    "solar-open-100b": (128, 8, 4096, 1280),
}
DECODE, PREFILL = (1, 8, 64), (512, 2048, 8192)
PEAKS = {"H100": (989.0, 3350.0), "H200": (989.0, 4800.0)}  # dense bf16 TFLOP/s, HBM GB/s


def timer(fn, repeat: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(repeat):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reference_experts(E: int, H: int, I: int, implementation: str, W_gate_up, W_down):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    config = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E)
    config._experts_implementation = implementation
    experts = Qwen2MoeExperts(config).to(W_gate_up.device, W_gate_up.dtype)
    experts.gate_up_proj.data, experts.down_proj.data = W_gate_up, W_down
    return experts


def make_hooks(on: bool) -> ExpertHooks:
    points = [HookPoint() for _ in range(4)]
    if on:
        store = []
        for hp in points:
            hp.add_hook(lambda t, hook: store.append(t) and None)
    return ExpertHooks(*points)


def run(args) -> list[str]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    peak_tflops, peak_gbps = args.peak_tflops, args.peak_gbps
    for key, (tf, bw) in PEAKS.items():
        if key in gpu and peak_tflops is None:
            peak_tflops, peak_gbps = tf, bw
    counts = (DECODE + PREFILL) if cuda else (1, 8, 64, 256)
    rows = [
        f"{datetime.date.today()} · {gpu} · torch {torch.__version__} · bf16 · times in ms (median of {args.repeat})",
        "",
        "| model | tokens | moelens triton | moelens torch | hf grouped_mm | hf loop | vs grouped_mm | TFLOP/s | GB/s | hooks-on overhead |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in args.models:
        E, k, H, I = SHAPES[name]
        gen = torch.Generator(device=device).manual_seed(0)
        W_gate_up = (torch.randn(E, 2 * I, H, device=device, generator=gen) / H**0.5).to(torch.bfloat16)
        W_down = (torch.randn(E, H, I, device=device, generator=gen) / I**0.5).to(torch.bfloat16)
        hf = {impl: reference_experts(E, H, I, impl, W_gate_up, W_down) for impl in ("grouped_mm", "eager")}
        for T in counts:
            x = torch.randn(T, H, device=device, generator=gen).to(torch.bfloat16)
            logits = torch.randn(T, E, device=device, generator=gen)
            weights, idx = logits.softmax(-1).topk(k, -1)
            weights = weights.to(torch.bfloat16)

            def ours(backend, hooks_on=False):
                hooks = make_hooks(hooks_on)
                return lambda: routed_experts(x, idx, weights, ExpertTensors(W_gate_up, W_down), ExpertSpec(E, H, I), hooks, (1, T), backend)

            with torch.no_grad():
                t_torch = timer(ours("torch"), args.repeat)
                t_grouped = timer(lambda: hf["grouped_mm"](x, idx, weights), args.repeat)
                t_loop = timer(lambda: hf["eager"](x, idx, weights), args.repeat)
                t_triton = timer(ours("triton"), args.repeat) if cuda else float("nan")
                t_hooks = timer(ours("triton", True), args.repeat) if cuda and T >= 512 else float("nan")
            best = t_triton if cuda else t_torch
            flops = 6 * T * k * H * I
            touched = int(torch.unique(idx).numel()) * 3 * H * I * 2 + T * H * 2 * 2  # weights + x and out
            rows.append(
                f"| {name} | {T} | {t_triton * 1e3:.3f} | {t_torch * 1e3:.3f} | {t_grouped * 1e3:.3f} | "
                f"{t_loop * 1e3:.3f} | {t_grouped / best:.2f}x | {flops / best / 1e12:.1f}"
                f"{f' ({100 * flops / best / 1e12 / peak_tflops:.0f}%)' if peak_tflops else ''} | "
                f"{touched / best / 1e9:.0f}{f' ({100 * touched / best / 1e9 / peak_gbps:.0f}%)' if peak_gbps else ''} | "
                f"{'' if t_hooks != t_hooks else f'{100 * (t_hooks / t_triton - 1):.1f}%'} |"
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(SHAPES))
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--peak-gbps", type=float, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        args.models = [m for m in args.models if m.startswith("qwen1.5")] or args.models[:1]
        args.repeat = min(args.repeat, 3)
    print("\n".join(run(args)))


if __name__ == "__main__":
    main()
