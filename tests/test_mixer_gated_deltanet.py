"""The Gated DeltaNet mixer (moelens.models.mixers.gated_deltanet) against transformers' Qwen3NextGatedDeltaNet
(fused, head-grouped projections) and Qwen3_5MoeGatedDeltaNet (separate projections) on the same random
weights: outputs, every hook site and the cached state, uncached and cached (prefill, decode steps, a
multi-token continuation), float32 and bfloat16, a left-padded batch of 2 over 100 positions (more than one
chunk of 64); a float64 hand-written reference; state edits; in-place hook edits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as hf_qwen3_5
import transformers.models.qwen3_next.modeling_qwen3_next as hf_qwen3_next
from torch import nn
from transformers import DynamicCache, Qwen3NextConfig
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from moelens.hook_points import HookedRootModule
from moelens.hooks.sites import SITES
from moelens.models.context import LayerInputs
from moelens.models.mixers.gated_deltanet import (
    FusedProjectionsGatedDeltaNet,
    GatedDeltaNetSizes,
    SeparateProjectionsGatedDeltaNet,
)
from moelens.models.mixers.gated_norm import GatedRMSNorm
from moelens.state import KVState, RecurrentState

D_MODEL, K_HEADS, V_HEADS, D_K, D_V, KERNEL, EPS = 64, 2, 4, 16, 8, 4, 1e-6
SIZES = GatedDeltaNetSizes(D_MODEL, K_HEADS, V_HEADS, D_K, D_V, KERNEL, EPS)
HF_SIZES = dict(hidden_size=D_MODEL, linear_num_key_heads=K_HEADS, linear_num_value_heads=V_HEADS,
                linear_key_head_dim=D_K, linear_value_head_dim=D_V, linear_conv_kernel_dim=KERNEL, rms_norm_eps=EPS,
                num_hidden_layers=1, layer_types=["linear_attention"])
BATCH, POS, PADS = 2, 100, 7  # row 1 is left-padded by PADS
# family -> (transformers' config class, its module class, its modeling module, moelens's class)
FAMILIES = {
    "qwen3_next": (Qwen3NextConfig, hf_qwen3_next.Qwen3NextGatedDeltaNet, hf_qwen3_next, FusedProjectionsGatedDeltaNet),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, hf_qwen3_5.Qwen3_5MoeGatedDeltaNet, hf_qwen3_5, SeparateProjectionsGatedDeltaNet),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the mixer's sites (each a blocks.L.mixer.* row of the table, in its default form; Mamba-2 shares some rows)
SITE_TAILS = ["hook_q", "hook_k", "hook_v", "hook_gate", "hook_beta", "hook_log_decay", "hook_state_in", "hook_core_out",
              "hook_state_out", "hook_z"]
CASES = [(f, d) for f in FAMILIES for d in DTYPES]


class OneMixer(HookedRootModule):
    """The mixer as block 0 of a hooked root, so its hook points are named blocks.0.mixer.*."""

    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].mixer = mixer
        self.setup()

    @property
    def mixer(self) -> nn.Module:
        return self.blocks[0].mixer

    def forward(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        return self.mixer(x, inputs)


def build(family: str, dtype: torch.dtype, seed: int = 0):
    """(transformers' config, its module, moelens's mixer in a OneMixer) with the same random weights."""
    config_cls, hf_cls, _, ours_cls = FAMILIES[family]
    config = config_cls(**HF_SIZES)
    torch.manual_seed(seed)
    ref = hf_cls(config, 0)  # A_log keeps transformers' random init (log of uniform(0.01, 16))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name == "norm.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name != "A_log":
                p.normal_(0, 0.3)
    ours = ours_cls(SIZES, 0)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return config, ref.to(dtype), OneMixer(ours.to(dtype))


def stream(dtype: torch.dtype, seed: int = 1, pos: int = POS) -> tuple[torch.Tensor, torch.Tensor]:
    """A normed-stream input [BATCH pos D_MODEL] and its mask (row 1 left-padded by PADS)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, pos, D_MODEL, generator=g).to(dtype)
    mask = torch.ones(BATCH, pos, dtype=torch.long)
    mask[1, :PADS] = 0
    return x, mask


def layer_inputs(mask: torch.Tensor | None, n_pos: int, state: RecurrentState | None = None) -> LayerInputs:
    """What the model would hand the mixer (it reads only mask and state)."""
    batch = BATCH if mask is None else mask.shape[0]
    return LayerInputs(positions=torch.arange(n_pos).expand(batch, n_pos), cos=None, sin=None,
                       allowed=torch.ones(batch, 1, n_pos, n_pos, dtype=torch.bool), mask=mask, state=state)


