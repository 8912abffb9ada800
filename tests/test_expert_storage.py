"""from_pretrained(expert_storage="fp8" / "mxfp4"): routed experts kept as the checkpoint stores them and
dequantized when routed to. The oracle is the same checkpoint dequantized at load (itself checked against
transformers and a hand-written dequantization in test_quantized_checkpoints.py): logits and every hook of
run_with_cache bit for bit, in float32 and bfloat16, resident, offloaded (cpu, disk) and expert-parallel;
the bytes held are the files' stored bytes, counted from the checkpoint itself."""

import os
import shutil
import socket
import warnings

import pytest
import tiny
import tiny_deepseek_v3
import tiny_gpt_oss
import tiny_qwen3_moe
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from test_quantized_checkpoints import quantize_folder

from moelens import HookedTransformer
from moelens.experts.stored import StoredExperts
from moelens.loaders.errors import CheckpointError, CheckpointWarning

TOKENS = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
FP8_CODES = {torch.float8_e4m3fn}


def fp8(folder, block, scale_dtype=torch.float32, **config):
    quantize_folder(folder, block, scale_dtype, **config)
    return folder


def e8m0_scales(folder):
    """Scales as DeepSeek-V3.1 stores them: uint8 power-of-two exponents (scale_fmt "ue8m0")."""
    tensors = load_file(folder / "model.safetensors")
    for key in [k for k in tensors if k.endswith("_scale_inv")]:
        tensors[key] = (torch.log2(tensors[key].float()).round() + 127).to(torch.uint8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


# name -> (builder, storage). The fp8 ones: per-expert keys whose gate / up rows (40) and d_model (72) the
# block (32) does not divide, so gate's and up's grids each end in a partial block, bfloat16 scales;
# DeepSeek-V3 with its real 128 x 128 blocks and float32 scales (and a shared expert, a dense first block);
# transformers' fused stacks with E8M0 scales.
CASES = {
    "qwen3_fp8_partial": (
        lambda d: fp8(tiny_qwen3_moe.build_qwen3_moe(d, seed=21, hidden_size=72, moe_intermediate_size=40), (32, 32), torch.bfloat16),
        "fp8",
    ),
    "deepseek_v3_fp8": (lambda d: fp8(tiny_deepseek_v3.build(d, seed=22), (128, 128)), "fp8"),
    "qwen3_fp8_fused_e8m0": (
        lambda d: e8m0_scales(fp8(tiny.fused(tiny_qwen3_moe.build_qwen3_moe(d, seed=23)), (16, 16), scale_fmt="ue8m0")),
        "fp8",
    ),
    "gpt_oss_mxfp4": (lambda d: tiny_gpt_oss.to_mxfp4(tiny_gpt_oss.build_gpt_oss(d, seed=24)), "mxfp4"),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("stored")
    return {name: build(root / name) for name, (build, _) in CASES.items()}


def load(folder, **kwargs):
    return HookedTransformer.from_pretrained(folder, progress=False, **kwargs)


def assert_same_run(stored, dense, tokens=TOKENS):
    """Logits and every cached hook, bit for bit (torch.equal), and an intervention: every slot of the last
    mixture layer re-routed to expert 1, and a per-expert site (TransformerLens's experts.E.hook_post) edited."""
    logits, cache = dense.run_with_cache(tokens)
    got_logits, got = stored.run_with_cache(tokens)
    assert torch.equal(got_logits, logits)
    assert got.keys() == cache.keys() and len(cache.keys()) > 30 * dense.cfg.n_layers
    different = [name for name in cache.keys() if not torch.equal(got[name], cache[name])]
    assert different == [], different
    last, first = dense.cfg.moe_layer_indices[-1], dense.cfg.moe_layer_indices[0]
    hooks = [
        (f"blocks.{last}.mlp.hook_expert_indices", lambda idx, hook: torch.ones_like(idx)),
        (f"blocks.{first}.mlp.experts.2.hook_post", lambda t, hook: t * 3),
    ]
    assert torch.equal(stored.run_with_hooks(tokens, fwd_hooks=hooks), dense.run_with_hooks(tokens, fwd_hooks=hooks))


def held(model) -> list[StoredExperts]:
    return [b.mlp.experts.stored for b in model.blocks if b.is_moe]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CASES))
