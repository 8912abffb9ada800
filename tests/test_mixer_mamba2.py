"""The Mamba-2 mixer (moelens.models.mixers.mamba2) against transformers' NemotronHMamba2Mixer on its torch
path (same random weights): the output and every hook site bit for bit, float32 and bfloat16, a left-padded batch of 2,
100 positions in chunks of 16; a prefill then decode steps and a multi-token continuation against
transformers' cache path; the scan against a hand-written float64 recurrence; prefill + decode against one
forward; left padding against the row alone; edits of the state sites; in-place against returned edits on
every site; the sites against the table; bad inputs."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite
from transformers.models.granitemoehybrid.configuration_granitemoehybrid import GraniteMoeHybridConfig
from transformers.models.nemotron_h import modeling_nemotron_h as hf
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

from moelens.hooks import HookedRootModule
from moelens.hooks.sites import SITES, site_form, table_name
from moelens.models.context import LayerInputs
from moelens.models.mixers.mamba2 import Mamba2Config, Mamba2Mixer
from moelens.state import RecurrentState

D_MODEL, HEADS, D_HEAD, GROUPS, D_STATE, D_CONV, CHUNK = 32, 8, 4, 2, 6, 4, 16
BATCH, LENGTH, PADS = 2, 100, 9  # row 1 is left-padded by PADS; 100 positions = 7 chunks of 16 (the last partial)
SITE_NAMES = ["hook_gate", "hook_x", "hook_B", "hook_C", "hook_dt", "hook_state_in", "hook_y", "hook_state_out",
              "hook_normed"]


def hf_config(**overrides) -> NemotronHConfig:
    sizes = dict(hidden_size=D_MODEL, mamba_num_heads=HEADS, mamba_head_dim=D_HEAD, n_groups=GROUPS,
                 ssm_state_size=D_STATE, conv_kernel=D_CONV, chunk_size=CHUNK, layers_block_type=["mamba"],
                 num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
    return NemotronHConfig(**(sizes | overrides))


def mixer_config(hc: NemotronHConfig, **overrides) -> Mamba2Config:
    """What the Nemotron-H family reads: transformers 5.24 clamps dt to (time_step_min, inf) in the chunked
    form and not at all in the decode step."""
    fields = dict(
        d_model=hc.hidden_size, mamba_n_heads=hc.mamba_num_heads, mamba_d_head=hc.mamba_head_dim,
        mamba_n_groups=hc.n_groups, mamba_d_state=hc.ssm_state_size, mamba_d_conv=hc.conv_kernel,
        mamba_chunk_size=hc.chunk_size, mamba_conv_bias=hc.use_conv_bias, mamba_proj_bias=hc.use_bias,
        mamba_norm_eps=hc.layer_norm_epsilon, mamba_time_step_limit=(hc.time_step_min, math.inf),
        mamba_decode_time_step_limit=(0.0, math.inf),
    )
    return Mamba2Config(**(fields | overrides))


def random_reference(seed: int = 0, **overrides) -> hf.NemotronHMamba2Mixer:
    """transformers' mixer with random weights; dt_bias spread so that softplus(dt + dt_bias) falls below
    time_step_min (the clamp bites) on some heads and is large on others."""
    torch.manual_seed(seed)
    ref = hf.NemotronHMamba2Mixer(hf_config(**overrides), layer_idx=0).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name.endswith("weight") else 0.5))
        ref.A_log.copy_(torch.empty(HEADS).uniform_(math.log(0.5), math.log(8.0)))
        ref.dt_bias.copy_(torch.linspace(-8.0, 1.0, HEADS))
        ref.D.copy_(torch.randn(HEADS))
        ref.norm.weight.copy_(1 + 0.2 * torch.randn(HEADS * D_HEAD))
    return ref


def copy_of(ref: hf.NemotronHMamba2Mixer, **overrides) -> Mamba2Mixer:
    mixer = Mamba2Mixer(mixer_config(ref.config, **overrides), layer=0)
    missing, unexpected = mixer.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected
    return mixer.to(ref.dt_bias.dtype)


class Root(HookedRootModule):
    """The mixer as block 0's `mixer`, so its hook points have their model names (blocks.0.mixer.hook_x)."""

    def __init__(self, mixer: Mamba2Mixer) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].mixer = mixer
        self.setup()

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, state: RecurrentState | None = None):
        b, t, _ = x.shape
        inputs = LayerInputs(positions=torch.zeros(b, t, dtype=torch.long), cos=None, sin=None,
                             allowed=torch.ones(b, 1, t, t, dtype=torch.bool), mask=mask, state=state)
        return self.blocks[0].mixer(x, inputs)