def run_ours(model: OneMixer, x, mask, state=None, hooks=()) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output and a copy of every site's tensor."""
    seen: dict[str, torch.Tensor] = {}

    def keep(t, hook):
        seen[hook.name.rsplit(".", 1)[-1]] = t.detach().clone()

    capture = [(f"blocks.0.mixer.{tail}", keep) for tail in SITE_TAILS]
    with torch.no_grad():
        out = model.run_with_hooks(x, layer_inputs(mask, x.shape[1], state), fwd_hooks=[*hooks, *capture])
    return out, seen


class TransformersRecorder:
    """transformers' intermediates: what its module hands the delta rule (q, k, v, g, beta, initial state) and
    gets back (read-out, final state), and its gated norm's inputs and output."""

    def __init__(self, monkeypatch, family: str, ref: nn.Module) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []
        module = FAMILIES[family][2]
        for fn_name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
            monkeypatch.setattr(module, fn_name, self._spy(getattr(module, fn_name)))
        ref.norm.register_forward_hook(self._norm_hook)

    def _spy(self, fn):
        def spied(query, key, value, g, beta, initial_state=None, **kwargs):
            out, final = fn(query, key, value, g=g, beta=beta, initial_state=initial_state, **kwargs)
            self.calls.append(dict(
                hook_q=query, hook_k=key, hook_v=value, hook_log_decay=g, hook_beta=beta, hook_core_out=out,
                hook_state_in=None if initial_state is None else initial_state.clone(),
                hook_state_out=None if final is None else final.clone(),
            ))
            return out, final
        return spied

    def _norm_hook(self, module, args, output):
        core, gate = args
        shape = self.calls[-1]["hook_core_out"].shape
        self.calls[-1].update(hook_gate=gate.reshape(shape), hook_z=output.reshape(shape), norm_input=core.reshape(shape))


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, (what, ours.shape, theirs.shape, ours.dtype, theirs.dtype)
    assert torch.equal(ours, theirs), f"{what}: max difference {(ours.float() - theirs.float()).abs().max().item():.3g}"


def assert_sites_equal(seen: dict[str, torch.Tensor], call: dict[str, torch.Tensor], what: str) -> None:
    for tail in SITE_TAILS:
        theirs = call[tail]
        if theirs is None:  # transformers starts from zeros without a cached state, and hands no final state on
            assert tail in ("hook_state_in", "hook_state_out"), tail
            if tail == "hook_state_in":
                assert not seen[tail].any(), f"{what}: hook_state_in without a cached state should be zeros"
            continue
        assert_same(seen[tail], theirs, f"{what}: {tail}")
    assert torch.equal(call["norm_input"], call["hook_core_out"])  # transformers norms the rule's read-out as it is


# ---- equality with transformers ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_matches_transformers(dtype):
    torch.manual_seed(0)
    theirs = hf_qwen3_next.Qwen3NextRMSNormGated(D_V, eps=EPS)
    ours = GatedRMSNorm(D_V, EPS)
    with torch.no_grad():
        theirs.weight.normal_(1, 0.3)
    ours.load_state_dict(theirs.state_dict())
    x, gate = torch.randn(2, 100, D_V).to(DTYPES[dtype]), torch.randn(2, 100, D_V).to(DTYPES[dtype])
    ours, theirs = ours.to(DTYPES[dtype]), theirs.to(DTYPES[dtype])
    assert_same(ours(x, gate), theirs(x.reshape(-1, D_V), gate.reshape(-1, D_V)).reshape(2, 100, D_V), "gated norm")
    with pytest.raises(ValueError, match="gate shape"):
        ours(x, gate[:, :3])


@pytest.mark.parametrize("family,dtype", CASES)
def test_uncached_forward_and_every_site_match_transformers(monkeypatch, family, dtype):
    """A left-padded batch over 100 positions (two chunks) without a cache: output and every site bit for bit."""
    _, ref, model = build(family, DTYPES[dtype])
    recorder = TransformersRecorder(monkeypatch, family, ref)
    x, mask = stream(DTYPES[dtype])
    with torch.no_grad():
        theirs = ref(x, attention_mask=mask)
    ours, seen = run_ours(model, x, mask)
    assert_same(ours, theirs, "output")
    assert len(recorder.calls) == 1
    assert_sites_equal(seen, recorder.calls[0], "uncached")