def test_every_hook_equals_dequantize_at_load(ckpts, name, dtype):
    storage = CASES[name][1]
    dense = load(ckpts[name], dtype=dtype)
    stored = load(ckpts[name], dtype=dtype, expert_storage=storage)
    codes = FP8_CODES if storage == "fp8" else {torch.uint8}
    for stack in held(stored):
        assert isinstance(stack, StoredExperts) and codes <= {t.dtype for t in stack.tensors}
    experts = stored.blocks[stored.cfg.moe_layer_indices[0]].mlp.experts
    assert dict(experts.named_parameters(recurse=False)) == {} and dict(experts.named_buffers(recurse=False)) == {}
    assert stored.cfg.n_params == dense.cfg.n_params  # TransformerLens's count: the experts' matrices, however held
    assert_same_run(stored, dense)
    # tensors() is the dequantize-at-load stacks, bit for bit, and a copy: editing it changes nothing
    for layer in stored.cfg.moe_layer_indices:
        ours, theirs = stored.blocks[layer].mlp.experts.tensors(), dense.blocks[layer].mlp.experts.tensors()
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours.present(), theirs.present(), strict=True))
        ours.gate_up.zero_()
    assert torch.equal(stored(TOKENS), dense(TOKENS))


def ffn_sublayer(model, layer: int):
    return next(sub for sub in model.blocks[layer].sublayers() if sub.kind == "ffn")


def test_weight_views_and_decomposition_read_the_dequantized_experts(ckpts):
    dense = load(ckpts["gpt_oss_mxfp4"])
    stored = load(ckpts["gpt_oss_mxfp4"], expert_storage="mxfp4")
    for view in ("W_gate", "W_in", "W_out"):
        assert torch.equal(getattr(stored, view), getattr(dense, view)), view
    _, ours = stored.run_with_cache(TOKENS)
    _, theirs = dense.run_with_cache(TOKENS)
    for layer in stored.cfg.moe_layer_indices:
        a, labels = ours._mlp_neuron_parts(layer, ffn_sublayer(stored, layer), None, None)
        b, labels_dense = theirs._mlp_neuron_parts(layer, ffn_sublayer(dense, layer), None, None)
        assert labels == labels_dense and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["qwen3_fp8_partial", "deepseek_v3_fp8"])
def test_experts_weight_attributes_are_the_dequantized_stacks(ckpts, name):
    """blocks[L].mlp.experts.W_gate_up / W_down on stored (and host-offloaded stored) experts: the stacks a dense
    load holds, bit for bit; each read a fresh tensor, so writing to one leaves the model as it was."""
    dense = load(ckpts[name])
    for kwargs in ({"expert_storage": "fp8"}, {"expert_storage": "fp8", "expert_offload": "cpu"}):
        stored = load(ckpts[name], **kwargs)
        for layer in dense.cfg.moe_layer_indices:
            ours, theirs = stored.blocks[layer].mlp.experts, dense.blocks[layer].mlp.experts
            assert dict(ours.named_parameters(recurse=False)) == {}
            for attr in ("W_gate_up", "W_down"):
                got = getattr(ours, attr)
                assert not isinstance(got, torch.nn.Parameter) and got.dtype == getattr(theirs, attr).dtype
                assert torch.equal(got, getattr(theirs, attr)), (kwargs, layer, attr)
                assert got.data_ptr() != getattr(ours, attr).data_ptr()  # a fresh tensor per read
            ours.W_gate_up.zero_()
            ours.W_down.mul_(2)
        for view in ("W_gate", "W_in", "W_out"):
            a, b = getattr(stored, view), getattr(dense, view)
            layers = dense.cfg.moe_layer_indices
            assert all(torch.equal(a[l], b[l]) for l in layers), (kwargs, view)
        assert torch.equal(stored(TOKENS), dense(TOKENS))  # the writes above changed nothing
        assert not hasattr(stored.blocks[layers[0]].mlp.experts, "b_gate_up")  # no biases in this spec