def padding_mask(length: int = LENGTH) -> torch.Tensor:
    mask = torch.ones(BATCH, length, dtype=torch.long)
    mask[1, :PADS] = 0
    return mask


def stream(length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(BATCH, length, D_MODEL, generator=torch.Generator().manual_seed(seed)).to(dtype)


def run_caching(root: Root, *args) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output and every mixer site (named by its tail, hook_x, ...)."""
    seen: dict[str, torch.Tensor] = {}

    def keep(t, hook):
        seen[hook.name.rsplit(".", 1)[-1]] = t.clone()

    with root.hooks(fwd_hooks=[(lambda name: True, keep)]):
        out = root(*args)
    return out, seen


class Recorder:
    """transformers' intermediates of one forward, in moelens's site layouts: the torch scan functions are
    wrapped (their inputs are x, B, C and the state read; their outputs y and the state written), in_proj's
    output gives the gate and out_proj's input the normed sites. dt is transformers' own arguments through
    its own formula: softplus(dt + dt_bias), clamped to dt_limit (the decode step has none)."""

    def __init__(self, ref: hf.NemotronHMamba2Mixer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sites: dict[str, torch.Tensor] = {}
        self.calls: list[str] = []
        chunk_scan, state_update = hf.mamba2_chunk_scan, hf.mamba2_selective_state_update
        inner = HEADS * D_HEAD

        def chunk_wrapper(x, dt, A, B, C, chunk_size, **kw):
            self.calls.append("chunk")
            y, final = chunk_scan(x, dt, A, B, C, chunk_size, **(kw | {"return_final_states": True}))
            dt_used = torch.clamp(torch.nn.functional.softplus(dt + kw["dt_bias"].to(dt.dtype)), *kw["dt_limit"])
            initial = kw["initial_states"]
            self.sites |= dict(hook_x=x, hook_B=B, hook_C=C, hook_dt=dt_used, hook_y=y, hook_state_out=final,
                               hook_state_in=torch.zeros_like(final) if initial is None else initial.clone())
            return (y, final) if kw.get("return_final_states") else y

        def step_wrapper(state, x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, **kw):
            self.calls.append("step")
            assert dt_softplus and "dt_limit" not in kw  # the decode step does not clamp
            state_in = state.clone()
            y = state_update(state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus, **kw)
            self.sites |= dict(hook_x=x[:, None], hook_B=B[:, None], hook_C=C[:, None],
                               hook_dt=torch.nn.functional.softplus(dt + dt_bias)[:, None, :, 0], hook_y=y[:, None],
                               hook_state_in=state_in, hook_state_out=state.clone())
            return y

        monkeypatch.setattr(hf, "mamba2_chunk_scan", chunk_wrapper)
        monkeypatch.setattr(hf, "mamba2_selective_state_update", step_wrapper)

        def gate(module, args, out):
            self.sites["hook_gate"] = out[..., :inner].unflatten(-1, (HEADS, D_HEAD))

        def normed(module, args):
            self.sites["hook_normed"] = args[0].unflatten(-1, (HEADS, D_HEAD))

        self.handles = [ref.in_proj.register_forward_hook(gate), ref.out_proj.register_forward_pre_hook(normed)]


def assert_sites_match(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]):
    """Every site bit for bit, in value and dtype (the convolution and the scan run transformers' products in its
    order, in either dtype)."""
    assert set(mine) == set(SITE_NAMES) and set(theirs) == set(SITE_NAMES)
    for name in SITE_NAMES:
        a, b = mine[name], theirs[name]
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_transformers_runs_its_torch_path():
    """No mamba_ssm / causal_conv1d kernels here: transformers' mixer falls back to the torch functions the
    recorder wraps (the tests below also check the wrappers ran)."""
    assert importlib.util.find_spec("mamba_ssm") is None and importlib.util.find_spec("causal_conv1d") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("proj_bias", [False, True], ids=["no_bias", "bias"])
def test_prefill_output_and_every_site_match_transformers(dtype, proj_bias, monkeypatch):
    ref = random_reference(use_bias=proj_bias).to(dtype)
    root = Root(copy_of(ref))
    x, mask = stream(LENGTH, dtype, seed=1), padding_mask()
    recorder = Recorder(ref, monkeypatch)
    with torch.no_grad():
        cache = DynamicCache(config=ref.config)
        expected = ref(x, cache=cache, attention_mask=mask)
        state = RecurrentState()
        out, sites = run_caching(root, x, mask, state)
    assert recorder.calls == ["chunk"]
    assert_sites_match(sites, recorder.sites)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(state.conv, cache.layers[0].conv_states[0], atol=0, rtol=0)
    torch.testing.assert_close(state.recurrent, cache.layers[0].recurrent_states[0], atol=0, rtol=0)
    assert state.length == LENGTH
    # without a cache: the same output, on both sides
    with torch.no_grad():
        torch.testing.assert_close(root(x, mask), out, atol=0, rtol=0)
        torch.testing.assert_close(ref(x, attention_mask=mask), expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_steps_and_a_continuation_match_transformers_cache_path(dtype, monkeypatch):
    """Prefill (left-padded), 12 decode steps, then 9 positions at once from the cache (the chunked form from
    the cached state and convolution window): outputs, caches and every site as transformers'."""
    ref = random_reference(seed=2).to(dtype)
    root = Root(copy_of(ref))
    recorder = Recorder(ref, monkeypatch)
    cache, state = DynamicCache(config=ref.config), RecurrentState()
    steps = [stream(LENGTH, dtype, 3)] + [stream(1, dtype, 10 + i) for i in range(12)] + [stream(9, dtype, 30)]
    with torch.no_grad():
        for i, x in enumerate(steps):
            recorder.calls.clear()
            mask = padding_mask() if i == 0 else None
            expected = ref(x, cache=cache, attention_mask=mask)
            out, sites = run_caching(root, x, mask, state)
            assert recorder.calls == ["step" if x.shape[1] == 1 else "chunk"]
            assert_sites_match(sites, recorder.sites)
            torch.testing.assert_close(out, expected, atol=0, rtol=0)
            torch.testing.assert_close(state.conv, cache.layers[0].conv_states[0], atol=0, rtol=0)
            torch.testing.assert_close(state.recurrent, cache.layers[0].recurrent_states[0], atol=0, rtol=0)
    assert state.length == LENGTH + 12 + 9


def sequential_scan(x, dt, A, B, C, D, state):
    """The state-space recurrence written out, position by position, in float64:
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t."""
    x, dt, B, C, h = (u.double() for u in (x, dt, B, C, state))
    r = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(r, dim=2), C.repeat_interleave(r, dim=2)  # [b t head n]
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A.double())[..., None, None]
        h = decay * h + (dt[:, t, :, None, None] * x[:, t, :, :, None]) * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]) + D.double()[:, None] * x[:, t])
    return torch.stack(ys, dim=1), h


