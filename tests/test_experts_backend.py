"""The experts backend is resolved when it is set and when the experts move, never per forward: "auto" becomes
"torch" or "triton" for the device the experts are computed on, "triton" is refused where it cannot run at
set (or move) time, and a forward only checks that its input is where the backend was resolved for."""

import pytest
import tiny
import torch

from moelens import HookedTransformer
from moelens.experts.spec import GLU, ExpertSpec
from moelens.kernels import experts as kernel_experts
from moelens.models.components import moe

TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return tiny.build_qwen2_moe(tmp_path_factory.mktemp("backend") / "qwen2_moe", seed=0)


def load(folder, **kwargs):
    return HookedTransformer.from_pretrained(folder, progress=False, **kwargs)


def moe_experts(model):
    return [b.mlp.experts for b in model.blocks if b.is_moe]


@pytest.fixture
def counted(monkeypatch):
    """Counts every call of the resolver, wherever it is looked up from, and records the executor each
    routed_experts call is given."""
    calls = {"resolve": 0, "executors": []}
    real_resolve, real_routed = kernel_experts.resolve_backend, moe.routed_experts

    def resolve(*args, **kwargs):
        calls["resolve"] += 1
        return real_resolve(*args, **kwargs)

    def routed(*args):
        calls["executors"].append(args[7])
        return real_routed(*args)

    monkeypatch.setattr(kernel_experts, "resolve_backend", resolve)
    monkeypatch.setattr(moe, "resolve_backend", resolve)
    monkeypatch.setattr(moe, "routed_experts", routed)
    return calls


def test_resolved_at_set_and_move_time_not_per_forward(qwen_folder, counted):
    model = load(qwen_folder)
    n_layers = len(moe_experts(model))
    assert counted["resolve"] >= n_layers  # resolved while loading
    counted["resolve"] = 0
    for _ in range(3):
        model(TOKENS)
    assert counted["resolve"] == 0
    assert counted["executors"] == ["torch"] * 3 * n_layers  # concrete, never "auto"
    model.set_experts_backend("torch")
    assert counted["resolve"] > 0
    counted["resolve"] = 0
    model.to(torch.float64)  # a move (here of dtype only) resolves again, once per layer before and after
    assert counted["resolve"] == 2 * n_layers
    model.to("meta")
    assert {e.resolved_for for e in moe_experts(model)} == {torch.device("meta")}


def test_what_was_asked_and_what_runs_are_both_visible(qwen_folder):
    model = load(qwen_folder)
    experts = model.blocks[0].mlp.experts
    assert (experts.backend, experts.executor, experts.resolved_for) == ("auto", "torch", torch.device("cpu"))
    assert "backend=auto (torch)" in repr(experts)
    model.set_experts_backend("torch")
    assert "backend=torch (torch)" in repr(experts)


def test_triton_on_cpu_without_interpreter_is_refused_at_set_time(qwen_folder, monkeypatch):
    pytest.importorskip("triton")
    model = load(qwen_folder)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    message = r"experts_backend='triton' runs on CUDA devices \(or on CPU with TRITON_INTERPRET=1\); the experts are on cpu"
    with pytest.raises(RuntimeError, match=message):
        model.set_experts_backend("triton")
    assert {(e.backend, e.executor) for e in moe_experts(model)} == {("auto", "torch")}  # no layer changed
    with pytest.raises(RuntimeError, match=message):
        moe_experts(model)[0].backend = "triton"  # one layer's setter checks too
    with pytest.raises(RuntimeError, match=message):
        load(qwen_folder, experts_backend="triton")


def test_a_move_where_the_backend_cannot_run_is_refused_before_anything_moves(qwen_folder, monkeypatch):
    pytest.importorskip("triton")
    model = load(qwen_folder)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model.set_experts_backend("triton")
    assert {e.executor for e in moe_experts(model)} == {"triton"}
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match=r"experts_backend='triton' runs on CUDA devices"):
        model.to(torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # not one parameter was converted


def test_auto_takes_triton_only_for_experts_the_kernels_compute_on_verified_archs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(kernel_experts.VERIFIED_TRITON_ARCHS, (9, 0), "test entry")
    monkeypatch.setattr(kernel_experts, "triton_available", lambda: True)
    cuda = torch.device("cuda", 0)
    silu, gelu = ExpertSpec(8, 16, 16), ExpertSpec(8, 16, 16, GLU("gelu"))
    assert kernel_experts.resolve_backend("auto", cuda, silu) == "triton"
    assert kernel_experts.resolve_backend("auto", cuda, gelu) == "torch"
    assert kernel_experts.resolve_backend("auto", torch.device("cpu"), silu) == "torch"
    with pytest.raises(ValueError, match=r"experts_backend='triton' computes SiLU\(gate\) \* up"):
        kernel_experts.resolve_backend("triton", cuda, gelu)
    with pytest.raises(ValueError, match=r"experts_backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"):
        kernel_experts.resolve_backend("cuda", cuda, silu)


def test_an_input_on_another_device_is_an_error_not_a_silent_path(qwen_folder):
    model = load(qwen_folder)
    experts = model.blocks[0].mlp.experts
    hooks = model.blocks[0].mlp._expert_hooks
    x = torch.zeros(3, model.cfg.d_model, device="meta")
    idx, w = torch.zeros(3, 2, dtype=torch.long, device="meta"), torch.ones(3, 2, device="meta")
    with pytest.raises(RuntimeError, match=r"blocks\.0\.mlp\.experts: experts_backend='auto' was resolved to 'torch' for "
                       r"experts on cpu, but the input is on meta"):
        experts(x, idx, w, hooks, (1, 3))


def test_hook_tensors_do_not_depend_on_when_the_backend_was_resolved(qwen_folder):
    """auto (torch on this CPU) and torch, set at load or afterwards, and after a round trip through another
    dtype: every cached hook tensor the same bits."""
    reference = load(qwen_folder, experts_backend="torch")
    logits, cache = reference.run_with_cache(TOKENS)
    model = load(qwen_folder)
    model.to(torch.float64).to(torch.float32)
    for backend in ("auto", "torch"):
        model.set_experts_backend(backend)
        got_logits, got = model.run_with_cache(TOKENS)
        assert torch.equal(got_logits, logits)
        assert [n for n in cache.keys() if not torch.equal(got[n], cache[n])] == []


def test_offloaded_experts_resolve_for_their_store(qwen_folder, counted):
    model = load(qwen_folder, expert_offload="cpu", expert_cache_bytes=0)
    assert {(e.executor, e.resolved_for) for e in moe_experts(model)} == {("torch", torch.device("cpu"))}
    counted["resolve"] = 0
    reference = load(qwen_folder)
    counted["resolve"] = 0
    assert torch.equal(model(TOKENS), reference(TOKENS))
    assert counted["resolve"] == 0


def test_experts_resolved_before_placement_resolve_once_placed(qwen_folder, counted):
    """Built on meta and given storage in place (as a load materializes parameters, without model.to()): the
    first forward resolves for where the experts now are, once; later forwards look nothing up."""
    model = load(qwen_folder)
    reference = model(TOKENS)
    experts = moe_experts(model)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    meta = model.to("meta")
    assert {e.resolved_for for e in experts} == {torch.device("meta")}
    meta.load_state_dict(state, assign=True)  # storage assigned, no _apply
    counted["resolve"] = 0
    assert torch.equal(meta(TOKENS), reference)
    assert counted["resolve"] == len(experts) and {e.resolved_for for e in experts} == {torch.device("cpu")}
    meta(TOKENS)
    assert counted["resolve"] == len(experts)
