"""Routed experts kept stored (from_pretrained(expert_storage=...)) against dense ones, in one run, CPU.

One mixture layer's Experts module (moelens.models.components.moe), 16 experts, d_model 512, d_expert 256,
top-4, built twice from the same random weights quantized as the Hub stores them: kept stored (fp8:
float8_e4m3fn codes with float32 scales per 128 x 128 block, per-expert gate / up / down as DeepSeek-V3's;
MXFP4: blocks and E8M0 scales per 32 values, gpt-oss's fused gate_up with interleaved rows), and dense (the
same experts dequantized once, as a load without expert_storage holds them). Both run the torch expert path
on the same tokens and routing; the outputs are checked equal bit for bit. Prints, per format, compute
dtype and token count, the median forward time of each and their ratio, and the bytes each holds against
the experts in bfloat16.

Usage: python benchmarks/bench_expert_storage.py [--tokens 1 256] [--repeat 9] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from moelens.config import MoeConfig, RopeConfig
from moelens.experts.stored import StoredExperts, StoredPart
from moelens.hooks import HookPoint
from moelens.kernels import ExpertHooks
from moelens.loaders.quantized import Fp8Blocks, Mxfp4
from moelens.models.components.moe import Experts
from moelens.sitemap import AS_STORED, InterleavedRows

E, H, I, K = 16, 512, 256, 4
FP8_MAX = 448.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def config(dtype: torch.dtype, storage: str | None) -> MoeConfig:
    return MoeConfig(
        family="qwen3_moe", d_model=H, n_layers=1, n_heads=4, n_kv_heads=4, d_head=64, d_vocab=8, norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0), max_position_embeddings=4096, moe_layers=(True,), n_experts=E, top_k_per_layer=(K,),
        d_expert=I, dtype=dtype, expert_storage=storage,
    )


def fp8_blocks(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] -> float8_e4m3fn codes and float32 scales (amax / 448) per block."""
    rows, cols = w.shape[-2:]
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    padded = F.pad(w, (0, nc * block[1] - cols, 0, nr * block[0] - rows))
    blocks = padded.unflatten(-1, (nc, block[1])).unflatten(-3, (nr, block[0]))
    scale = (blocks.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2).flatten(-3, -2)
    return q[..., :rows, :cols].to(torch.float8_e4m3fn), scale


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] -> uint8 blocks [E, rows, cols / 32, 16] and E8M0 scales [E, rows, cols / 32]."""
    groups = w.unflatten(-1, (w.shape[-1] // 32, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100) / 6.0))
    codes = (groups / 2.0**exponent)[..., None].sub(E2M1).abs().argmin(-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (exponent.squeeze(-1) + 127).to(torch.uint8)


def stored_experts(storage: str, dtype: torch.dtype, gen: torch.Generator) -> StoredExperts:
    gate, up = (torch.randn(E, I, H, generator=gen) * H**-0.5 for _ in range(2))
    down = torch.randn(E, H, I, generator=gen) * I**-0.5
    spec = config(dtype, storage).expert_spec()
    if storage == "fp8":
        fmt = Fp8Blocks((128, 128))
        parts = [
            StoredPart("W_gate_up", (slice(0, I),), fmt, AS_STORED, 2),
            StoredPart("W_gate_up", (slice(I, 2 * I),), fmt, AS_STORED, 2),
            StoredPart("W_down", (), fmt, AS_STORED, 2),
        ]
        return StoredExperts(spec, parts, [*fp8_blocks(gate), *fp8_blocks(up), *fp8_blocks(down)])
    interleaved = torch.stack([gate, up], dim=2).flatten(1, 2)  # gpt-oss's row order: gate 0, up 0, gate 1, ...
    parts = [StoredPart("W_gate_up", (), Mxfp4(), InterleavedRows(), 2), StoredPart("W_down", (), Mxfp4(), AS_STORED, 2)]
    return StoredExperts(spec, parts, [*mxfp4(interleaved), *mxfp4(down)])


def forward(experts: Experts, x, indices, weights, hooks):
    with torch.no_grad():
        return experts(x, indices, weights, hooks, (1, x.shape[0]))


def timed(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {E} experts, d_model {H}, d_expert {I}, top-{K}")
    print(f"{'format':>6} {'compute':>8} {'tokens':>6} {'dense ms':>9} {'stored ms':>9} {'time ratio':>10} "
          f"{'stored / bf16 bytes':>19} {'stored / dense bytes':>20}")
    hooks = ExpertHooks(*(HookPoint("batch pos top_k d", "") for _ in range(4)))
    gen = torch.Generator().manual_seed(0)
    for storage in ("fp8", "mxfp4"):
        for dtype in (torch.float32, torch.bfloat16):
            stored = Experts(config(dtype, storage))
            stored.attach_stored(stored_experts(storage, dtype, gen))
            dense = Experts(config(dtype, None))
            for name, tensor in zip(dense.spec.param_names, stored.tensors().present()):  # dequantized once, as at load
                getattr(dense, name).data = tensor
            dense_bytes = sum(p.nbytes for p in dense.parameters())
            bf16_bytes = dense_bytes * 2 // dtype.itemsize
            for tokens in args.tokens:
                x = torch.randn(tokens, H, generator=gen).to(dtype)
                indices = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
                weights = torch.rand(tokens, K, generator=gen).to(dtype)
                out = forward(stored, x, indices, weights, hooks)
                assert torch.equal(out, forward(dense, x, indices, weights, hooks)), "stored and dense experts differ"
                rounds = [
                    timed(lambda m=m, x=x, indices=indices, weights=weights: forward(m, x, indices, weights, hooks), args.repeat)
                    for m in (dense, stored, dense, stored)
                ]
                t_dense, t_stored = min(rounds[0::2]), min(rounds[1::2])  # alternated, the better of two rounds each
                print(f"{storage:>6} {str(dtype)[6:]:>8} {tokens:>6} {t_dense * 1e3:>9.2f} {t_stored * 1e3:>9.2f} "
                      f"{t_stored / t_dense:>9.2f}x {stored.stored.nbytes / bf16_bytes:>18.3f}x "
                      f"{stored.stored.nbytes / dense_bytes:>19.3f}x")


if __name__ == "__main__":
    main()