def test_scan_equals_the_recurrence_in_float64():
    """hook_y and hook_state_out against the recurrence computed from the mixer's own hook_x, hook_dt,
    hook_B, hook_C and hook_state_in, in float64, for the chunked form (from zeros and from a cached state)
    and the decode step."""
    mixer = copy_of(random_reference(seed=4))
    root = Root(mixer)
    A = -torch.exp(mixer.A_log.detach().double())
    state = RecurrentState()
    with torch.no_grad():
        for x in (stream(LENGTH, torch.float32, 5), stream(1, torch.float32, 6), stream(37, torch.float32, 7)):
            _, s = run_caching(root, x, None, state)
            y, end = sequential_scan(s["hook_x"], s["hook_dt"], A, s["hook_B"], s["hook_C"], mixer.D, s["hook_state_in"])
            scale = y.abs().max()
            assert (s["hook_y"].double() - y).abs().max() <= 2e-6 * scale
            assert (s["hook_state_out"].double() - end).abs().max() <= 2e-6 * end.abs().max()


def consistent(ref: hf.NemotronHMamba2Mixer) -> Mamba2Mixer:
    """The copy with one time-step limit for both forms (transformers' chunked one)."""
    return copy_of(ref, mamba_decode_time_step_limit=(ref.config.time_step_min, math.inf))