@pytest.mark.parametrize("family,dtype", CASES)
def test_cached_prefill_decode_and_continuation_match_transformers(monkeypatch, family, dtype):
    """With a cache: a left-padded prefill of 67, three one-token decode steps (the recurrent form), then a
    continuation of 30 tokens (the chunked form from the cached state and convolution window). Each output,
    each site (state_in / state_out included) and the cached tensors equal transformers' bit for bit."""
    config, ref, model = build(family, DTYPES[dtype])
    recorder = TransformersRecorder(monkeypatch, family, ref)
    x, mask = stream(DTYPES[dtype])
    cache, state = DynamicCache(config=config), model.mixer.new_state()
    spans = [(0, 67), (67, 68), (68, 69), (69, 70), (70, POS)]
    for i, (start, stop) in enumerate(spans):
        piece, piece_mask = x[:, start:stop], (mask[:, start:stop] if start == 0 else None)
        with torch.no_grad():
            theirs = ref(piece, cache=cache, attention_mask=piece_mask)
        ours, seen = run_ours(model, piece, piece_mask, state)
        what = f"positions {start}:{stop}"
        assert_same(ours, theirs, what)
        assert_sites_equal(seen, recorder.calls[i], what)
        layer = cache.layers[0]
        assert_same(state.recurrent, layer.recurrent_states[0], f"{what}: cached recurrent state")
        assert_same(state.conv, layer.conv_states[0], f"{what}: cached convolution window")
        assert state.length == stop
    assert state.recurrent.dtype == torch.float32 and state.conv.dtype == DTYPES[dtype]


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_transformers(family):
    _, ref, model = build(family, torch.float32)
    x, mask = stream(torch.float32)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = torch.randn(BATCH, POS, D_MODEL, generator=torch.Generator().manual_seed(5))
    (model(x_ours, layer_inputs(mask, POS)) * weights).sum().backward()
    (ref(x_theirs, attention_mask=mask) * weights).sum().backward()
    assert_same(x_ours.grad, x_theirs.grad, "input gradient")
    for name, p in ref.named_parameters():
        assert_same(model.mixer.get_parameter(name).grad, p.grad, f"{name} gradient")