def test_experts_weight_attributes_of_disk_offloaded_experts_say_why(ckpts):
    stored = load(ckpts["qwen3_fp8_partial"], expert_storage="fp8", expert_offload="disk")
    experts = stored.blocks[0].mlp.experts
    assert not hasattr(experts, "W_down")
    with pytest.raises(AttributeError, match="experts.W_down: .*offloaded to disk"):
        experts.W_down


def stored_bytes_in_files(folder, layer: int) -> int:
    """The bytes the checkpoint stores for one layer's routed experts (every tensor of mlp.experts)."""
    return sum(t.nbytes for k, t in load_file(folder / "model.safetensors").items() if f"layers.{layer}.mlp.experts." in k)


@pytest.mark.parametrize("mode", ["cpu", "disk"])
@pytest.mark.parametrize("name", ["qwen3_fp8_partial", "gpt_oss_mxfp4"])
def test_offload_moves_the_stored_bytes(ckpts, name, mode):
    storage = CASES[name][1]
    dense = load(ckpts[name], dtype=torch.bfloat16)
    stored = load(ckpts[name], dtype=torch.bfloat16, expert_storage=storage, expert_offload=mode, expert_cache_bytes=0,
                  expert_prefetch=False)  # every byte moved is then a miss's
    assert_same_run(stored, dense)
    layer = stored.cfg.moe_layer_indices[0]
    per_expert = stored_bytes_in_files(ckpts[name], layer) // stored.cfg.n_experts
    stored.expert_cache.stats.bytes_moved = stored.expert_cache.stats.misses = 0
    stored(TOKENS)
    stats = stored.expert_cache_stats()
    assert stats.misses > 0 and stats.bytes_moved == stats.misses * per_expert
    if mode == "cpu":  # the host copy is the stored one too
        host = stored.blocks[layer].mlp.experts.host
        assert isinstance(host, StoredExperts) and host.nbytes == stored_bytes_in_files(ckpts[name], layer)
    # a cache that keeps everything holds the stored bytes of every expert routed to
    kept = load(ckpts[name], dtype=torch.bfloat16, expert_storage=storage, expert_offload=mode, expert_cache_bytes=10**9)
    assert torch.equal(kept(TOKENS), dense(TOKENS))  # with prefetch at its default too
    cached = kept.expert_cache.entries
    assert {t.dtype for weights in cached.values() for t in weights} >= ({torch.float8_e4m3fn} if storage == "fp8" else {torch.uint8})
    assert kept.expert_cache.bytes == len(cached) * per_expert


@pytest.mark.parametrize("storage", ["fp8", "mxfp4"])
def test_held_bytes_at_real_block_sizes(tmp_path, storage):
    """d_model 256 and d_expert 256 with DeepSeek-V3's 128 x 128 blocks and float32 scales, or gpt-oss's
    MXFP4 groups of 32 with bfloat16 biases: the bytes the layers hold against the same experts in bfloat16."""
    if storage == "fp8":
        folder = tiny_qwen3_moe.build_qwen3_moe(tmp_path / "q", seed=25, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=1)
        quantize_folder(folder, (128, 128))
    else:
        folder = tiny_gpt_oss.to_mxfp4(tiny_gpt_oss.build_gpt_oss(tmp_path / "g", seed=26, hidden_size=256, intermediate_size=256, num_hidden_layers=1))
    stored = load(folder, dtype=torch.bfloat16, expert_storage=storage)
    dense = load(folder, dtype=torch.bfloat16)
    for layer in stored.cfg.moe_layer_indices:
        held_bytes = stored.blocks[layer].mlp.experts.stored.nbytes
        bf16_bytes = sum(p.nbytes for p in dense.blocks[layer].mlp.experts.parameters())
        assert held_bytes == stored_bytes_in_files(folder, layer)
        assert held_bytes <= (0.55 if storage == "fp8" else 0.3) * bf16_bytes, held_bytes / bf16_bytes
    assert_same_run(stored, dense, TOKENS[:1, :8])


