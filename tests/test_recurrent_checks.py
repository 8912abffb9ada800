"""The refusals every delta-rule mixer makes before its forward (moelens.models.mixers.recurrent_checks): a bad
stream, a bad mask, a cached state of another kind, of another batch, or half filled; each names the mixer and
its layer."""

import pytest
import torch

from moelens.models.context import LayerInputs
from moelens.models.mixers.gated_deltanet import GatedDeltaNetSizes, SeparateProjectionsGatedDeltaNet
from moelens.models.mixers.kimi_delta_attention import KimiDeltaSizes, KimiLinearDeltaAttention
from moelens.state import KVState, RecurrentState

MIXERS = {
    "Gated DeltaNet": lambda: SeparateProjectionsGatedDeltaNet(GatedDeltaNetSizes(16, 2, 4, 8, 8, 4, 1e-6), 3),
    "Kimi Delta Attention": lambda: KimiLinearDeltaAttention(KimiDeltaSizes(16, 2, 8, 4, 1e-6), 3),
}


def inputs(batch: int, n_pos: int, mask=None, state=None) -> LayerInputs:
    allowed = torch.ones(batch, 1, n_pos, n_pos, dtype=torch.bool).tril()
    return LayerInputs(torch.arange(n_pos).expand(batch, n_pos), None, None, allowed, mask, state)


@pytest.mark.parametrize("label", MIXERS)
def test_each_bad_input_is_refused_naming_the_mixer_and_layer(label):
    mixer = MIXERS[label]()
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match=rf"{label} \(layer 3\): input of shape \(2, 5, 12\)"):
        mixer(torch.randn(2, 5, 12), inputs(2, 5))
    with pytest.raises(ValueError, match=r"inputs.mask of shape \(2, 4\), expected \[batch pos\] = \(2, 5\)"):
        mixer(x, inputs(2, 5, mask=torch.ones(2, 4, dtype=torch.long)))
    with pytest.raises(TypeError, match="inputs.state is a KVState"):
        mixer(x, inputs(2, 5, state=KVState()))
    state = RecurrentState()
    with torch.no_grad():
        mixer(x, inputs(2, 5, state=state))  # a state for a batch of 2
    with pytest.raises(ValueError, match=r"cached state.conv has shape \(2, .*for this batch of 1"):
        mixer(x[:1], inputs(1, 5, state=state))
    state.recurrent = None
    with pytest.raises(ValueError, match="cached state has a conv tensor without the other"):
        mixer(x, inputs(2, 5, state=state))
