"""Loading an fp8 checkpoint (dequantized at load) against loading its bfloat16 copy, CPU only.

Builds a DeepSeek-V3-shaped checkpoint with transformers' class (random weights; ~100M parameters), writes it
twice: bfloat16, and fp8 in the Hub's format (float8_e4m3fn weights, float32 weight_scale_inv per 128x128
block, partial blocks where 128 does not divide). Then, each in a fresh subprocess, moelens loads each into
bfloat16 and reports:

- peak RSS growth of from_pretrained (imports excluded; /proc VmHWM) / the bfloat16 model's bytes
- wall time of from_pretrained

Usage: python benchmarks/bench_quantized_load.py [--out DIR] [--layers N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent

RSS_SCRIPT = """
import sys, time, torch
import moelens
def status(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field + ":")).split()[1])
before = status("VmHWM")
start = time.perf_counter()
model = moelens.HookedTransformer.from_pretrained(sys.argv[1], dtype=torch.bfloat16, progress=False)
seconds = time.perf_counter() - start
print(before, status("VmHWM"), seconds, sum(p.numel() * p.element_size() for p in model.parameters()))
"""


def quantize_fp8(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape[-2:]
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    padded = F.pad(w.float(), (0, nc * block[1] - cols, 0, nr * block[0] - rows))
    blocks = padded.unflatten(-1, (nc, block[1])).unflatten(-3, (nr, block[0]))
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-448, 448).flatten(-2).flatten(-3, -2)[..., :rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def build(root: Path, layers: int) -> tuple[Path, Path]:
    import json

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=8192, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=512,
    )
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    bf16 = root / "bf16"
    model.save_pretrained(bf16)
    fp8 = root / "fp8"
    model.save_pretrained(fp8)
    tensors = load_file(fp8 / "model.safetensors")
    for key in [k for k, v in tensors.items() if v.dim() == 2 and k.endswith(".weight") and "embed" not in k and "lm_head" not in k and not k.endswith(".gate.weight")]:
        tensors[key], tensors[key + "_scale_inv"] = quantize_fp8(tensors[key])
    save_file(tensors, fp8 / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
    (fp8 / "config.json").write_text(json.dumps(cfg))
    return bf16, fp8


def load_stats(folder: Path) -> tuple[int, float, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(folder)], capture_output=True, text=True, check=True, env=env)
    hwm0, hwm1, seconds, model_bytes = out.stdout.split()[-4:]
    return (int(hwm1) - int(hwm0)) * 1024, float(seconds), int(model_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        bf16, fp8 = build(root, args.layers)
        file_bytes = {name: (path / "model.safetensors").stat().st_size for name, path in (("bf16", bf16), ("fp8", fp8))}
        stats = {name: load_stats(path) for name, path in (("bf16", bf16), ("fp8", fp8))}
    model_bytes = stats["bf16"][2]
    print(f"model: {model_bytes / 1e6:.0f} MB as bfloat16; files: bf16 {file_bytes['bf16'] / 1e6:.0f} MB, fp8 {file_bytes['fp8'] / 1e6:.0f} MB")
    print("| checkpoint | file | load peak RSS growth / bf16 model bytes | load time |")
    print("|---|---|---|---|")
    for name in ("bf16", "fp8"):
        peak, seconds, _ = stats[name]
        print(f"| {name} | {file_bytes[name] / 1e6:.0f} MB | {peak / model_bytes:.2f}x ({peak / 1e6:.0f} MB) | {seconds:.2f} s |")
    ratio = stats["fp8"][0] / stats["bf16"][0]
    print(f"fp8 / bf16: peak {ratio:.2f}x, time {stats['fp8'][1] / stats['bf16'][1]:.2f}x")


if __name__ == "__main__":
    main()