# ---- float64 reference -------------------------------------------------------------------------------------
def reference_float64(mixer: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixer from its definition, token by token in float64 (the chunked algorithm nowhere): its output
    and the read-out before the gated norm."""
    w = {name: p.detach().double() for name, p in mixer.named_parameters()}
    x = x.double() * mask[:, :, None]
    b_, n_pos, _ = x.shape
    group = V_HEADS // K_HEADS
    if "in_proj_qkvz.weight" in w:  # rows grouped per key head: [q | k | v of its value heads | z of its value heads]
        qkvz = (x @ w["in_proj_qkvz.weight"].T).view(b_, n_pos, K_HEADS, -1)
        q, k = qkvz[..., :D_K], qkvz[..., D_K:2 * D_K]
        v = qkvz[..., 2 * D_K:2 * D_K + group * D_V].reshape(b_, n_pos, V_HEADS, D_V)
        z = qkvz[..., 2 * D_K + group * D_V:].reshape(b_, n_pos, V_HEADS, D_V)
        ba = (x @ w["in_proj_ba.weight"].T).view(b_, n_pos, K_HEADS, 2 * group)
        b, a = ba[..., :group].reshape(b_, n_pos, V_HEADS), ba[..., group:].reshape(b_, n_pos, V_HEADS)
        mixed = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)
    else:
        mixed = x @ w["in_proj_qkv.weight"].T
        z = (x @ w["in_proj_z.weight"].T).view(b_, n_pos, V_HEADS, D_V)
        b, a = x @ w["in_proj_b.weight"].T, x @ w["in_proj_a.weight"].T
    conv_w = w["conv1d.weight"][:, 0]  # [channel kernel]: out[t] = sum_j w[j] * in[t - (KERNEL - 1) + j]
    padded = F.pad(mixed, (0, 0, KERNEL - 1, 0))
    conv = sum(conv_w[:, j] * padded[:, j:j + n_pos] for j in range(KERNEL))
    conv = conv * torch.sigmoid(conv)
    q = conv[..., :K_HEADS * D_K].reshape(b_, n_pos, K_HEADS, D_K)
    k = conv[..., K_HEADS * D_K:2 * K_HEADS * D_K].reshape(b_, n_pos, K_HEADS, D_K)
    v = conv[..., 2 * K_HEADS * D_K:].reshape(b_, n_pos, V_HEADS, D_V)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / D_K**0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(b)
    decay = torch.exp(-torch.exp(w["A_log"]) * F.softplus(a + w["dt_bias"]))
    state = torch.zeros(b_, V_HEADS, D_K, D_V, dtype=torch.float64)
    out = torch.zeros(b_, n_pos, V_HEADS, D_V, dtype=torch.float64)
    for t in range(n_pos):
        for h in range(V_HEADS):
            kh = h // group  # value head h reads key head h // group
            s = state[:, h] * decay[:, t, h, None, None]
            kt, qt = k[:, t, kh], q[:, t, kh]
            error = v[:, t, h] - torch.einsum("bkv,bk->bv", s, kt)
            state[:, h] = s + beta[:, t, h, None, None] * kt[:, :, None] * error[:, None, :]
            out[:, t, h] = torch.einsum("bkv,bk->bv", state[:, h], qt)
    normed = out / torch.sqrt(out.pow(2).mean(-1, keepdim=True) + EPS) * w["norm.weight"]
    gated = normed * z * torch.sigmoid(z)
    return gated.reshape(b_, n_pos, -1) @ w["out_proj.weight"].T, out


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_is_within_1e_5_of_a_float64_reference(family):
    """Relative to the output's largest value (measured: 6e-6 Qwen3-Next, 4e-6 Qwen3.5). The chunked form's
    float32 error, which transformers' output has bit for bit (tests above): within a chunk it takes
    differences of cumulative log decays that reach hundreds with transformers' A_log init, and the gated norm
    scales the read-out's error up by the read-out's small RMS."""
    _, ref, model = build(family, torch.float32)
    x, mask = stream(torch.float32)
    expected, _ = reference_float64(model.mixer, x, mask)
    with torch.no_grad():
        ours = model(x, layer_inputs(mask, POS)).double()
    scale = expected.abs().max().item()
    assert scale > 1
    assert (ours - expected).abs().max().item() <= 1e-5 * scale


# ---- cached forms against the uncached one ---------------------------------------------------------------
# Relative to the output's largest value. The forms and the chunks' placement differ by rounding alone: in
# float32 each is within 1e-5 of the float64 reference (test above); in bfloat16 by at most one bfloat16 step
# (2^-8) of the largest output (measured: 3.7e-6 float32; 1.9e-4 and 0 bfloat16).
NOISE = {"float32": 1e-5, "bfloat16": 2**-8}


@pytest.mark.parametrize("family,dtype", CASES)
def test_prefill_then_decode_equals_one_forward(family, dtype):
    _, _, model = build(family, DTYPES[dtype])
    x, mask = stream(DTYPES[dtype])
    with torch.no_grad():
        whole = model(x, layer_inputs(mask, POS))
        state = model.mixer.new_state()
        pieces = [model(x[:, :70], layer_inputs(mask[:, :70], 70, state))]
        pieces += [model(x[:, t:t + 1], layer_inputs(None, 1, state)) for t in range(70, 80)]
        pieces.append(model(x[:, 80:], layer_inputs(None, POS - 80, state)))
    difference = (torch.cat(pieces, 1).float() - whole.float()).abs().max().item()
    assert difference <= NOISE[dtype] * whole.float().abs().max().item()


def test_left_padding_gives_each_row_what_it_gets_alone():
    """The padded row's real tokens get what they get alone (up to the chunks' rounding), its padding outputs
    are zero, and its state after the prefill is the one of the row alone."""
    _, _, model = build("qwen3_next", torch.float32)
    x, mask = stream(torch.float32)
    with torch.no_grad():
        batched_state, alone_state = model.mixer.new_state(), model.mixer.new_state()
        batched = model(x, layer_inputs(mask, POS, batched_state))
        alone = model(x[1:, PADS:], layer_inputs(None, POS - PADS, alone_state))
    assert not batched[1, :PADS].any()
    scale = alone.abs().max().item()
    assert (batched[1, PADS:] - alone[0]).abs().max().item() <= NOISE["float32"] * scale
    state_scale = alone_state.recurrent.abs().max().item()
    assert (batched_state.recurrent[1] - alone_state.recurrent[0]).abs().max().item() <= NOISE["float32"] * state_scale
    assert torch.equal(batched_state.conv[1], alone_state.conv[0])


# ---- the state as a site ------------------------------------------------------------------------------------
def test_an_edit_of_state_out_acts_as_a_forward_from_the_edited_state():
    """Adding a matrix to the state written by the prefill changes every later token exactly as decoding from a
    cache whose state was replaced by the edited one; the prefill's own outputs do not move."""
    _, _, model = build("qwen3_next", torch.float32)
    x, mask = stream(torch.float32)
    delta = torch.randn(BATCH, V_HEADS, D_K, D_V, generator=torch.Generator().manual_seed(9))

    def decode(state):
        with torch.no_grad():
            return torch.cat([model(x[:, t:t + 1], layer_inputs(None, 1, state)) for t in range(70, 76)]
                             + [model(x[:, 76:], layer_inputs(None, POS - 76, state))], 1)

    edited_state, replaced_state = model.mixer.new_state(), model.mixer.new_state()
    edit = ("blocks.0.mixer.hook_state_out", lambda s, hook: s + delta)
    edited_prefill, _ = run_ours(model, x[:, :70], mask[:, :70], edited_state, hooks=[edit])
    plain_prefill, _ = run_ours(model, x[:, :70], mask[:, :70], replaced_state)
    assert torch.equal(edited_prefill, plain_prefill)
    replaced_state.recurrent = replaced_state.recurrent + delta
    edited, replaced, unedited = decode(edited_state), decode(replaced_state), None
    assert torch.equal(edited, replaced)
    plain_state = model.mixer.new_state()
    run_ours(model, x[:, :70], mask[:, :70], plain_state)
    unedited = decode(plain_state)
    assert (edited - unedited).abs().max() > 1e-3  # the edit does change the later tokens