def test_prefill_then_decode_equals_one_forward():
    """With one time-step limit for both forms, a prefill of 60 then 40 decode steps, or a prefill of 37 then
    63 positions at once, gives the whole sequence's forward (within float32 noise)."""
    ref = random_reference(seed=5)
    root = Root(consistent(ref))
    x = stream(LENGTH, torch.float32, 8)
    with torch.no_grad():
        whole, sites = run_caching(root, x)
        state = RecurrentState()
        parts = [root(x[:, :60], None, state)] + [root(x[:, i : i + 1], None, state) for i in range(60, LENGTH)]
        torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=0)
        torch.testing.assert_close(state.recurrent, sites["hook_state_out"], atol=1e-5, rtol=0)
        state = RecurrentState()
        parts = [root(x[:, :37], None, state), root(x[:, 37:], None, state)]
        torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=0)


def test_transformers_nemotron_h_clamps_dt_in_the_chunked_form_only():
    """Why the decode step has its own limit: in transformers 5.24 a prefill followed by decode steps is not
    the whole sequence's forward where softplus(dt + dt_bias) < time_step_min (these weights make it so),
    and the copy with transformers' limits reproduces that (the decode test above checks it step by step)."""
    ref = random_reference(seed=5)
    root = Root(copy_of(ref))
    x = stream(LENGTH, torch.float32, 8)
    with torch.no_grad():
        whole = ref(x)
        cache = DynamicCache(config=ref.config)
        stepwise = torch.cat([ref(x[:, :60], cache=cache)] + [ref(x[:, i, None], cache=cache) for i in range(60, LENGTH)], 1)
        state = RecurrentState()
        mine = torch.cat([root(x[:, :60], None, state)] + [root(x[:, i, None], None, state) for i in range(60, LENGTH)], 1)
    assert (stepwise[:, 60:] - whole[:, 60:]).abs().max() > 1e-3
    torch.testing.assert_close(mine, stepwise, atol=1e-5, rtol=0)