def test_model_to_moves_stored_experts_and_never_casts_them(ckpts):
    model = load(ckpts["qwen3_fp8_partial"], expert_storage="fp8")
    before = [t.dtype for t in held(model)[0].tensors]
    model.to(torch.bfloat16)
    assert [t.dtype for t in held(model)[0].tensors] == before
    experts = model.blocks[0].mlp.experts
    assert experts.tensors().gate_up.dtype == torch.bfloat16 and model(TOKENS).dtype == torch.bfloat16
    model.to("meta")
    assert held(model)[0].device.type == "meta"


@pytest.mark.parametrize("mode", [None, "disk"])
@pytest.mark.parametrize("name", ["qwen3_fp8_partial", "gpt_oss_mxfp4"])
def test_dtype_moves_keep_the_dense_models_bits(ckpts, name, mode):
    """Loaded in bfloat16, then moved to float32, back, through float16 and to float32 again: the dense
    model's weights keep every move's rounding (bfloat16 values in float32, then float16's rounding of
    them), so stored experts, resident or read from disk into a one-expert cache, must be made through the
    same roundings, not dequantized afresh in the new dtype (which differed by 0.0102 / 0.0012 in the
    float32 logits). Offloaded dense experts follow the same moves (they failed on a dtype mismatch)."""
    storage = CASES[name][1]
    offload = {} if mode is None else {"expert_offload": mode, "expert_cache_bytes": 0, "expert_prefetch": False}
    dense = load(ckpts[name], dtype=torch.bfloat16)
    models = [load(ckpts[name], dtype=torch.bfloat16, expert_storage=storage, **offload)]
    if mode is not None:
        models.append(load(ckpts[name], dtype=torch.bfloat16, **offload))
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float32):
        dense.to(dtype)
        for model in models:
            model.to(dtype)
            assert_same_run(model, dense)
    if mode is None:  # tensors() too: the dense model's stacks
        layer = dense.cfg.moe_layer_indices[0]
        ours, theirs = models[0].blocks[layer].mlp.experts.tensors(), dense.blocks[layer].mlp.experts.tensors()
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ours.present(), theirs.present(), strict=True))


# layer 0's expert 3 poisoned in its stored form: an infinite fp8 block scale, an MXFP4 exponent byte of 255
POISON = {
    "qwen3_fp8_partial": ("model.layers.0.mlp.experts.3.up_proj.weight_scale_inv", (0, 0), float("inf")),
    "gpt_oss_mxfp4": ("model.layers.0.mlp.experts.gate_up_proj_scales", (3, 0, 0), 255),
}


@pytest.mark.parametrize("name", list(POISON))
def test_nan_stored_experts_read_from_disk_warn_as_resident_ones_do(ckpts, name, tmp_path):
    """check_finite for experts kept stored and offloaded to disk: each is checked (dequantized) the first
    time it is read, here when a forward routes to it, with the resident load's warning, once."""
    storage = CASES[name][1]
    folder = shutil.copytree(ckpts[name], tmp_path / name)
    key, index, value = POISON[name]
    tensors = load_file(folder / "model.safetensors")
    tensors[key][index] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    def warned(**kwargs) -> list[str]:
        to_expert_3 = [("blocks.0.mlp.hook_expert_indices", lambda idx, hook: torch.full_like(idx, 3))]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = load(folder, dtype=torch.bfloat16, expert_storage=storage, **kwargs)
            for _ in range(2):  # read twice from disk (a one-expert cache), warned about once
                model.run_with_hooks(TOKENS[:1, :4], fwd_hooks=to_expert_3)
        return [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]

    resident = warned()
    assert len(resident) == 1 and "layer 0 expert 3 W_gate_up:" in resident[0] and "once dequantized" in resident[0]
    assert warned(expert_offload="disk", expert_cache_bytes=0, expert_prefetch=False) == resident
    assert warned(expert_offload="cpu", expert_cache_bytes=0, expert_prefetch=False) == resident
    assert warned(expert_offload="disk", expert_cache_bytes=0, expert_prefetch=False, check_finite=False) == []


