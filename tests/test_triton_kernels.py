"""Triton expert kernels (interpreter on CPU) against an fp64 per-expert loop, and end to end."""

import re

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from conftest import FAMILIES, KERNEL_FAMILIES  # noqa: E402

from moelens import HookedTransformer  # noqa: E402
from moelens.experts.spec import GLU, ClampedSwiGLU, ExpertSpec, ExpertTensors  # noqa: E402
from moelens.hooks import HookPoint  # noqa: E402
from moelens.kernels.experts import ExpertHooks, routed_experts, routed_experts_torch  # noqa: E402
from moelens.kernels.routing import align_slots, max_padded_rows  # noqa: E402
from moelens.kernels.tiles import DEFAULT_TABLE, MIN_TILE, Tile, tile_for  # noqa: E402
from moelens.kernels.triton_experts import _e2m1_scaled_to_f32, _e4m3_to_f32, routed_experts_triton  # noqa: E402

H, I = 40, 24  # not multiples of any block size
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter (conftest sets it)


SILU = GLU("silu")


def reference(x, idx, w, Wgu, Wd):
    """fp64 per-expert loop on the CPU: (neurons [T k I], weighted per-slot outputs [T k H], sum [T H])."""
    x, idx, w, Wgu, Wd = x.cpu().double(), idx.cpu(), w.cpu().double(), Wgu.cpu().double(), Wd.cpu().double()
    T, k = idx.shape
    post = torch.zeros(T, k, Wd.shape[2], dtype=torch.float64)
    out = torch.zeros(T, k, Wd.shape[1], dtype=torch.float64)
    for e in range(Wgu.shape[0]):
        t, s = torch.where(idx == e)
        gate, up = (x[t] @ Wgu[e].T).chunk(2, dim=-1)
        post[t, s] = F.silu(gate) * up
        out[t, s] = (post[t, s] @ Wd[e].T) * w[t, s, None]
    return post, out, out.sum(1)


def capture_hooks():
    store = {}
    points = [HookPoint() for _ in range(5)]
    for name, hp in zip(("pre", "pre_linear", "post", "out", "outputs"), points):
        hp.name = name
        hp.add_hook(lambda t, hook: store.__setitem__(hook.name, t.clone()))
    return ExpertHooks(*points), store


