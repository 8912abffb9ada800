"""Quantized checkpoints: fp8 with block scales (DeepSeek-V3's, Qwen3-FP8's format) and MXFP4 (gpt-oss's experts).

moelens dequantizes at load. The oracles: transformers' own dequantized load where it reads the format right
(weights bit for bit, logits <= 1e-5 float32 and bitwise bfloat16), and a dequantization written out here
(weight.float() * its block's scale, repeated per block and cropped) where it does not: transformers' CPU
dequantization takes the block size to be rows // scale_rows, so a dimension the block does not divide is
misread (192 rows as blocks of 96) or refused (DeepSeek-V3's 576-row kv_a_proj_with_mqa).
"""

import json
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import tiny
import tiny_deepseek_v3
import tiny_gpt_oss
import tiny_minimax_m2
import tiny_mixtral
import tiny_qwen3_moe
from safetensors.torch import load_file, save_file

from moelens import HookedTransformer
from moelens.loaders.checkpoint import expected_keys, fill, key_map
from moelens.loaders.errors import CheckpointError, CheckpointWarning
from moelens.loaders.expert_reader import ExpertReader
from moelens.loaders.quantized import FP4_E2M1, Fp8Blocks, Mxfp4, dequantize_fp8_blocks, dequantize_mxfp4, stored_format
from moelens.loaders.safetensors_files import SafetensorsFiles
from moelens.sitemap import PackedWeight, SiteMap
from moelens.verify import compare, load_reference

FP8_MAX = 448.0
TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))


# ---- building quantized checkpoints -----------------------------------------------------------------------------