# ---- refusals: each names what is at fault ---------------------------------------------------------------------


def test_a_checkpoint_not_stored_so_is_refused(ckpts, tmp_path):
    plain = tiny_qwen3_moe.build_qwen3_moe(tmp_path / "plain", seed=27)
    with pytest.raises(CheckpointError, match=r"config.json has no quantization_config .*expert_storage='fp8'.*expert_storage=None"):
        load(plain, expert_storage="fp8")
    with pytest.raises(CheckpointError, match=r"config.json says quant_method 'fp8'.*expert_storage='mxfp4'.*or expert_storage='fp8'"):
        load(ckpts["qwen3_fp8_partial"], expert_storage="mxfp4")
    with pytest.raises(CheckpointError, match=r"says quant_method 'mxfp4'.*or expert_storage='mxfp4'"):
        load(ckpts["gpt_oss_mxfp4"], expert_storage="fp8")
    # one expert's weight stored dense where the others are fp8
    folder = shutil.copytree(ckpts["qwen3_fp8_partial"], tmp_path / "mixed")
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    tensors[key] = tensors[key].to(torch.bfloat16)
    del tensors[key + "_scale_inv"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"model.safetensors: routed expert weight '{key}' is stored as BF16, not fp8"):
        load(folder, expert_storage="fp8")
    load(folder)  # dequantized at load, it reads


def test_arguments_are_checked(ckpts):
    folder = ckpts["qwen3_fp8_partial"]
    with pytest.raises(ValueError, match=r"expert_storage must be one of \[None, 'dense', 'fp8', 'mxfp4'\].*got 'int4'"):
        load(folder, expert_storage="int4")
    assert held(load(folder, expert_storage="dense")) == [None, None, None]  # dense: dequantized at load
    inspected = load(folder, expert_storage="fp8", device="meta")  # headers checked, nothing read or held
    assert held(inspected) == [None, None, None] and "kept fp8 as stored" in inspected.blocks[0].mlp.experts.spec.describe()
    with pytest.raises(ValueError, match=r"fold_ln rewrites the routed experts.*expert_storage='fp8'"):
        load(folder, expert_storage="fp8", fold_ln=True)
    model = load(folder, expert_storage="fp8")
    with pytest.raises(ValueError, match=r"keeps stored as 'fp8'.*expert_storage=None to fold"):
        model.process_weights_(fold_ln=True)
    mxfp4 = load(ckpts["gpt_oss_mxfp4"], expert_storage="mxfp4")
    experts = mxfp4.blocks[0].mlp.experts
    assert (experts.backend, experts.executor) == ("auto", "torch")  # auto: no verified GPU architecture here


@pytest.mark.parametrize("name,offload", [("qwen3_fp8_partial", None), ("deepseek_v3_fp8", None),
                                          ("qwen3_fp8_fused_e8m0", None), ("qwen3_fp8_partial", "cpu"),
                                          ("gpt_oss_mxfp4", None), ("gpt_oss_mxfp4", "cpu")])
