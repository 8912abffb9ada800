"""Expert offload on one GPU: host-to-device bandwidth, prefill and decode throughput, resident vs offloaded.

Builds a bfloat16 Qwen2-MoE checkpoint (~1.6 GB of routed experts) with transformers, loads it resident and
with expert_offload="cpu" (pinned host memory) and "disk", checks that logits are bit for bit the resident
model's, and prints: the measured pinned copy bandwidth; prefill (1 x PREFILL tokens) and decode (DECODE
greedy steps) times; bytes moved and the bandwidth they imply against the measured one (target: >= 70% for
prefill). Part of benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from tiny import perturb  # noqa: E402

from moelens import HookedTransformer  # noqa: E402

CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=4, moe_intermediate_size=512, shared_expert_intermediate_size=1024, num_experts=64,
    num_experts_per_tok=8, max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
PREFILL, DECODE = 2048, 32


def build(folder: Path) -> None:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**CONFIG)).to(torch.bfloat16)
    perturb(model, 0)
    model.save_pretrained(folder)


def copy_bandwidth() -> float:
    host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 10 * host.numel() / (time.perf_counter() - start)


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    folder = Path(tempfile.mkdtemp()) / "ckpt"
    build(folder)
    bandwidth = copy_bandwidth()
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, PREFILL), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; pinned host->device copy {bandwidth / 1e9:.1f} GB/s")
    print("| load | prefill ms | decode ms/token | GB moved (prefill) | implied GB/s | of copy bandwidth | logits equal |")
    print("|---|---:|---:|---:|---:|---:|---|")
    reference = None
    for name, kwargs in (("resident", {}), ("cpu, cache 25%", dict(expert_offload="cpu")), ("disk, cache 25%", dict(expert_offload="disk"))):
        if kwargs:
            experts = sum(b.mlp.experts.W_gate_up.nbytes + b.mlp.experts.W_down.nbytes for b in resident.blocks if b.is_moe)
            kwargs["expert_cache_bytes"] = experts // 4
        model = HookedTransformer.from_pretrained(folder, dtype=torch.bfloat16, device="cuda", progress=False, **kwargs)
        with torch.no_grad():
            model(prompt[:, :128])  # warm up
            logits = model(prompt)
            before = model.expert_cache_stats().bytes_moved if kwargs else 0
            prefill = timed(lambda: model(prompt))
            moved = (model.expert_cache_stats().bytes_moved - before) if kwargs else 0
            decode = timed(lambda: model.generate(prompt[:, :64], max_new_tokens=DECODE, stop_at_eos=False, do_sample=False)) / DECODE
        if reference is None:
            reference, resident = logits, model
        implied = moved / prefill if moved else 0.0
        print(f"| {name} | {prefill * 1e3:.0f} | {decode * 1e3:.1f} | {moved / 1e9:.2f} | {implied / 1e9:.1f} | "
              f"{implied / bandwidth:.0%} | {torch.equal(logits, reference)} |")
        if kwargs:
            del model


if __name__ == "__main__":
    main()