def make_case(T, E, k, dtype, mode="random", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    if mode == "one_expert":
        idx = torch.full((T, k), 0, dtype=torch.long)
        idx[:, :] = torch.arange(k)  # every token on experts 0..k-1 (all on expert 0 when k == 1)
    else:
        idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        if mode == "unused" and E > k:
            idx = idx % max(k, E // 2)  # upper half of the experts receives nothing
            idx = torch.stack([torch.unique(r)[:k] if len(torch.unique(r)) >= k else torch.randperm(E // 2, generator=gen)[:k] for r in idx])
    w = torch.rand(T, k, generator=gen)
    Wgu = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    Wd = torch.randn(E, H, I, generator=gen) / I**0.5
    return tuple(t.to(DEVICE) for t in (x.to(dtype), idx, w, Wgu.to(dtype), Wd.to(dtype)))


CASES = [(T, E, k) for T in (1, 7, 37, 64) for E, k in ((1, 1), (8, 1), (8, 2), (8, 8), (16, 4), (16, 8))]


@pytest.mark.parametrize("T,E,k", CASES)
def test_float32_against_fp64(T, E, k):
    x, idx, w, Wgu, Wd = make_case(T, E, k, torch.float32, seed=T * 100 + E + k)
    ref_post, ref_out, ref_sum = reference(x, idx, w, Wgu, Wd)
    hooks, got = capture_hooks()
    total = routed_experts_triton(x, idx, w, ExpertTensors(Wgu, Wd), hooks, (1, T)).cpu()
    assert (got["post"].cpu().double() - ref_post.view_as(got["post"])).abs().max() <= 1e-5
    assert (got["outputs"].cpu().double() - ref_out.view_as(got["outputs"])).abs().max() <= 1e-5
    assert (total.double() - ref_sum).abs().max() <= 1e-5
    assert total.dtype == torch.float32


@pytest.mark.parametrize("mode", ["one_expert", "unused"])
@pytest.mark.parametrize("T", [7, 64])
def test_skewed_routing(mode, T):
    x, idx, w, Wgu, Wd = make_case(T, 8, 2 if mode == "unused" else 1, torch.float32, mode=mode)
    if mode == "unused":
        assert idx.max() < 8 // 2
    _, _, ref_sum = reference(x, idx, w, Wgu, Wd)
    hooks, _ = capture_hooks()
    assert (routed_experts_triton(x, idx, w, ExpertTensors(Wgu, Wd), hooks, (1, T)).cpu().double() - ref_sum).abs().max() <= 1e-5


@pytest.mark.parametrize("T,E,k", [(7, 8, 2), (37, 16, 8), (64, 8, 8)])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_as_close_to_fp64_as_the_torch_path(T, E, k, weight_dtype):
    """bf16 (tiles upcast in the interpreter): the kernels' error against fp64 is no larger than the
    torch path's own (both round gate, up and down outputs to bf16; they differ in accumulation order)."""
    x, idx, w, Wgu, Wd = make_case(T, E, k, torch.bfloat16, seed=T + E + k)
    w = w.to(weight_dtype)
    ref_post, ref_out, ref_sum = reference(x, idx, w, Wgu, Wd)
    hooks_t, got_t = capture_hooks()
    hooks_k, got_k = capture_hooks()
    torch_sum = routed_experts_torch(x, idx, w, ExpertTensors(Wgu, Wd), SILU, hooks_t, (1, T))
    kernel_sum = routed_experts_triton(x, idx, w, ExpertTensors(Wgu, Wd), hooks_k, (1, T))
    assert kernel_sum.dtype == torch_sum.dtype == torch.bfloat16
    assert got_k["outputs"].dtype == got_t["outputs"].dtype == torch.promote_types(torch.bfloat16, weight_dtype)
    for name, ref, a, b in (("post", ref_post, got_t["post"], got_k["post"]), ("outputs", ref_out, got_t["outputs"], got_k["outputs"]), ("sum", ref_sum, torch_sum, kernel_sum)):
        torch_err = (a.cpu().double() - ref.view_as(a)).abs().mean()
        kernel_err = (b.cpu().double() - ref.view_as(b)).abs().mean()
        assert kernel_err <= 1.5 * torch_err + 1e-6, (name, kernel_err, torch_err)


def test_replaced_neurons_are_what_kernel_2_reads():
    x, idx, w, Wgu, Wd = make_case(9, 8, 2, torch.float32)
    hooks, _ = capture_hooks()
    hooks.post.add_hook(lambda t, hook: t * 0 + 1.0)
    total = routed_experts_triton(x, idx, w, ExpertTensors(Wgu, Wd), hooks, (1, 9))
    ones = torch.ones(9, 2, I, dtype=torch.float64)
    expected = torch.einsum("tki,tkhi->tkh", ones, Wd.cpu().double()[idx.cpu()]) * w.cpu().double()[..., None]
    assert (total.cpu().double() - expected.sum(1)).abs().max() <= 1e-5


def test_pre_hooks_replace_the_activation_input():
    x, idx, w, Wgu, Wd = make_case(9, 8, 2, torch.float32)
    hooks_k, got_k = capture_hooks()
    hooks_t, got_t = capture_hooks()
    for hooks in (hooks_k, hooks_t):
        hooks.pre.add_hook(lambda t, hook: t * 2)
    a = routed_experts_triton(x, idx, w, ExpertTensors(Wgu, Wd), hooks_k, (1, 9))
    b = routed_experts_torch(x, idx, w, ExpertTensors(Wgu, Wd), SILU, hooks_t, (1, 9))
    assert (a - b).abs().max() <= 1e-5 and (got_k["pre"] - got_t["pre"]).abs().max() <= 1e-5


def test_gradients_as_close_to_fp64_as_the_torch_path():
    """The Triton backend's gradients (its backward recomputes through the torch path) are as close to a
    float64 oracle as the torch path's own float32 gradients (accumulation order differs between them)."""
    x, idx, w, Wgu, Wd = make_case(11, 8, 2, torch.float32)
    grads = {}
    for name, fn, dtype in (("fp64", routed_experts_torch, torch.float64), ("torch", routed_experts_torch, torch.float32),
                            ("triton", routed_experts_triton, torch.float32)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, w, Wgu, Wd)]
        hooks, _ = capture_hooks()
        args = (SILU,) if fn is routed_experts_torch else ()
        fn(leaves[0], idx, leaves[1], ExpertTensors(leaves[2], leaves[3]), *args, hooks, (1, 11)).pow(2).sum().backward()
        grads[name] = [t.grad.double() for t in leaves]
    # one yardstick for both float32 paths: a few float32 ulps of the largest exact entry (both measure 0.4-4.6)
    for exact, torch_grad, kernel_grad in zip(grads["fp64"], grads["torch"], grads["triton"]):
        bound = 8 * torch.finfo(torch.float32).eps * exact.abs().max().item()
        assert (torch_grad - exact).abs().max().item() <= bound
        assert (kernel_grad - exact).abs().max().item() <= bound


def test_slot_layout_pads_each_expert_and_marks_padding():
    idx = torch.tensor([[0, 2], [2, 1], [0, 2], [1, 0]])
    layout = align_slots(idx, n_experts=4, block_m=16)
    assert layout.sorted_slots.numel() == max_padded_rows(8, 4, 16)
    n = int(layout.n_padded)
    assert n == 48  # three used experts, one block each
    rows = layout.sorted_slots[:n].view(3, 16)
    for block, expert in enumerate([0, 1, 2]):
        slots = rows[block][rows[block] < 8]
        assert sorted(slots.tolist()) == sorted((idx.flatten() == expert).nonzero().flatten().tolist())
        assert int(layout.block_expert[block]) == expert
    assert (layout.sorted_slots[n:] == 8).all()


def test_tile_table_covers_every_bucket():
    assert DEFAULT_TABLE[-1][0] is None
    uppers = [u for u, _ in DEFAULT_TABLE[:-1]]
    assert uppers == sorted(uppers)
    for _, tile in DEFAULT_TABLE:
        assert min(tile.block_m, tile.block_n, tile.block_k) >= MIN_TILE
    for n in (1, 16, 17, 64, 65, 256, 1024, 1025, 10**6):
        assert tile_for(n) in [t for _, t in DEFAULT_TABLE]
    assert tile_for(1).block_m <= tile_for(10**6).block_m
    with pytest.raises(ValueError, match=">= 16"):
        Tile(8, 64, 64)


@pytest.mark.parametrize("family", FAMILIES)
def test_end_to_end_triton_backend_equals_torch(checkpoints, family, tokens):
    path = checkpoints[family, "base"]
    torch_model = HookedTransformer.from_pretrained(path, progress=False, experts_backend="torch")
    spec = torch_model.blocks[torch_model.cfg.moe_layer_indices[0]].mlp.experts.spec
    if not spec.fused_by_triton:  # refused when asked for, before any forward, naming what the experts are
        with pytest.raises(ValueError, match=re.escape(f"experts are {spec.describe()}")):
            HookedTransformer.from_pretrained(path, progress=False, experts_backend="triton")
        return
    triton_model = HookedTransformer.from_pretrained(path, progress=False, experts_backend="triton")
    logits_t, cache_t = torch_model.run_with_cache(tokens)
    logits_k, cache_k = triton_model.run_with_cache(tokens)
    # within 1e-5, or twice the model's own float32 rounding (its float64 run) where that is larger: the kernels
    # sum in another order, and later layers amplify it (3.6e-5 on the tiny Qwen3-Next's logits through its
    # linear-attention layers; 1.05e-5 in Solar's stream with one torch thread)
    exact = HookedTransformer.from_pretrained(path, progress=False, dtype=torch.float64)
    with torch.no_grad():
        logits_x, cache_x = exact.run_with_cache(tokens)
    streams = [name for name in cache_x.keys() if name.endswith("hook_resid_post")]
    rounding = max([(logits_x.float() - logits_t).abs().max().item()]
                   + [(cache_x[name].float() - cache_t[name]).abs().max().item() for name in streams])
    tol = max(1e-5, 2 * rounding)
    assert (logits_t - logits_k).abs().max() <= tol
    # a site whose own float32 rounding is larger than the streams' (FlexOlmo's experts read the unnormed stream:
    # their neurons run larger than the stream's rounding allows for) gets twice its own, where the float64 run
    # chose the same experts (its sites are then the same computation)
    same_routing = all(torch.equal(cache_x[name], cache_t[name]) for name in cache_t.keys() if name.endswith("hook_expert_indices"))
    for name in cache_t:
        a, b = cache_t[name], cache_k[name]
        assert a.shape == b.shape, name
        if a.dtype.is_floating_point:
            own = 2 * (cache_x[name].float() - a).abs().max().item() if same_routing and a.numel() else 0.0
            # an expert no token was routed to has an empty per-expert view (blocks.L.mlp.experts.E.hook_*)
            assert a.numel() == 0 or (a - b).abs().max() <= max(tol, own), name
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("family", KERNEL_FAMILIES)
def test_ablation_and_replacement_on_triton_backend(checkpoints, family, tokens):
    model = HookedTransformer.from_pretrained(checkpoints[family, "base"], progress=False, experts_backend="triton")
    _, cache = model.run_with_cache(tokens)
    idx, clean = cache["expert_indices", 1], cache["mlp_out", 1]
    for e in range(model.cfg.n_experts):
        ablate = lambda w, hook, e=e: w.masked_fill(idx == e, 0)  # noqa: E731
        with model.hooks([("blocks.1.mlp.hook_expert_weights", ablate)]):
            _, ablated = model.run_with_cache(tokens, names_filter="blocks.1.hook_mlp_out")
        assert torch.equal((ablated["mlp_out", 1] != clean).any(-1), (idx == e).any(-1))
    with model.hooks([("blocks.1.mlp.experts.hook_post", lambda t, hook: torch.zeros_like(t))]):
        _, cache = model.run_with_cache(tokens)
    assert torch.count_nonzero(cache["blocks.1.mlp.hook_routed_out"]) == 0


def test_backend_errors_are_clear(qwen_model):
    with pytest.raises(ValueError, match="experts backend"):
        qwen_model.set_experts_backend("cuda")
    x, idx, w, Wgu, Wd = make_case(5, 8, 2, torch.float32)
    hooks, _ = capture_hooks()
    gelu = ExpertSpec(8, Wgu.shape[2], Wd.shape[2], GLU("gelu"))
    with pytest.raises(ValueError, match=r"experts are .*neurons gelu\(gate\) \* up"):
        routed_experts(x, idx, w, ExpertTensors(Wgu, Wd), gelu, hooks, (1, 5), "triton")
    with pytest.raises(ValueError, match=r"executor must be one of \('torch', 'triton'\).*resolve_backend.*got 'auto'"):
        routed_experts(x, idx, w, ExpertTensors(Wgu, Wd), gelu, hooks, (1, 5), "auto")
    biased = ExpertSpec(8, Wgu.shape[2], Wd.shape[2], bias=True)
    with pytest.raises(ValueError, match=r"b_gate_up must be \[8, 48\] in the activations' dtype torch.float32, got \[8, 48\] torch.float64"):
        routed_experts(x, idx, w, ExpertTensors(Wgu, Wd, Wgu[:, :, 0].double(), Wd[:, :, 0]), biased, hooks, (1, 5), "triton")


def test_tuned_table_round_trips(tmp_path):
    from moelens.kernels.tiles import dump_table, load_table

    table = ((32, Tile(16, 32, 32)), (None, Tile(64, 64, 32, num_warps=8)))
    path = tmp_path / "tiles.json"
    path.write_text(dump_table(table))
    assert load_table(path) == table
    assert tile_for(10, load_table(path)) == Tile(16, 32, 32)


def test_auto_uses_triton_only_on_verified_gpu_architectures(monkeypatch):
    """No GPU run of the kernel tests yet: "auto" must keep CUDA models on the torch path, and switch only for
    an architecture recorded as verified; "triton" stays available on request."""
    from moelens.kernels import experts

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert experts.resolve_backend("auto", cuda) == "torch"
    assert experts.resolve_backend("triton", cuda) == "triton"
    monkeypatch.setitem(experts.VERIFIED_TRITON_ARCHS, (9, 0), "test entry")
    assert experts.resolve_backend("auto", cuda) == "triton"
    assert experts.resolve_backend("auto", torch.device("cpu")) == "torch"


# ---- experts kept stored as fp8: dequantized in the kernels' tiles ------------------------------------------------


def quantize_fp8(W, block, scale_dtype):
    """W [E, R, C] as float8_e4m3fn codes and one scale per block (the last block of a dimension partial):
    amax / 448 per block, as bfloat16 / float32 floats, or as uint8 E8M0 exponents (a power of two above)."""
    E, R, C = W.shape
    rb, cb = -(-R // block[0]), -(-C // block[1])
    padded = F.pad(W.abs(), (0, cb * block[1] - C, 0, rb * block[0] - R))
    amax = padded.view(E, rb, block[0], cb, block[1]).amax(dim=(2, 4)).clamp_min(1e-12)
    if scale_dtype == torch.uint8:
        exponent = torch.ceil(torch.log2(amax / 448))
        scale, stored = exponent.exp2(), (exponent + 127).to(torch.uint8)
    else:
        stored = (amax / 448).to(scale_dtype)
        scale = stored.float()
    full = scale.repeat_interleave(block[0], 1)[:, :R].repeat_interleave(block[1], 2)[:, :, :C]
    return (W / full).to(torch.float8_e4m3fn), stored


def stored_fp8_experts(E, block, scale_dtype, fused, down_transposed, seed=0):
    """Random experts (H x I as above) kept stored as fp8: gate and up as two parts (per-expert checkpoints)
    or one fused stack, down as stored or transposed ([E, I, H], x @ W)."""
    from moelens.experts.stored import StoredExperts, StoredPart
    from moelens.loaders.quantized import Fp8Blocks
    from moelens.sitemap import AS_STORED, Transposed

    gen = torch.Generator().manual_seed(seed)
    Wgu, Wd = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
    Wgu[0, :3, :5] *= 1e-4  # a few codes subnormal
    fmt = Fp8Blocks(block, "ue8m0" if scale_dtype == torch.uint8 else "float")
    spec = ExpertSpec(E, H, I, storage="fp8")
    if fused:
        parts, tensors = [StoredPart("W_gate_up", (), fmt, AS_STORED, 2)], [*quantize_fp8(Wgu, block, scale_dtype)]
    else:
        parts = [StoredPart("W_gate_up", (slice(0, I),), fmt, AS_STORED, 2), StoredPart("W_gate_up", (slice(I, 2 * I),), fmt, AS_STORED, 2)]
        tensors = [*quantize_fp8(Wgu[:, :I], block, scale_dtype), *quantize_fp8(Wgu[:, I:], block, scale_dtype)]
    if down_transposed:
        parts.append(StoredPart("W_down", (), fmt, Transposed(), 2))
        tensors += quantize_fp8(Wd.transpose(1, 2).contiguous(), block, scale_dtype)
    else:
        parts.append(StoredPart("W_down", (), fmt, AS_STORED, 2))
        tensors += quantize_fp8(Wd, block, scale_dtype)
    return spec, StoredExperts(spec, parts, [t.to(DEVICE) for t in tensors])


# (block, scale dtype, fused gate_up, down stored transposed): blocks smaller than the tiles (16 x 16, 32 x 16:
# block_k is cut to their columns), 32 x 32 with partial blocks in H = 40 and I = 24, 128 x 128 larger than
# every tile and than the weights, 16 x 24 which no block_k divides (a scale per element, tiles cutting
# blocks anywhere); float32 / bfloat16 / E8M0 scales, both stored layouts the tiles read
FP8_CASES = [((32, 32), torch.bfloat16, False, False), ((128, 128), torch.float32, False, True),
             ((16, 16), torch.uint8, True, False), ((32, 16), torch.float32, True, True),
             ((16, 24), torch.bfloat16, True, False)]  # 24 columns: no block_k divides, scales per element


@pytest.mark.parametrize("block,scale_dtype,fused,down_transposed", FP8_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_tiles_hold_the_dequantized_weights_bit_for_bit(block, scale_dtype, fused, down_transposed, dtype):
    """One-hot inputs make each GEMM output one weight times one (every other product is an exact zero), so the
    pre-activations are the gate and up weights the tiles dequantized, and the per-slot outputs the down weights:
    equal, bit for bit, to StoredExperts.dequantize (the load's dequantization)."""
    E = 2
    spec, stored = stored_fp8_experts(E, block, scale_dtype, fused, down_transposed)
    dense = stored.dequantize(dtype)
    x = torch.eye(H, dtype=dtype, device=DEVICE)  # token h: the unit vector e_h
    for e in range(E):
        idx = torch.full((H, 1), e, device=DEVICE)
        hooks, got = capture_hooks()
        hooks.post.add_hook(lambda t, hook: torch.eye(I, dtype=t.dtype, device=t.device)[torch.arange(H) % I].view_as(t))
        routed_experts(x, idx, torch.ones(H, 1, dtype=dtype, device=DEVICE), stored, spec, hooks, (1, H), "triton")
        assert torch.equal(got["pre"].view(H, I), dense.gate_up[e, :I].T)
        assert torch.equal(got["pre_linear"].view(H, I), dense.gate_up[e, I:].T)
        assert torch.equal(got["outputs"].view(H, H), dense.down[e].T[torch.arange(H) % I])


@pytest.mark.parametrize("block,scale_dtype,fused,down_transposed", FP8_CASES[:2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_stored_triton_path_equals_dequantize_then_torch(block, scale_dtype, fused, down_transposed, dtype):
    """Random routing over stored experts: the triton path (dequantized in tiles) against the torch path on
    StoredExperts.dequantize's stacks, every hook and the sum. Float32: within 1e-5, the tolerance of the dense
    triton-vs-torch tests; bfloat16: as close to an fp64 oracle as the torch path (1.5x its mean error), as
    test_bfloat16_as_close_to_fp64_as_the_torch_path."""
    T, E, k = 70, 8, 2  # 70 tokens: the 32-row bucket, whose fp8 tile halves block_k (Tile.for_storage)
    spec, stored = stored_fp8_experts(E, block, scale_dtype, fused, down_transposed, seed=3)
    x, idx, w, _, _ = make_case(T, E, k, dtype, seed=5)
    dense = stored.dequantize(dtype)
    hooks_t, got_t = capture_hooks()
    hooks_k, got_k = capture_hooks()
    torch_sum = routed_experts(x, idx, w, stored, spec, hooks_t, (1, T), "torch")
    kernel_sum = routed_experts(x, idx, w, stored, spec, hooks_k, (1, T), "triton")
    assert kernel_sum.dtype == torch_sum.dtype == dtype
    if dtype == torch.float32:
        for name in ("pre", "pre_linear", "post", "outputs"):
            assert (got_k[name] - got_t[name]).abs().max() <= 1e-5, name
        assert (kernel_sum - torch_sum).abs().max() <= 1e-5
        return
    ref_post, ref_out, ref_sum = reference(x, idx, w, dense.gate_up, dense.down)
    for name, ref, a, b in (("post", ref_post, got_t["post"], got_k["post"]), ("outputs", ref_out, got_t["outputs"], got_k["outputs"]),
                            ("sum", ref_sum, torch_sum, kernel_sum)):
        torch_err = (a.cpu().double() - ref.view_as(a)).abs().mean()
        kernel_err = (b.cpu().double() - ref.view_as(b)).abs().mean()
        assert kernel_err <= 1.5 * torch_err + 1e-6, (name, kernel_err, torch_err)


def test_fp8_stored_gradients_reach_the_input():
    """The backward recomputes with the torch path on the dequantized stacks: the input's gradient is the torch
    path's, within float32 rounding (accumulation order)."""
    spec, stored = stored_fp8_experts(8, (32, 32), torch.float32, False, False, seed=4)
    x, idx, w, _, _ = make_case(11, 8, 2, torch.float32, seed=6)
    grads = []
    for executor in ("torch", "triton"):
        leaf = x.detach().clone().requires_grad_()
        hooks, _ = capture_hooks()
        routed_experts(leaf, idx, w, stored, spec, hooks, (1, 11), executor).pow(2).sum().backward()
        grads.append(leaf.grad)
    assert (grads[0] - grads[1]).abs().max() <= 1e-5


@triton.jit
def decode_e4m3(codes_ptr, out_ptr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, _e4m3_to_f32(tl.load(codes_ptr + offs)))


def test_e4m3_decoding_matches_torch_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(256, device=DEVICE)
    decode_e4m3[(1,)](codes, out)
    torch.testing.assert_close(out, codes.view(torch.float8_e4m3fn).float(), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out.signbit(), codes.view(torch.float8_e4m3fn).float().signbit())


# ---- biases and gpt-oss's ClampedSwiGLU ---------------------------------------------------------------------

CLAMPED = ClampedSwiGLU(alpha=1.702, limit=1.5)  # gpt-oss's alpha; a limit the unit-scale pre-activations cross


def biased_case(T, E, k, dtype, seed=0):
    """make_case with biases (unit scale, as the pre-activations)."""
    x, idx, w, Wgu, Wd = make_case(T, E, k, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    b_gu, b_d = torch.randn(E, 2 * I, generator=gen).to(dtype), torch.randn(E, H, generator=gen).to(dtype)
    return x, idx, w, ExpertTensors(Wgu, Wd, b_gu.to(DEVICE), b_d.to(DEVICE))


def biased_reference(x, idx, w, tensors, activation):
    """fp64 per-expert loop with biases and `activation`: (neurons, weighted outputs, sum)."""
    x, idx, w = x.cpu().double(), idx.cpu(), w.cpu().double()
    Wgu, Wd, bgu, bd = (t.cpu().double() for t in tensors)
    T, k = idx.shape
    post = torch.zeros(T, k, Wd.shape[2], dtype=torch.float64)
    out = torch.zeros(T, k, Wd.shape[1], dtype=torch.float64)
    for e in range(Wgu.shape[0]):
        t, s = torch.where(idx == e)
        gate, up = (x[t] @ Wgu[e].T + bgu[e]).chunk(2, dim=-1)
        post[t, s] = activation(gate, up)
        out[t, s] = (post[t, s] @ Wd[e].T + bd[e]) * w[t, s, None]
    return post, out, out.sum(1)


@pytest.mark.parametrize("activation", [CLAMPED, SILU], ids=["clamped_swiglu", "silu"])
@pytest.mark.parametrize("hook_pre", [False, True])
@pytest.mark.parametrize("T,E,k", [(7, 8, 2), (37, 16, 4)])
def test_biased_experts_float32_equal_the_torch_path(T, E, k, hook_pre, activation):
    """Biases added after each GEMM and the activation, fused (hook_pre False) or stand-alone on the pre-activations
    a hook returned (doubled): every hook within 1e-5 of the torch path, and of an fp64 oracle."""
    x, idx, w, tensors = biased_case(T, E, k, torch.float32, seed=T + E)
    hooks_t, got_t = capture_hooks()
    hooks_k, got_k = capture_hooks()
    if hook_pre:
        for hooks in (hooks_t, hooks_k):
            hooks.pre.add_hook(lambda t, hook: t * 2)
    torch_sum = routed_experts_torch(x, idx, w, tensors, activation, hooks_t, (1, T))
    kernel_sum = routed_experts_triton(x, idx, w, tensors, hooks_k, (1, T), activation=activation)
    for name in ("pre", "pre_linear", "post", "outputs"):
        assert (got_k[name] - got_t[name]).abs().max() <= 1e-5, name
    assert (kernel_sum - torch_sum).abs().max() <= 1e-5
    clamped = (got_t["pre"].abs() > CLAMPED.limit).float().mean()
    assert 0.05 < clamped < 0.95  # the clamp is exercised, not everywhere
    if not hook_pre:
        ref_post, ref_out, ref_sum = biased_reference(x, idx, w, tensors, activation)
        assert (got_k["post"].double() - ref_post.view_as(got_k["post"])).abs().max() <= 1e-5
        assert (kernel_sum.double() - ref_sum).abs().max() <= 1e-5


@pytest.mark.parametrize("T,E,k", [(7, 8, 2), (64, 8, 4)])
def test_biased_clamped_swiglu_bfloat16_as_close_to_fp64_as_the_torch_path(T, E, k):
    x, idx, w, tensors = biased_case(T, E, k, torch.bfloat16, seed=2 * T + E)
    ref_post, ref_out, ref_sum = biased_reference(x, idx, w, tensors, CLAMPED)
    hooks_t, got_t = capture_hooks()
    hooks_k, got_k = capture_hooks()
    torch_sum = routed_experts_torch(x, idx, w, tensors, CLAMPED, hooks_t, (1, T))
    kernel_sum = routed_experts_triton(x, idx, w, tensors, hooks_k, (1, T), activation=CLAMPED)
    assert kernel_sum.dtype == torch.bfloat16
    for name, ref, a, b in (("post", ref_post, got_t["post"], got_k["post"]), ("outputs", ref_out, got_t["outputs"], got_k["outputs"]),
                            ("sum", ref_sum, torch_sum, kernel_sum)):
        torch_err = (a.cpu().double() - ref.view_as(a)).abs().mean()
        kernel_err = (b.cpu().double() - ref.view_as(b)).abs().mean()
        assert kernel_err <= 1.5 * torch_err + 1e-6, (name, kernel_err, torch_err)


@pytest.mark.parametrize("limit", [7.0, 7.05])  # 7.05 is no bfloat16: torch's clamp casts it to 7.0625
def test_clamped_swiglu_kernel_rounds_as_torch_in_bfloat16(limit):
    """The stand-alone activation on the same bfloat16 pre-activations: torch's ClampedSwiGLU's bits (same op
    order, each op rounded to bfloat16), over values spanning both clamps."""
    from moelens.kernels.triton_experts import silu_mul

    activation = ClampedSwiGLU(alpha=1.702, limit=limit)
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(4096, generator=gen) * 6).bfloat16(), (torch.randn(4096, generator=gen) * 6).bfloat16()
    gate[:4] = torch.tensor([7.0, 7.0625, 7.03125, -7.0625])
    up[:4] = torch.tensor([-7.0625, 7.0625, -7.03125, 7.0])
    expected = activation(gate, up)
    got = silu_mul(gate.to(DEVICE), up.to(DEVICE), activation).cpu()
    assert torch.equal(got, expected), (got != expected).sum()


def test_biased_experts_gradients_equal_the_torch_paths():
    """Gradients of the input, weights and biases through the Triton backend (its backward recomputes through the
    torch path) against the torch path's, float32."""
    x, idx, w, tensors = biased_case(11, 8, 2, torch.float32, seed=9)
    grads = []
    for executor in ("torch", "triton"):
        leaves = [t.detach().clone().requires_grad_() for t in (x, *tensors)]
        hooks, _ = capture_hooks()
        spec = ExpertSpec(8, H, I, CLAMPED, bias=True)
        routed_experts(leaves[0], idx, w, ExpertTensors(*leaves[1:]), spec, hooks, (1, 11), executor).pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for name, a, b in zip(("x", "W_gate_up", "W_down", "b_gate_up", "b_down"), *grads):
        assert (a - b).abs().max() <= 1e-4 * max(1.0, a.abs().max().item()), name


# ---- experts kept stored as MXFP4: dequantized in the kernels' tiles ------------------------------------------------

MX_H, MX_I = 96, 64  # MXFP4 packs 32 columns per scale: both GEMMs' inner widths are multiples of 32


def stored_mxfp4_experts(E, interleaved, bias, seed=0):
    """Random experts (MX_H x MX_I) kept stored as MXFP4 as gpt-oss publishes them: gate and up rows interleaved
    (or gate rows first), down as stored, biases dense (b_gate_up interleaved, as gpt-oss stores it) or none;
    ClampedSwiGLU with biases, SiLU without. Scales spread over 2 ** -8 .. 2 ** 2, a few codes subnormal."""
    from tiny_gpt_oss import quantize_mxfp4

    from moelens.experts.stored import StoredExperts, StoredPart
    from moelens.loaders.quantized import Mxfp4
    from moelens.sitemap import AS_STORED, Interleaved, InterleavedRows

    gen = torch.Generator().manual_seed(seed)
    Wgu = torch.randn(E, 2 * MX_I, MX_H, generator=gen) * torch.rand(E, 2 * MX_I, 1, generator=gen).mul(10).exp2() / 2**8
    Wd = torch.randn(E, MX_H, MX_I, generator=gen) / MX_I**0.5
    fmt = Mxfp4()
    spec = ExpertSpec(E, MX_H, MX_I, CLAMPED if bias else SILU, bias=bias, storage="mxfp4")
    parts = [StoredPart("W_gate_up", (), fmt, InterleavedRows() if interleaved else AS_STORED, 2), StoredPart("W_down", (), fmt, AS_STORED, 2)]
    tensors = [*quantize_mxfp4(Wgu), *quantize_mxfp4(Wd)]
    if bias:
        parts += [StoredPart("b_gate_up", (), None, Interleaved()), StoredPart("b_down", (), None, AS_STORED)]
        tensors += [torch.randn(E, 2 * MX_I, generator=gen).bfloat16(), torch.randn(E, MX_H, generator=gen).bfloat16()]
    return spec, StoredExperts(spec, parts, [t.to(DEVICE) for t in tensors])


@triton.jit
def decode_mxfp4(nibbles_ptr, scales_ptr, out_ptr):
    offs = tl.arange(0, 4096)
    tl.store(out_ptr + offs, _e2m1_scaled_to_f32(tl.load(nibbles_ptr + offs), tl.load(scales_ptr + offs)))


def test_mxfp4_decoding_matches_the_dequantization_for_every_code_and_scale():
    """Every (E8M0 scale, e2m1 nibble): the bits of the dequantization's table (subnormal products, 2 ** 127,
    inf above it, -0)."""
    from moelens.loaders.quantized import MXFP4_VALUES

    scales = torch.arange(256, dtype=torch.uint8, device=DEVICE).repeat_interleave(16)
    nibbles = torch.arange(16, dtype=torch.uint8, device=DEVICE).repeat(256)
    out = torch.empty(4096, device=DEVICE)
    decode_mxfp4[(1,)](nibbles, scales, out)
    assert torch.equal(out.cpu().view(torch.int32), MXFP4_VALUES.flatten().view(torch.int32))


@pytest.mark.parametrize("tile", [None, Tile(16, 32, 64)], ids=["table", "scale_per_element"])
@pytest.mark.parametrize("interleaved,bias", [(True, True), (False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_tiles_hold_the_dequantized_weights_bit_for_bit(tile, interleaved, bias, dtype):
    """One-hot inputs (as the fp8 test): the pre-activations are the gate and up weights the tiles dequantized
    (plus the biases, added as the torch path adds them), the per-slot outputs the down weights (plus b_down):
    equal, bit for bit, to StoredExperts.dequantize. Tile(16, 32, 64) spans two 32-column scale groups: the
    per-element scale lookup."""
    E = 2
    spec, stored = stored_mxfp4_experts(E, interleaved, bias, seed=1)
    dense = stored.dequantize(dtype)
    x = torch.eye(MX_H, dtype=dtype, device=DEVICE)
    neuron_of = torch.arange(MX_H) % MX_I
    for e in range(E):
        idx = torch.full((MX_H, 1), e, device=DEVICE)
        hooks, got = capture_hooks()
        hooks.post.add_hook(lambda t, hook: torch.eye(MX_I, dtype=t.dtype, device=t.device)[neuron_of].view_as(t))
        routed_experts_triton(x, idx, torch.ones(MX_H, 1, dtype=dtype, device=DEVICE), stored, hooks, (1, MX_H), tile,
                              spec.activation)
        gate, up, down = dense.gate_up[e, :MX_I].T, dense.gate_up[e, MX_I:].T, dense.down[e].T[neuron_of]
        if bias:
            gate, up, down = gate + dense.gate_up_bias[e, :MX_I], up + dense.gate_up_bias[e, MX_I:], down + dense.down_bias[e]
        assert torch.equal(got["pre"].view(MX_H, MX_I), gate)
        assert torch.equal(got["pre_linear"].view(MX_H, MX_I), up)
        assert torch.equal(got["outputs"].view(MX_H, MX_H), down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_stored_triton_path_equals_dequantize_then_torch(dtype):
    """gpt-oss's layout (interleaved rows, biases, ClampedSwiGLU), random routing: the triton path against the
    torch path on StoredExperts.dequantize's stacks. Float32: every hook and the sum within 1e-5; bfloat16: as
    close to an fp64 oracle as the torch path (1.5x its mean error)."""
    T, E, k = 70, 8, 2
    spec, stored = stored_mxfp4_experts(E, True, True, seed=3)
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(T, MX_H, generator=gen) / 4).to(dtype).to(DEVICE)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, k, generator=gen).to(dtype).to(DEVICE)
    hooks_t, got_t = capture_hooks()
    hooks_k, got_k = capture_hooks()
    torch_sum = routed_experts(x, idx, w, stored, spec, hooks_t, (1, T), "torch")
    kernel_sum = routed_experts(x, idx, w, stored, spec, hooks_k, (1, T), "triton")
    assert kernel_sum.dtype == torch_sum.dtype == dtype
    if dtype == torch.float32:
        for name in ("pre", "pre_linear", "post", "outputs"):
            assert (got_k[name] - got_t[name]).abs().max() <= 1e-5, name
        assert (kernel_sum - torch_sum).abs().max() <= 1e-5
        return
    ref_post, ref_out, ref_sum = biased_reference(x, idx, w, stored.dequantize(dtype), CLAMPED)
    for name, ref, a, b in (("post", ref_post, got_t["post"], got_k["post"]), ("outputs", ref_out, got_t["outputs"], got_k["outputs"]),
                            ("sum", ref_sum, torch_sum, kernel_sum)):
        torch_err = (a.cpu().double() - ref.view_as(a)).abs().mean()
        kernel_err = (b.cpu().double() - ref.view_as(b)).abs().mean()
        assert kernel_err <= 1.5 * torch_err + 1e-6, (name, kernel_err, torch_err)