def test_a_left_padded_row_computes_what_it_computes_alone():
    """Without projection biases the pads are exact zeros into the convolution and the state: the padded
    row's real positions, and its decode steps after, equal the row run alone."""
    root = Root(copy_of(random_reference(seed=6)))
    x, mask = stream(LENGTH, torch.float32, 9), padding_mask()
    nxt = stream(1, torch.float32, 10)
    with torch.no_grad():
        state, alone_state = RecurrentState(), RecurrentState()
        padded = root(x, mask, state)
        alone = root(x[1:, PADS:], None, alone_state)
        torch.testing.assert_close(padded[1:, PADS:], alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(root(nxt, None, state)[1:], root(nxt[1:], None, alone_state), atol=1e-5, rtol=0)


def continue_from(root: Root, state: RecurrentState, steps: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([root(x, None, state) for x in steps], 1)


def test_an_edit_of_the_state_written_changes_later_tokens_as_that_state_would():
    """hook_state_out edited during the prefill: the prefill's own output is unchanged, and the decode steps
    and continuation after it equal those from a cache holding the edited state."""
    root = Root(copy_of(random_reference(seed=7)))
    x = stream(LENGTH, torch.float32, 11)
    later = [stream(1, torch.float32, 12), stream(1, torch.float32, 13), stream(5, torch.float32, 14)]
    delta = torch.randn(BATCH, HEADS, D_HEAD, D_STATE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain_state = RecurrentState()
        plain = root(x, None, plain_state)
        edited_state = RecurrentState()
        with root.hooks(fwd_hooks=[("blocks.0.mixer.hook_state_out", lambda s, hook: s + delta)]):
            edited = root(x, None, edited_state)
        torch.testing.assert_close(edited, plain, atol=0, rtol=0)
        plain_state.update(plain_state.conv, plain_state.recurrent + delta, 0)
        torch.testing.assert_close(continue_from(root, edited_state, later), continue_from(root, plain_state, later),
                                   atol=0, rtol=0)
        unedited = RecurrentState()
        root(x, None, unedited)
        assert (continue_from(root, unedited, later) - continue_from(root, edited_state, later)).abs().max() > 1e-3


def test_an_edit_of_the_state_read_is_a_forward_from_that_state():
    """hook_state_in edited on a first forward equals a forward from a cache holding that state (and a zero
    convolution window); edited on a decode step, it equals the step from the edited cache; and an in-place
    edit there leaves the cache's tensor (which snapshots hold) untouched."""
    root = Root(copy_of(random_reference(seed=8)))
    x, step = stream(LENGTH, torch.float32, 15), stream(1, torch.float32, 16)
    start = torch.randn(BATCH, HEADS, D_HEAD, D_STATE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with root.hooks(fwd_hooks=[("blocks.0.mixer.hook_state_in", lambda s, hook: start)]):
            edited = root(x)
        given = RecurrentState()
        given.update(torch.zeros(BATCH, HEADS * D_HEAD + 2 * GROUPS * D_STATE, D_CONV), start, 0)
        torch.testing.assert_close(edited, root(x, None, given), atol=0, rtol=0)

        state = RecurrentState()
        root(x, None, state)
        snapshot = state.snapshot()
        held = state.recurrent.clone()
        with root.hooks(fwd_hooks=[("blocks.0.mixer.hook_state_in", lambda s, hook: s.mul_(0.5))]):
            edited_step = root(step, None, state)
        state.rollback(snapshot)
        torch.testing.assert_close(state.recurrent, held, atol=0, rtol=0)
        halved = RecurrentState()
        halved.update(state.conv, held * 0.5, 0)
        torch.testing.assert_close(edited_step, root(step, None, halved), atol=0, rtol=0)


def edit_returned(t, hook):
    return t * 1.5 + 0.25


def edit_in_place(t, hook):
    t.mul_(1.5).add_(0.25)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("site", SITE_NAMES)
def test_editing_a_site_in_place_is_returning_the_edit(site, grad):
    """The same edit, returned or made in place, on every site through a prefill, a decode step and a
    continuation: the same outputs and cached states, bit for bit, and not those of the unedited run."""
    root = Root(copy_of(random_reference(seed=9)))
    steps = [stream(40, torch.float32, 17), stream(1, torch.float32, 18), stream(6, torch.float32, 19)]
    mask = padding_mask(40)

    def run(edit):
        state, outs = RecurrentState(), []
        with torch.set_grad_enabled(grad), root.hooks(fwd_hooks=[(f"blocks.0.mixer.{site}", edit)] if edit else []):
            for i, x in enumerate(steps):
                outs.append(root(x.requires_grad_(grad), mask if i == 0 else None, state))
        return torch.cat(outs, 1).detach(), state.recurrent.detach(), state.conv.detach()

    plain, returned, in_place = run(None), run(edit_returned), run(edit_in_place)
    for a, b in zip(returned, in_place):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert (returned[0] - plain[0]).abs().max() > 1e-4


def test_granite_hybrid_mamba_layer_is_the_same_mixer_under_its_config_names():
    """granitemoehybrid's Mamba layer (Granite-4.0) computes the same with its config's names: the width is
    mamba_expand * hidden_size, the eps rms_norm_eps, the chunked form's clamp config.time_step_limit (here
    biting: 0.01), the decode step unclamped. A left-padded prefill, decode steps and a continuation."""
    gc = GraniteMoeHybridConfig(hidden_size=D_MODEL, mamba_n_heads=HEADS, mamba_d_head=D_HEAD, mamba_expand=1,
                                mamba_n_groups=GROUPS, mamba_d_state=D_STATE, mamba_d_conv=D_CONV,
                                mamba_chunk_size=CHUNK, time_step_limit=(0.01, math.inf), layer_types=["mamba"],
                                num_attention_heads=2, num_key_value_heads=1, vocab_size=50, num_hidden_layers=1)
    assert gc.hidden_act == "silu"  # the convolution's activation; the mixer has SiLU only
    ref = granite.GraniteMoeHybridMambaLayer(gc, layer_idx=0).eval()
    ref.load_state_dict(random_reference(seed=10).state_dict())
    cfg = Mamba2Config(
        d_model=gc.hidden_size, mamba_n_heads=gc.mamba_n_heads, mamba_d_head=gc.mamba_d_head,
        mamba_n_groups=gc.mamba_n_groups, mamba_d_state=gc.mamba_d_state, mamba_d_conv=gc.mamba_d_conv,
        mamba_chunk_size=gc.mamba_chunk_size, mamba_conv_bias=gc.mamba_conv_bias, mamba_proj_bias=gc.mamba_proj_bias,
        mamba_norm_eps=gc.rms_norm_eps, mamba_time_step_limit=gc.time_step_limit,
        mamba_decode_time_step_limit=(0.0, math.inf),
    )
    assert gc.mamba_expand * gc.hidden_size == HEADS * D_HEAD
    mixer = Mamba2Mixer(cfg, layer=0)
    mixer.load_state_dict(ref.state_dict())
    root = Root(mixer)
    cache, state = DynamicCache(config=gc), RecurrentState()
    steps = [stream(LENGTH, torch.float32, 40)] + [stream(1, torch.float32, 41 + i) for i in range(4)]
    steps.append(stream(7, torch.float32, 50))
    with torch.no_grad():
        for i, x in enumerate(steps):
            mask = padding_mask() if i == 0 else None
            torch.testing.assert_close(root(x, mask, state), ref(x, cache=cache, attention_mask=mask), atol=1e-5, rtol=0)
            torch.testing.assert_close(state.recurrent, cache.layers[0].recurrent_states[0], atol=1e-5, rtol=0)


def test_every_site_is_a_table_entry_and_has_its_layout():
    """The mixer's hook points are the table's blocks.L.mixer.* rows (all of them: no family builds them yet,
    so tests/test_hook_sites.py leaves these rows to this test), with their layout and meaning, and the
    tensors they hold have the layout's sizes."""
    root = Root(copy_of(random_reference()))
    table = {f"blocks.L.mixer.{tail}" for tail in SITE_NAMES}
    assert {table_name(n) for n in root.hook_dict} == table and table <= {s.name for s in SITES}
    for name, hp in root.hook_dict.items():
        # the rows Gated DeltaNet shares: their "mamba2" form
        shared = name.rsplit(".", 1)[-1] in ("hook_gate", "hook_state_in", "hook_state_out")
        form = site_form(table_name(name), "mamba2" if shared else "default")
        assert (hp.layout, hp.meaning) == (form.layout, form.meaning)
    sizes = {"batch": BATCH, "pos": LENGTH, "mamba_head": HEADS, "mamba_d_head": D_HEAD, "mamba_group": GROUPS,
             "mamba_d_state": D_STATE}
    with torch.no_grad():
        _, sites = run_caching(root, stream(LENGTH, torch.float32, 20))
    for name, t in sites.items():
        layout = root.hook_dict[f"blocks.0.mixer.{name}"].layout
        assert tuple(t.shape) == tuple(sizes[a] for a in layout.split()), (name, layout)


def test_state_size_and_protocol():
    """state_bytes counts the values a cache holds after a forward; the state is the mixer's kind; in_proj
    is the one projection reading the normed stream."""
    mixer = copy_of(random_reference())
    state = mixer.new_state()
    Root(mixer)(stream(LENGTH, torch.float32, 21), None, state)
    counted = type(mixer).state_bytes(mixer_config(hf_config()))
    assert counted.per_token == 0
    assert counted.per_sequence * BATCH == state.conv.numel() + state.recurrent.numel()
    assert state.recurrent.dtype == torch.float32
    assert mixer.input_projections() == [mixer.in_proj] and Mamba2Mixer.block_attribute == "mixer"


def test_bad_inputs_are_refused_with_what_is_wrong():
    root = Root(copy_of(random_reference()))
    x = stream(10, torch.float32, 22)
    with pytest.raises(ValueError, match=r"inputs.mask has shape \(2, 9\), expected .* \(2, 10\)"):
        root(x, torch.ones(BATCH, 9, dtype=torch.long))
    with pytest.raises(TypeError, match="inputs.state is a dict, expected a RecurrentState"):
        root(x, None, {})
    state = RecurrentState()
    root(x, None, state)
    with pytest.raises(ValueError, match=r"cached state.conv has shape \(2, 56, 4\), expected \(1, 56, 4\)"):
        root(x[:1], None, state)
    with pytest.raises(ValueError, match="mamba_n_heads=8 is not a multiple of mamba_n_groups=3"):
        Mamba2Mixer(mixer_config(hf_config(), mamba_n_groups=3), layer=0)
    with pytest.raises(ValueError, match=r"mamba_time_step_limit=\(0.1, 0.01\)"):
        Mamba2Mixer(mixer_config(hf_config(), mamba_time_step_limit=(0.1, 0.01)), layer=0)