def quantize_fp8(w: torch.Tensor, block: tuple[int, int], scale_dtype=torch.float32):
    """The Hub's block fp8: per block, weight_scale_inv = amax / 448 (stored as scale_dtype) and weight =
    w / weight_scale_inv as float8_e4m3fn; the last block of a dimension the block does not divide is partial."""
    rows, cols = w.shape[-2:]
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    padded = F.pad(w.float(), (0, nc * block[1] - cols, 0, nr * block[0] - rows))
    blocks = padded.unflatten(-1, (nc, block[1])).unflatten(-3, (nr, block[0]))  # [..., nr, br, nc, bc]
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    q = (blocks / scale.float()[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return q.flatten(-2).flatten(-3, -2)[..., :rows, :cols].to(torch.float8_e4m3fn), scale


def by_hand(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The format, written out: each value times its block's scale (float32), the blocks cropped at the edge."""
    rows, cols = q.shape[-2:]
    s = scale.float().repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]
    return q.float() * s


def quantized_key(key: str, tensor: torch.Tensor) -> bool:
    """The tensors transformers' fp8 checkpoints quantize: linear weights and fused expert stacks; not the
    embeddings, the head, norms or routers."""
    if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return True
    return key.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in key and not key.startswith("lm_head") and not key.endswith(".gate.weight")


def quantize_folder(folder, block, scale_dtype=torch.float32, **config):
    """Rewrite a single-file float checkpoint as fp8 with block scales; returns the original float tensors."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    original = dict(tensors)
    for key in [k for k, v in tensors.items() if quantized_key(k, v)]:
        tensors[key], tensors[key + "_scale_inv"] = quantize_fp8(tensors[key], block, scale_dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    qc = {"quant_method": "fp8", "weight_block_size": list(block), "activation_scheme": "dynamic", "fmt": "e4m3"}
    tiny.edit_config(folder, quantization_config=qc | config)
    return original


def hand_dequantized(folder, block) -> dict[str, torch.Tensor]:
    """Every tensor of a quantized folder as the format says it reads, float32; scales consumed."""
    tensors = load_file(folder / "model.safetensors")
    out = {}
    for key, value in tensors.items():
        if key.endswith("_scale_inv"):
            continue
        scale = tensors.get(key + "_scale_inv")
        out[key] = value.float() if scale is None else by_hand(value, scale, block)
    return out


def dense_copy(folder, block, dest):
    """The hand-dequantized weights as a float32 checkpoint without quantization_config (what transformers
    then reads exactly: its forward is the reference where it cannot dequantize the fp8 files itself)."""
    shutil.copytree(folder, dest)
    save_file(hand_dequantized(folder, block), dest / "model.safetensors", metadata={"format": "pt"})
    tiny.edit_config(dest, quantization_config=None)
    return dest


def transformers_dequantized(folder, dtype):
    """transformers' own dequantizing load (what it does on a CPU-only machine, asked for explicitly)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation="eager", quantization_config=FineGrainedFP8Config(dequantize=True)
        ).eval()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_params_equal(model, reference: dict[str, torch.Tensor], cast: bool = False):
    """Every moelens parameter, bit for bit, against the tensor `reference` holds for it (in any of the
    spellings the site map reads: the Hub's per-expert keys or transformers' fused state dict); cast: the
    reference's float32 tensors cast to the parameter's dtype first (routers stay float32 in a bf16 model)."""
    keys = expected_keys(type(model).site_map(model.cfg), reference)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    for key, target in keys.items():
        ours, theirs = params[target.param][target.index], reference[key]
        theirs = theirs.to(ours.dtype) if cast else theirs
        assert ours.dtype == theirs.dtype, key
        assert torch.equal(bits(ours), bits(theirs)), f"{key} -> {target.param}"
    assert {t.param for t in keys.values()} == set(params)


def load(folder, **kwargs):
    return HookedTransformer.from_pretrained(folder, progress=False, **kwargs)


def check_logits(model, reference, dtype):
    report = compare(model, reference, TOKENS)
    assert report.index_mismatches == 0, report
    if dtype == torch.bfloat16:
        assert report.max_logit_diff == 0.0, report
    else:
        assert report.max_logit_diff <= 1e-5, report


# ---- the dequantize functions -----------------------------------------------------------------------------------


def random_fp8(shape, gen):
    """Every finite float8_e4m3fn code is likely: random bytes, the two NaN codes replaced."""
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.int64).to(torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x00
    return raw.view(torch.float8_e4m3fn)


def random_scales(shape, dtype, gen):
    if dtype == torch.uint8:  # E8M0 exponents around 2 ** -8
        return torch.randint(110, 130, shape, generator=gen, dtype=torch.int64).to(torch.uint8)
    return (torch.rand(shape, generator=gen) * 1e-2 + 1e-4).to(dtype)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, block", [((256, 384), (128, 128)), ((3, 96, 64), (32, 32)), ((64, 48), (16, 16))])
def test_fp8_blocks_are_transformers_dequantization_bit_for_bit(shape, block, dtype, scale_dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(0)
    weight = random_fp8(shape, gen)
    scale = random_scales((*shape[:-2], shape[-2] // block[0], shape[-1] // block[1]), scale_dtype, gen)
    ours = dequantize_fp8_blocks(weight, scale, block, dtype)
    theirs = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=dtype)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(bits(ours), bits(theirs))
    hand = scale.float() if scale_dtype != torch.uint8 else torch.exp2(scale.float() - 127)
    assert torch.equal(bits(ours), bits(by_hand(weight, hand, block).to(dtype)))


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, block",
    [((192, 200), (128, 128)), ((576, 64), (128, 128)), ((2, 40, 72), (32, 32)), ((24, 64), (128, 128))],
)
def test_fp8_partial_last_block_follows_the_format(shape, block, scale_dtype):
    """192 rows are one block of 128 and one of 64 (transformers: two of 96); 576 rows are 4.5 blocks
    (transformers: 576 % 5, refused)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(1)
    weight = random_fp8(shape, gen)
    scale = random_scales((*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])), scale_dtype, gen)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_fp8_blocks(weight, scale, block, dtype)
        assert torch.equal(bits(ours), bits(by_hand(weight, scale, block).to(dtype)))
    if shape[-2] % block[0] and scale.shape[-2] > 1:  # where transformers misreads the grid, so it is no oracle here
        try:
            theirs = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)
        except ValueError:
            return
        assert theirs.shape == ours.shape and not torch.equal(theirs, ours.float())


def test_fp8_dequantize_refuses_a_scale_off_the_grid():
    weight = torch.zeros(192, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"needs scale \(2, 1\), got \(3, 1\)"):
        dequantize_fp8_blocks(weight, torch.ones(3, 1), (128, 128), torch.float32)


def e2m1(nibble: int) -> float:
    """OCP FP4 E2M1: sign bit, two exponent bits (bias 1), one mantissa bit; exponent 0 is subnormal."""
    sign, exponent, mantissa = nibble >> 3, (nibble >> 1) & 3, nibble & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def mxfp4_by_hand(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Value by value in Python: byte k of a group holds values 2k (low nibble) and 2k+1 (high nibble), each
    e2m1(nibble) * 2 ** (scale - 127)."""
    *lead, rows, groups, half = blocks.shape
    flat_b, flat_s = blocks.reshape(-1, groups, half).tolist(), scales.reshape(-1, groups).tolist()
    out = []
    for row_b, row_s in zip(flat_b, flat_s):
        values = []
        for group, exponent in zip(row_b, row_s):
            for byte in group:
                values += [math.ldexp(e2m1(byte & 0xF), exponent - 127), math.ldexp(e2m1(byte >> 4), exponent - 127)]
        out.append(values)
    return torch.tensor(out, dtype=torch.float64).reshape(*lead, rows, groups * 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_is_transformers_convert_moe_packed_tensors_bit_for_bit(dtype):
    """Every byte with every scale byte (255 included: 2 ** 128 in both), and random experts; transformers
    returns [E, cols, rows] (its gpt-oss layout), moelens the stored [E, rows, cols]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    every = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    blocks = every.repeat(256).reshape(1, 256, 16, 16)  # row r: all 256 bytes under scale r
    scales = every.reshape(1, 256, 1).expand(1, 256, 16).contiguous()
    gen = torch.Generator().manual_seed(2)
    random_blocks = torch.randint(0, 256, (4, 24, 3, 16), generator=gen, dtype=torch.int64).to(torch.uint8)
    random_scales_ = torch.randint(100, 140, (4, 24, 3), generator=gen, dtype=torch.int64).to(torch.uint8)
    for b, s in ((blocks, scales), (random_blocks, random_scales_)):
        ours = dequantize_mxfp4(b, s, dtype)
        theirs = convert_moe_packed_tensors(b, s, dtype=dtype).transpose(1, 2)
        assert ours.shape == (b.shape[0], b.shape[1], b.shape[2] * 32)
        assert torch.equal(bits(ours), bits(theirs))


def test_mxfp4_by_hand():
    assert [e2m1(n) for n in range(16)] == list(FP4_E2M1)
    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 5, 2, 16), generator=gen, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(120, 135, (2, 5, 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    expected = mxfp4_by_hand(blocks, scales)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).double(), expected)
    assert torch.equal(dequantize_mxfp4(blocks[0], scales[0], torch.float32).double(), expected[0])  # 3-D: one expert
    assert torch.equal(bits(dequantize_mxfp4(blocks, scales, torch.bfloat16)), bits(expected.to(torch.bfloat16)))


# ---- checkpoints transformers reads right: bit for bit against it -------------------------------------------------


# (name, builder, block, scale dtype): every quantized dimension a multiple of the block, or one block whole
ALIGNED = {
    # DeepSeek-V3's block, its tiny dims (24 to 88) all inside one block; float32 scales as DeepSeek publishes
    "deepseek_v3": (lambda d: tiny_deepseek_v3.build(d, seed=5), (128, 128), torch.float32),
    # bfloat16 scales (some publishers); small blocks over Qwen3's 96, 48, 64 and 32
    "qwen3_moe": (lambda d: tiny_qwen3_moe.build_qwen3_moe(d, seed=6), (16, 16), torch.bfloat16),
    "mixtral": (lambda d: tiny_mixtral.build_mixtral(d, seed=7), (32, 32), torch.float32),
    # MiniMax-M2 publishes fp8 per-expert w1 / w3 / w2 and attention projections, the router unquantized
    "minimax_m2": (lambda d: tiny_minimax_m2.build_minimax_m2(d, seed=11), (32, 32), torch.float32),
}


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    """name -> (folder, block, the float weights it was quantized from)."""
    out = {}
    for name, (build, block, scale_dtype) in ALIGNED.items():
        folder = build(tmp_path_factory.mktemp("aligned") / name)
        out[name] = folder, block, quantize_folder(folder, block, scale_dtype)
    return out


@pytest.mark.parametrize("name", list(ALIGNED))
def test_transformers_reads_the_built_files_back(aligned, name):
    """The files are what they claim: transformers' dequantized weights are the hand-written dequantization,
    and within fp8's rounding of the float weights they were quantized from."""
    folder, block, original = aligned[name]
    state = transformers_dequantized(folder, torch.float32).state_dict()
    hand = hand_dequantized(folder, block)
    ckpt = load_file(folder / "model.safetensors")
    quantized = [k for k in ckpt if k + "_scale_inv" in ckpt]
    assert len(quantized) > 10
    # each file key's rows in transformers' state dict (its experts fused), through the site map's two spellings
    site_map = type(load(folder, device="meta")).site_map(load(folder, device="meta").cfg)
    theirs_for = {t.param: key for key, t in expected_keys(site_map, state).items() if t.index == ()}
    in_files = expected_keys(site_map, ckpt)
    for key in quantized:
        target = in_files[key]
        theirs = state[theirs_for[target.param]][target.index]
        assert torch.equal(theirs, hand[key]), key
        scale = ckpt[key + "_scale_inv"].float()
        s = scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., : theirs.shape[-2], : theirs.shape[-1]]
        error = (theirs - original[key]).abs()
        assert (error <= original[key].abs() * 2**-4 + s * 2**-9).all(), key  # half an e4m3 ulp, or subnormal step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(ALIGNED))
def test_weights_and_logits_equal_transformers_dequantized(aligned, name, dtype):
    folder = aligned[name][0]
    hf = transformers_dequantized(folder, dtype)
    model = load(folder, dtype=dtype)
    assert_params_equal(model, hf.state_dict())
    check_logits(model, hf, dtype)


# ---- dimensions the block does not divide: the format, not transformers' reading -----------------------------------

PARTIAL = {
    # a 192-row q_a_proj (transformers: blocks of 96) and DeepSeek-V3's own 576-row kv_a_proj_with_mqa
    # (kv_lora_rank 568 + rope 8: transformers refuses it)
    "deepseek_v3": (lambda d: tiny_deepseek_v3.build(d, seed=8, q_lora_rank=192, kv_lora_rank=568), (128, 128), torch.float32),
    # k and v projections of 48 rows: two blocks of 32 (transformers: of 24)
    "qwen3_moe": (lambda d: tiny_qwen3_moe.build_qwen3_moe(d, seed=9), (32, 32), torch.bfloat16),
    # experts of 40: w1 / w3 rows and w2 columns one block of 32 and one of 8 (transformers: two of 20)
    "mixtral": (lambda d: tiny_mixtral.build_mixtral(d, seed=10, intermediate_size=40), (32, 32), torch.float32),
}


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """name -> (quantized folder, block, a float32 copy holding the hand-dequantized weights)."""
    out = {}
    for name, (build, block, scale_dtype) in PARTIAL.items():
        root = tmp_path_factory.mktemp("partial")
        folder = build(root / name)
        quantize_folder(folder, block, scale_dtype)
        out[name] = folder, block, dense_copy(folder, block, root / f"{name}-dense")
    return out


def test_partial_cases_are_ones_transformers_misreads(partial):
    """The checkpoints below really hold weights transformers' CPU dequantization gets wrong or refuses (if
    this fails, transformers reads partial blocks now and can be the oracle for them too)."""
    ckpt = load_file(partial["deepseek_v3"][0] / "model.safetensors")
    assert ckpt["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 64)
    assert ckpt["model.layers.0.self_attn.q_a_proj.weight"].shape == (192, 64)
    with pytest.raises(RuntimeError, match="conversion of the weights"):  # its "(576, 64) not divisible by (5, 1)"
        transformers_dequantized(partial["deepseek_v3"][0], torch.float32)
    folder, block, _ = partial["mixtral"]
    theirs = transformers_dequantized(folder, torch.float32).state_dict()["model.layers.0.mlp.experts.down_proj"][0]
    hand = hand_dequantized(folder, block)["model.layers.0.block_sparse_moe.experts.0.w2.weight"]  # [64, 40]
    assert theirs.shape == hand.shape and not torch.equal(theirs, hand)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(PARTIAL))
def test_partial_blocks_load_as_the_format_says(partial, name, dtype):
    folder, block, dense = partial[name]
    model = load(folder, dtype=dtype)
    assert_params_equal(model, hand_dequantized(folder, block), cast=True)
    check_logits(model, load_reference(dense, dtype), dtype)


# ---- layouts: fused experts, scales in another file, experts read from disk -------------------------------------------


@pytest.fixture(scope="module")
def fused_qwen(tmp_path_factory):
    folder = tiny.fused(tiny_qwen3_moe.build_qwen3_moe(tmp_path_factory.mktemp("fused") / "qwen3", seed=11))
    quantize_folder(folder, (16, 16))
    return folder


def test_fused_experts_dequantize_whole(fused_qwen):
    ckpt = load_file(fused_qwen / "model.safetensors")
    assert ckpt["model.layers.0.mlp.experts.gate_up_proj_scale_inv"].shape == (8, 4, 4)
    model = load(fused_qwen)
    assert_params_equal(model, hand_dequantized(fused_qwen, (16, 16)))


def test_fused_gate_up_whose_rows_the_block_splits_is_refused(tmp_path):
    """gate and up rows of 40 with blocks of 32: a grid over the 80 fused rows, or two grids of 2 stacked?"""
    folder = tiny_mixtral.fused(tiny_mixtral.build_mixtral(tmp_path / "m", seed=12, intermediate_size=40))
    quantize_folder(folder, (32, 32))
    message = refused(folder, "model.layers.0.mlp.experts.gate_up_proj", "gate_up_proj_scale_inv", "(8, 3, 2)", "40", "per expert")
    assert "model.safetensors" in message


def test_scale_in_another_file(aligned, tmp_path):
    """A sharded checkpoint may put a weight and its scale in different files."""
    folder = shutil.copytree(aligned["qwen3_moe"][0], tmp_path / "split")
    tensors = load_file(folder / "model.safetensors")
    moved = [k for k in tensors if k.endswith("_scale_inv") and ".layers.1." in k]
    save_file({k: tensors.pop(k) for k in moved}, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    save_file(tensors, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors} | {k: "model-00002-of-00002.safetensors" for k in moved}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load(folder)
    assert_params_equal(model, hand_dequantized(aligned["qwen3_moe"][0], (16, 16)))


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_experts_read_from_disk_are_dequantized(aligned, fused_qwen, layout):
    """expert_offload="disk" and expert parallelism read one expert at a time (ExpertReader): its rows of a
    fused stack, or its own tensors, each with its scale."""
    folder = aligned["qwen3_moe"][0] if layout == "per_expert" else fused_qwen
    hand = hand_dequantized(folder, (16, 16))
    resident = load(folder)
    files = SafetensorsFiles(folder)
    keys = key_map(type(resident).site_map(resident.cfg), files, stored_format(json.loads((folder / "config.json").read_text()), folder))
    experts = resident.blocks[0].mlp.experts
    reader = ExpertReader(files, keys, experts.spec.shapes(), torch.float32)
    for expert in (0, 5):
        gate_up, down = reader.read(0, expert)
        if layout == "per_expert":
            prefix = f"model.layers.0.mlp.experts.{expert}"
            expected = torch.cat([hand[f"{prefix}.gate_proj.weight"], hand[f"{prefix}.up_proj.weight"]]), hand[f"{prefix}.down_proj.weight"]
        else:
            expected = hand["model.layers.0.mlp.experts.gate_up_proj"][expert], hand["model.layers.0.mlp.experts.down_proj"][expert]
        assert torch.equal(gate_up, expected[0]) and torch.equal(down, expected[1])
    offloaded = load(folder, expert_offload="disk", expert_cache_bytes=0)
    assert torch.equal(offloaded(TOKENS), resident(TOKENS))


# ---- the MXFP4 loader hook: a site map's PackedWeight ---------------------------------------------------------------


def test_packed_weight_loads_through_its_format(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (4, 6, 2, 16), generator=gen, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(118, 130, (4, 6, 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    save_file({"experts.w_blocks": blocks, "experts.w_scales": scales}, tmp_path / "model.safetensors")
    site_map = SiteMap((PackedWeight("w", ("experts.w_blocks", "experts.w_scales"), "mxfp4"),), ())
    files = SafetensorsFiles(tmp_path)
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.empty(4, 6, 64, dtype=torch.bfloat16), requires_grad=False)
    keys = key_map(site_map, files, Mxfp4())
    assert keys["experts.w_blocks"].stored.keys == ("experts.w_blocks", "experts.w_scales")
    fill(module, files, keys, progress=False)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).transpose(1, 2)
    assert torch.equal(bits(module.w.data), bits(expected))
    with pytest.raises(CheckpointError, match=r"no quantization_config, but w is stored as mxfp4 \('experts.w_blocks', 'experts.w_scales'\)"):
        key_map(site_map, files, None)
    save_file({"experts.w_blocks": blocks, "experts.w_scales": scales[:, :, :1].contiguous()}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'experts.w_scales' have shape \(4, 6, 1\), blocks 'experts.w_blocks'"):
        key_map(site_map, SafetensorsFiles(tmp_path), Mxfp4())


# ---- errors: each names the file, the key and what was expected ----------------------------------------------------------

Q_KEY = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def qwen(aligned, tmp_path):
    return shutil.copytree(aligned["qwen3_moe"][0], tmp_path / "ckpt")


def rewrite(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def refused(folder, *parts):
    with pytest.raises(CheckpointError) as info:
        load(folder)
    message = str(info.value)
    for part in parts:
        assert str(part) in message, f"{part!r} not in {message!r}"
    return message


def test_scale_missing(qwen):
    rewrite(qwen, lambda t: t.pop(Q_KEY + "_scale_inv"))
    refused(qwen, "model.safetensors", repr(Q_KEY), repr(Q_KEY + "_scale_inv"), "F8_E4M3", "16x16")


def test_scale_of_the_wrong_shape(qwen):
    rewrite(qwen, lambda t: t.update({Q_KEY + "_scale_inv": t[Q_KEY + "_scale_inv"][:, :3].contiguous()}))
    refused(qwen, "model.safetensors", repr(Q_KEY + "_scale_inv"), "(6, 3)", repr(Q_KEY), "(96, 64)", "(6, 4)")


def test_scale_of_an_unquantized_weight(qwen):
    rewrite(qwen, lambda t: t.update({Q_KEY: t[Q_KEY].float()}))
    refused(qwen, "model.safetensors", repr(Q_KEY + "_scale_inv"), repr(Q_KEY), "F32", "F8_E4M3")


def test_scale_of_an_integer_dtype(qwen):
    rewrite(qwen, lambda t: t.update({Q_KEY + "_scale_inv": t[Q_KEY + "_scale_inv"].to(torch.int32)}))
    refused(qwen, "model.safetensors", repr(Q_KEY + "_scale_inv"), "I32", "F32")


def test_fp8_weight_of_a_module_listed_as_not_converted(qwen):
    config = json.loads((qwen / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.0.self_attn.q_proj"]
    (qwen / "config.json").write_text(json.dumps(config))
    refused(qwen, "model.safetensors", repr(Q_KEY), "modules_to_not_convert", "'model.layers.0.self_attn.q_proj'")


def test_fp8_weight_of_a_module_not_listed_loads(qwen):
    config = json.loads((qwen / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", "gate", "model.embed_tokens"]  # not gate_proj
    (qwen / "config.json").write_text(json.dumps(config))
    load(qwen)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    return tiny_gpt_oss.to_mxfp4(tiny_gpt_oss.build_gpt_oss(tmp_path_factory.mktemp("mxfp4") / "gpt_oss", seed=24))


def not_converted(folder, patterns):
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = patterns
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# gpt-oss's published list: attention, routers, embedding and head stay bfloat16, the experts are MXFP4
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@pytest.mark.parametrize("listed", ["model.layers.*.mlp.experts", "experts", "gate_up_proj", "model.layers.1"])
def test_mxfp4_experts_listed_as_not_converted_are_refused_as_fp8_weights_are(gpt_oss_mxfp4, tmp_path, listed):
    """MXFP4 experts whose module (or weight) modules_to_not_convert names loaded; fp8 refuses the same
    contradiction, and now MXFP4 does, with the same wording."""
    load(not_converted(shutil.copytree(gpt_oss_mxfp4, tmp_path / "published"), GPT_OSS_NOT_CONVERTED))
    folder = not_converted(shutil.copytree(gpt_oss_mxfp4, tmp_path / "ckpt"), [*GPT_OSS_NOT_CONVERTED, listed])
    refused(folder, "model.safetensors", "_blocks' is stored as MXFP4 blocks, but config.json's modules_to_not_convert lists",
            f"lists {listed!r}, which names 'model.layers.")


@pytest.mark.parametrize("case", ["fp8", "mxfp4"])
def test_an_invalid_regular_expression_in_modules_to_not_convert_is_named(qwen, gpt_oss_mxfp4, tmp_path, case):
    """transformers matches each entry as a regular expression; an invalid one was skipped here."""
    folder = qwen if case == "fp8" else shutil.copytree(gpt_oss_mxfp4, tmp_path / "gpt_oss")
    not_converted(folder, ["lm_head", "model.layers.[0"])
    refused(folder, "config.json", "modules_to_not_convert entry 'model.layers.[0' is not a valid regular expression")


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", None])
def test_unknown_quant_method(qwen, method):
    tiny.edit_config(qwen, quantization_config={"quant_method": method, "bits": 4})
    refused(qwen, "config.json", "quant_method", repr(method), "not supported", "'fp8'", "'mxfp4'")


@pytest.mark.parametrize(
    "field, value, parts",
    [
        ("weight_block_size", None, ("weight_block_size is missing", "[128, 128]")),
        ("weight_block_size", [128], ("weight_block_size = [128]", "two positive integers")),
        ("weight_block_size", [128, 0], ("weight_block_size = [128, 0]",)),
        ("activation_scheme", "static", ("activation_scheme = 'static'", "'dynamic'")),
        ("fmt", "e5m2", ("fmt = 'e5m2'", "'e4m3'")),
        ("expert_dtype", "fp4", ("expert_dtype = 'fp4'",)),
        ("modules_to_not_convert", "lm_head", ("modules_to_not_convert = 'lm_head'", "list")),
    ],
)
def test_fp8_config_is_checked(qwen, field, value, parts):
    config = json.loads((qwen / "config.json").read_text())
    if value is None:
        config["quantization_config"].pop(field)
    else:
        config["quantization_config"][field] = value
    (qwen / "config.json").write_text(json.dumps(config))
    refused(qwen, "config.json", *parts)


def test_fp8_scales_without_quantization_config(qwen):
    tiny.edit_config(qwen, quantization_config=None)
    refused(qwen, "unexpected", "_scale_inv", "no quantization_config")


def test_uint8_scales_need_ue8m0(qwen):
    def to_e8m0(t):
        for key in [k for k in t if k.endswith("_scale_inv")]:
            t[key] = (torch.log2(t[key].float()).round() + 127).to(torch.uint8)

    rewrite(qwen, to_e8m0)
    refused(qwen, "model.safetensors", "U8", "scale_fmt 'ue8m0'")
    config = json.loads((qwen / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"
    (qwen / "config.json").write_text(json.dumps(config))
    model = load(qwen)
    ckpt = load_file(qwen / "model.safetensors")
    scale = torch.exp2(ckpt[Q_KEY + "_scale_inv"].float() - 127)
    assert torch.equal(model.blocks[0].attn.q_proj.weight, by_hand(ckpt[Q_KEY], scale, (16, 16)))


def test_fp8_checkpoint_warns_nothing(aligned):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(aligned["deepseek_v3"][0])
    assert [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)] == []


def test_format_is_read_from_config():
    path = Path("config.json")
    assert stored_format({}, path) is None
    fmt = stored_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}}, path)
    assert fmt == Fp8Blocks((128, 128), "ue8m0", ())
    assert fmt.scale_shape((576, 7168)) == (5, 56) and fmt.scale_shape((8, 192, 200)) == (8, 2, 2)
    assert stored_format({"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}}, path) == Mxfp4(("router",))


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_verify_compares_partial_blocks_with_a_correct_reference(partial, name, capsys):
    """`moelens verify` of a correctly loaded checkpoint whose blocks some dimension does not divide: transformers
    reads a float32 copy dequantized as the format says (its own dequantization misreads or refuses these, see
    test_partial_cases_are_ones_transformers_misreads), so verify agrees and exits 0."""
    from moelens.cli import main
    from moelens.reference_copy import by_the_format
    from moelens.verify import FP8_REFERENCE, verify

    folder, block, _ = partial[name]
    report = verify(folder, torch.float32)
    assert report.reference == FP8_REFERENCE
    assert report.index_mismatches == 0 and report.worst() <= 1e-5, report
    assert main(["verify", str(folder), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert f"reference: {FP8_REFERENCE}" in out and "float32: OK" in out
    # the copy's dequantization is the format's, written out independently here
    stored = load_file(folder / "model.safetensors")
    key = next(k for k in stored if k + "_scale_inv" in stored)
    assert torch.equal(by_the_format(stored[key], stored[key + "_scale_inv"], block),
                       by_hand(stored[key], stored[key + "_scale_inv"], block))
