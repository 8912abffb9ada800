"""The lightning-attention mixer alone (moelens.models.mixers.lightning), against the sum it computes written out
in float64: each position's read-out q_i . sum over j <= i of exp(-s (i - j)) k_j^T v_j, by the block form (a
prompt, blocks of 4 here, a partial last one) and by the token-by-token form (after a cached state); the state
handed on; its checks of the state it is given. transformers' numbers are test_family_minimax's."""

import pytest
import torch

from moelens.models.context import LayerInputs
from moelens.models.mixers.lightning import LightningAttention, LightningSizes, decay_rates
from moelens.state import KVState, RecurrentState

SIZES = LightningSizes(d_model=16, n_heads=2, d_head=4, n_layers=3, lightning_block_size=4)


def mixer(layer: int = 1) -> LightningAttention:
    torch.manual_seed(0)
    m = LightningAttention(SIZES, layer)
    with torch.no_grad():
        m.norm.weight.normal_(1.0, 0.3)
    return m


def inputs(n: int, state=None) -> LayerInputs:
    return LayerInputs(positions=torch.arange(n)[None], cos=None, sin=None,
                       allowed=torch.ones(1, 1, n, n, dtype=torch.bool), state=state)


def read_outs(m: LightningAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(read-out [pos head d], final state [head d d]) in float64 from the mixer's own q, k, v."""
    qkv = torch.nn.functional.silu(m.qkv_proj(x)).double()[0].reshape(x.shape[1], 2, 12)
    q, k, v = qkv.split(4, dim=-1)
    rates = decay_rates(2, m.layer, 3).double()[:, 0, 0]
    state = torch.zeros(2, 4, 4, dtype=torch.float64)
    outs = []
    for i in range(x.shape[1]):
        state = torch.exp(-rates)[:, None, None] * state + k[i][:, :, None] * v[i][:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[i], state))
    return torch.stack(outs), state


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_both_forms_compute_the_decayed_sum(layer):
    m = mixer(layer)
    x = torch.randn(1, 11, 16, generator=torch.Generator().manual_seed(layer))
    expected, state = read_outs(m, x)
    whole = RecurrentState()
    captured = {}
    m.hook_core_out.add_hook(lambda t, hook: captured.setdefault("block", t.clone()))
    with torch.no_grad():
        m(x, inputs(11, whole))
    torch.testing.assert_close(captured["block"][0].double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole.recurrent[0].double(), state, rtol=1e-5, atol=1e-5)
    m.hook_core_out.remove_hooks()

    stepped, outs = RecurrentState(), []
    m.hook_core_out.add_hook(lambda t, hook: outs.append(t.clone()))
    with torch.no_grad():
        m(x[:, :3], inputs(3, stepped))
        m(x[:, 3:], inputs(8, stepped))  # after a cached state: token by token
    torch.testing.assert_close(torch.cat(outs, dim=1)[0].double(), expected, rtol=1e-5, atol=1e-5)
    assert stepped.length == 11 and stepped.conv is None


def test_a_state_of_another_kind_or_shape_is_refused():
    m = mixer()
    x = torch.randn(2, 3, 16)
    with pytest.raises(TypeError, match="inputs.state is a KVState"):
        m(x, inputs(3, KVState()))
    wrong = RecurrentState()
    wrong.update(None, torch.zeros(1, 2, 4, 4), 3)
    with pytest.raises(ValueError, match="cached state.recurrent has shape \\(1, 2, 4, 4\\), expected \\(2, 2, 4, 4\\)"):
        m(x, inputs(3, wrong))


def test_sizes_are_checked_naming_the_field():
    with pytest.raises(ValueError, match="lightning_block_size must be a positive int"):
        LightningAttention(LightningSizes(16, 2, 4, 3, 0), 0)
    with pytest.raises(ValueError, match="only 'silu'"):
        LightningAttention(LightningSizes(16, 2, 4, 3, 4, act_fn="gelu"), 0)