@pytest.mark.parametrize("n_new", [1, 27], ids=["decode_step", "continuation"])
def test_an_edit_of_state_in_acts_as_a_forward_from_the_edited_state(n_new):
    """Replacing the state a forward starts from equals a forward from a cache holding that state; an in-place
    edit there leaves the cache's tensor (and so a snapshot) untouched."""
    _, _, model = build("qwen3_5_moe", torch.float32)
    x, mask = stream(torch.float32)
    prefilled = model.mixer.new_state()
    run_ours(model, x[:, :70], mask[:, :70], prefilled)
    snapshot = prefilled.snapshot()
    held = prefilled.recurrent.clone()
    new = x[:, 70:70 + n_new]
    scale = torch.linspace(0.5, 1.5, D_K)[:, None]

    hooked, replaced = RecurrentState(), RecurrentState()
    hooked.update(prefilled.conv, prefilled.recurrent, 70)
    replaced.update(prefilled.conv, prefilled.recurrent * scale, 70)
    out_hooked, _ = run_ours(model, new, None, hooked, hooks=[("blocks.0.mixer.hook_state_in", lambda s, hook: s.mul_(scale))])
    out_replaced, _ = run_ours(model, new, None, replaced)
    assert torch.equal(out_hooked, out_replaced)
    assert torch.equal(hooked.recurrent, replaced.recurrent)
    assert torch.equal(prefilled.recurrent, held) and snapshot[1] is prefilled.recurrent
    out_plain, _ = run_ours(model, new, None, prefilled)
    assert (out_hooked - out_plain).abs().max() > 1e-3


# ---- in-place edits ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tail", SITE_TAILS)
def test_an_in_place_edit_equals_the_returned_edit(family, tail):
    """On every site, through a prefill and a decode step (both forms): the output and the cached state."""
    _, _, model = build(family, torch.float32)
    x, mask = stream(torch.float32)
    factor = 0.75

    def run(hook):
        state = model.mixer.new_state()
        hooks = [] if hook is None else [(f"blocks.0.mixer.{tail}", hook)]
        first, _ = run_ours(model, x[:, :70], mask[:, :70], state, hooks)
        second, _ = run_ours(model, x[:, 70:71], None, state, hooks)
        return torch.cat([first, second], 1), state.recurrent, state.conv

    in_place = run(lambda t, hook: t.mul_(factor))
    returned = run(lambda t, hook: t * factor)
    plain = run(None)
    for a, b in zip(in_place, returned):
        assert torch.equal(a, b), tail
    assert not torch.equal(in_place[0], plain[0]) or not torch.equal(in_place[1], plain[1]), f"{tail}: the edit changed nothing"


