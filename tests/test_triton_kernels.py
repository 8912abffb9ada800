"""Triton expert kernels (interpreter on CPU) against an fp64 per-expert loop, and end to end."""

import re

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from conftest import FAMILIES, KERNEL_FAMILIES  # noqa: E402

from moelens import HookedTransformer  # noqa: E402
from moelens.experts.spec import GLU, ExpertSpec, ExpertTensors  # noqa: E402
from moelens.hooks import HookPoint  # noqa: E402
from moelens.kernels.experts import ExpertHooks, routed_experts, routed_experts_torch  # noqa: E402
from moelens.kernels.routing import align_slots, max_padded_rows  # noqa: E402
from moelens.kernels.tiles import DEFAULT_TABLE, MIN_TILE, Tile, tile_for  # noqa: E402
from moelens.kernels.triton_experts import routed_experts_triton  # noqa: E402

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
    points = [HookPoint() for _ in range(4)]
    for name, hp in zip(("pre", "pre_linear", "post", "outputs"), points):
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
    assert (logits_t - logits_k).abs().max() <= 1e-5
    for name in cache_t:
        a, b = cache_t[name], cache_k[name]
        assert a.shape == b.shape, name
        if a.dtype.is_floating_point:
            # an expert no token was routed to has an empty per-expert view (blocks.L.mlp.experts.E.hook_*)
            assert a.numel() == 0 or (a - b).abs().max() <= 1e-5, name
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
    with pytest.raises(ValueError, match="with biases"):
        routed_experts(x, idx, w, ExpertTensors(Wgu, Wd, Wgu[:, :, 0], Wd[:, :, 0]), biased, hooks, (1, 5), "triton")


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