def test_triton_backend_dequantizes_stored_experts_in_its_tiles(ckpts, name, offload):
    """experts_backend='triton' on experts kept fp8 or mxfp4 (the kernels read codes and scales and dequantize in
    their tiles; gpt-oss's MXFP4 gate and up rows interleaved, its biases and ClampedSwiGLU) against the same checkpoint dequantized at load on the torch path: logits and every cached hook
    within 1e-5 in float32, the tolerance of the dense triton-vs-torch end-to-end test (only the GEMMs'
    accumulation order differs: the tiles hold the dequantized weights' bits, tests/test_triton_kernels.py);
    resident, and offloaded to host memory (the store hands the routed experts over as stored)."""
    pytest.importorskip("triton")
    dense = load(ckpts[name], experts_backend="torch")
    stored = load(ckpts[name], expert_storage=CASES[name][1], experts_backend="triton", expert_offload=offload)
    assert {b.mlp.experts.executor for b in stored.blocks if b.is_moe} == {"triton"}
    logits, cache = dense.run_with_cache(TOKENS)
    got_logits, got = stored.run_with_cache(TOKENS)
    assert (got_logits - logits).abs().max() <= 1e-5
    assert got.keys() == cache.keys()
    for key in cache.keys():
        a, b = cache[key], got[key]
        assert a.shape == b.shape, key
        if a.dtype.is_floating_point:
            assert a.numel() == 0 or (a - b).abs().max() <= 1e-5, key
        else:
            assert torch.equal(a, b), key


# ---- expert parallelism: each rank holds its experts as stored -------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def observe(model) -> dict:
    logits, cache = model.run_with_cache(TOKENS)
    last = model.cfg.n_experts - 1  # every slot of the last layer on the last rank: the first routes to none
    rerouted = model.run_with_hooks(
        TOKENS, fwd_hooks=[(f"blocks.{model.cfg.moe_layer_indices[-1]}.mlp.hook_expert_indices", lambda i, hook: torch.full_like(i, last))]
    )
    return {"logits": logits, "cache": dict(cache.items()), "rerouted": rerouted}


def ep_worker(rank: int, world: int, port: int, cases: dict[str, tuple[str, str]], out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    results = {}
    for name, (path, storage) in cases.items():
        model = HookedTransformer.from_pretrained(path, progress=False, expert_parallel=True, expert_storage=storage)
        shard = model.blocks[model.cfg.moe_layer_indices[0]].mlp.experts.shard
        held_dtypes = sorted(str(t.dtype) for t in shard.tensors.tensors) if isinstance(shard.tensors, StoredExperts) else None
        results[name] = observe(model) | {"held": (shard.tensors.n_experts, held_dtypes)}
        moved = HookedTransformer.from_pretrained(
            path, progress=False, dtype=torch.bfloat16, expert_parallel=True, expert_storage=storage
        ).to(torch.float32)
        results[name]["moved"] = moved(TOKENS)  # the dense model's bits after a dtype move (bfloat16's rounding kept)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_expert_parallel_ranks_hold_stored_experts(ckpts, tmp_path):
    cases = {name: (str(ckpts[name]), CASES[name][1]) for name in ("qwen3_fp8_partial", "gpt_oss_mxfp4")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU GEMMs round by thread count: the ranks run on one thread each
    try:
        reference = {name: observe(load(path)) for name, (path, _) in cases.items()}
        for name, (path, _) in cases.items():
            reference[name]["moved"] = load(path, dtype=torch.bfloat16).to(torch.float32)(TOKENS)
    finally:
        torch.set_num_threads(threads)
    mp.spawn(ep_worker, args=(2, free_port(), cases, str(tmp_path)), nprocs=2, start_method="spawn")
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for name, ref in reference.items():
            got = results[name]
            n, dtypes = got["held"]
            assert n == 4 and dtypes is not None and ("torch.float8_e4m3fn" in dtypes or "torch.uint8" in dtypes), (rank, name, dtypes)
            assert torch.equal(got["logits"], ref["logits"]) and torch.equal(got["rerouted"], ref["rerouted"]), (rank, name)
            assert torch.equal(got["moved"], ref["moved"]), (rank, name)
            different = [hook for hook, t in ref["cache"].items() if not torch.equal(got["cache"][hook], t)]
            assert got["cache"].keys() == ref["cache"].keys() and different == [], (rank, name, different)