# ---- sites, protocol, errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_every_mixer_site_of_the_table_is_built_with_its_layout_and_meaning(family):
    """Every blocks.L.mixer.* row of the table is a hook point of the mixer with the row's layout and meaning,
    and the tensor it holds has the layout's shape (the checks tests/test_hook_sites.py leaves to this file)."""
    _, _, model = build(family, torch.float32)
    mixer_rows = {s.name: s.forms["default"] for s in SITES if s.name.rsplit(".", 1)[-1] in SITE_TAILS
                  and s.name.startswith("blocks.L.mixer.")}
    assert len(mixer_rows) == len(SITE_TAILS)
    points = {name.replace("blocks.0.", "blocks.L."): hp for name, hp in model.hook_dict.items()}
    assert set(points) == set(mixer_rows)
    for name, form in mixer_rows.items():
        assert (points[name].layout, points[name].meaning) == (form.layout, form.meaning), name
    x, mask = stream(torch.float32)
    _, seen = run_ours(model, x, mask, model.mixer.new_state())
    sizes = {"batch": BATCH, "pos": POS, "k_head": K_HEADS, "v_head": V_HEADS, "d_k": D_K, "d_v": D_V}
    for name, form in mixer_rows.items():
        tail = name.rsplit(".", 1)[-1]
        assert tuple(seen[tail].shape) == tuple(sizes[a] for a in form.layout.split()), name
    assert seen["hook_log_decay"].dtype == seen["hook_state_in"].dtype == seen["hook_state_out"].dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_mixer_protocol(dtype):
    _, _, model = build("qwen3_next", DTYPES[dtype])
    mixer = model.mixer
    assert type(mixer).block_attribute == "mixer"
    assert [p.weight.shape[1] for p in mixer.input_projections()] == [D_MODEL, D_MODEL]
    separate = SeparateProjectionsGatedDeltaNet(SIZES, 0)
    assert {id(p) for p in separate.input_projections()} == {
        id(separate.in_proj_qkv), id(separate.in_proj_z), id(separate.in_proj_b), id(separate.in_proj_a)}
    state = mixer.new_state(reserve=1000)
    assert isinstance(state, RecurrentState) and state.nbytes == 0
    x, mask = stream(DTYPES[dtype])
    with torch.no_grad():
        model(x, layer_inputs(mask, POS, state))
    values = type(mixer).state_bytes(SIZES)
    assert values.per_token == 0
    conv_values = (2 * K_HEADS * D_K + V_HEADS * D_V) * KERNEL
    recurrent_values = V_HEADS * D_K * D_V
    assert values.per_sequence == conv_values + recurrent_values
    element = torch.finfo(DTYPES[dtype]).bits // 8
    assert state.nbytes == BATCH * (conv_values * element + recurrent_values * 4)


def test_bad_configs_and_inputs_are_refused():
    with pytest.raises(ValueError, match="linear_n_value_heads \\(3\\) must be a multiple of linear_n_key_heads \\(2\\)"):
        FusedProjectionsGatedDeltaNet(GatedDeltaNetSizes(D_MODEL, 2, 3, D_K, D_V, KERNEL, EPS), 0)
    with pytest.raises(ValueError, match="act_fn.*gelu"):
        FusedProjectionsGatedDeltaNet(GatedDeltaNetSizes(D_MODEL, 2, 4, D_K, D_V, KERNEL, EPS, act_fn="gelu"), 0)
    with pytest.raises(AttributeError, match="lacks.*linear_conv_kernel"):
        SeparateProjectionsGatedDeltaNet(object(), 0)
    _, _, model = build("qwen3_next", torch.float32)
    x, mask = stream(torch.float32)
    with pytest.raises(ValueError, match="expected \\[batch pos d_model=64\\]"):
        model(x[..., :32], layer_inputs(mask, POS))
    with pytest.raises(ValueError, match="at least one position"):
        model(x[:, :0], layer_inputs(None, 0))
    with pytest.raises(ValueError, match="inputs.mask of shape \\(2, 99\\)"):
        model(x, layer_inputs(mask[:, 1:], POS))
    with pytest.raises(TypeError, match="inputs.state is a KVState"):
        model(x, layer_inputs(mask, POS, KVState()))
    state = model.mixer.new_state()
    with torch.no_grad():
        model(x, layer_inputs(mask, POS, state))
    with pytest.raises(ValueError, match="cached state.conv has shape \\(2, 96, 4\\), expected \\(1, 96, 4\\)"):
        model(x[:1, :1], LayerInputs(torch.zeros(1, 1, dtype=torch.long), None, None,
                                     torch.ones(1, 1, 1, 1, dtype=torch.bool), None, state))
