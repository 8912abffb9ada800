"""A block's MLP lists its parts as data (block.mlp.parts()), and the code that works on every arrangement
(folding, the residual and neuron decompositions, the weight views, routing tables) reads the parts only: a
new arrangement needs no edit to it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import FAMILIES, as_added, lineage, sublayer_input
from torch import nn

from moelens.analysis.routing import routing_table
from moelens.hooks import HookPoint
from moelens.models.components import Attention, GatedMLP, SoftmaxTopK, SparseMoe
from moelens.models.components.parts import GatedMlpPart, PartGate
from moelens.models.qwen2_moe import HookedQwen2Moe
from moelens.models.recipe import decoder_recipe


def gated_mlp_by_hand(part: GatedMlpPart, x: torch.Tensor) -> torch.Tensor:
    """A gated-MLP part's term of hook_mlp_out from its weights: down(act(x W_gate) * x W_up), times the gate."""
    mlp = part.module
    W_up, W_down = mlp.up_proj.weight.detach(), mlp.down_proj.weight.detach()
    if hasattr(mlp, "gate_proj"):
        out = (mlp.act(x @ mlp.gate_proj.weight.detach().T) * (x @ W_up.T)) @ W_down.T
    else:  # an ungated MLP (Nemotron-H's): down(act(x W_up))
        out = mlp.act(x @ W_up.T) @ W_down.T
    if part.gate is not None:
        out = part.gate.activation(x @ part.gate.module.weight.detach().T) * out
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_parts_sum_to_mlp_out(family_models, family, tokens):
    """The parts' `out` hooks hold terms that add up to hook_mlp_out, and a shared or dense part's term is
    its MLP (and gate) recomputed by hand from the block's normed input."""
    model = family_models[family]
    assert model.cfg.dtype == torch.float32
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
    kinds = set()
    for l, block in enumerate(model.blocks):
        if not block.has_ffn:  # a layer of a token mixer alone (Nemotron-H)
            continue
        parts = block.mlp.parts()
        kinds |= {p.kind for p in parts}
        if block.is_moe:
            routed = [p for p in parts if p.kind == "routed"]
            assert len(routed) == 1 and routed[0].module is block.mlp.experts and routed[0].router is block.mlp.router
            assert not any(p.kind == "dense" for p in parts)
        else:
            assert [p.kind for p in parts] == ["dense"] and parts[0].module is block.mlp
        terms = [cache[(p.out or block.hook_mlp_out).name] for p in parts]
        if len(parts) > 1:  # two terms add the same in either order, bit for bit (as the block adds the sum)
            torch.testing.assert_close(as_added(model, l, "ffn", sum(terms[1:], terms[0])), cache["mlp_out", l], rtol=0, atol=0)
        elif parts[0].out is not None:  # one part: the mixture's output, as the block adds it
            assert torch.equal(as_added(model, l, "ffn", terms[0]), cache["mlp_out", l])
        x = sublayer_input(model, cache, l, "ffn")
        for part, term in zip(parts, terms):
            assert all(w.shape[-1] == model.cfg.d_model for w in part.input_weights())
            if part.kind != "routed":
                by_hand = gated_mlp_by_hand(part, x)
                # a part without a hook of its own is the whole sublayer: its term is what the block adds
                by_hand = as_added(model, l, "ffn", by_hand) if part.out is None else by_hand
                torch.testing.assert_close(by_hand, term, rtol=0, atol=1e-5)
    shared = {"qwen2_moe", "hunyuan_v1_moe", "solar_open", "deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa", "llama4_text",
              "qwen3_next", "qwen3_5_moe", "nemotron_h", "glm4_moe_lite", "deepseek_v2", "ernie4_5_moe",
              "granitemoeshared", "afmoe", "kolibri1", "aria_text", "lara_mini", "flint"}
    # a family derived from another (sarvam_mla from deepseek_v3) has its arrangement
    assert ("shared" in kinds) == any(name in shared for name in lineage(family))
    gated = [p for b in model.blocks if b.has_ffn for p in b.mlp.parts() if p.gate is not None]
    assert bool(gated) == any(name in ("qwen2_moe", "qwen3_next", "qwen3_5_moe") for name in lineage(family))  # a sigmoid gate on the shared expert


# ---- a new arrangement, known to no shared code --------------------------------------------------------------
class RoutedThenTanhGated(SparseMoe):
    """Test only: the routed experts first, then an always-on expert scaled by tanh(gate(x)), under names no
    shipped arrangement uses."""

    def __init__(self, cfg, layer, router) -> None:
        super().__init__(cfg, layer, router)
        self.always_on = GatedMLP(cfg.d_model, cfg.d_shared, cfg.act_fn, "d_shared", hook_out=True)
        self.always_on_gate = nn.Linear(cfg.d_model, 1, bias=False)
        self.hook_always_on_gate = HookPoint("batch pos 1", "gate logit")
        self.hook_always_on_out = HookPoint("batch pos d_model", "always-on expert as added")

    def forward(self, x):
        routed = self._routed(x)
        gate = torch.tanh(self.hook_always_on_gate(self.always_on_gate(x)))
        return routed + self.hook_always_on_out(gate * self.always_on(x))

    def parts(self):
        gate = PartGate(self.always_on_gate, self.hook_always_on_gate, torch.tanh)
        always_on = GatedMlpPart("shared", self.always_on, out=self.hook_always_on_out, gate=gate, label="always_on")
        return (self._routed_part(), always_on)


class HookedRoutedThenTanhGated(HookedQwen2Moe):
    @classmethod
    def recipe(cls, cfg):
        return decoder_recipe(cfg, Attention, RoutedThenTanhGated, SoftmaxTopK)


RENAMED = {".mlp.shared_expert.": ".mlp.always_on.", ".mlp.shared_gate.": ".mlp.always_on_gate."}


@pytest.fixture(scope="module")
def custom(qwen_model):
    """The tiny Qwen2-MoE's weights in the new arrangement (its shared expert and gate renamed)."""
    model = HookedRoutedThenTanhGated(qwen_model.cfg)
    state = {}
    for key, value in qwen_model.state_dict().items():
        for old, new in RENAMED.items():
            key = key.replace(old, new)
        state[key] = value
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_a_new_arrangement_is_decomposed_by_its_parts(custom, tokens):
    cfg = custom.cfg
    with torch.no_grad():
        _, cache = custom.run_with_cache(tokens)
        stack, labels = cache.get_full_resid_decomposition(expand_neurons=False, return_labels=True)
        neurons, neuron_labels = cache.stack_neuron_results(-1, return_labels=True)
    comp = dict(zip(labels, stack))
    rows = {lab: i for i, lab in enumerate(neuron_labels)}
    torch.testing.assert_close(stack.sum(0), cache["resid_post", cfg.n_layers - 1], rtol=0, atol=1e-5)
    for l, block in enumerate(custom.blocks):
        assert block.is_moe
        mine = [lab for lab in labels if lab.startswith(f"L{l}.")]
        assert mine == [f"L{l}.E{e}" for e in range(cfg.n_experts)] + [f"L{l}.always_on"]  # the parts' order
        x = cache[f"blocks.{l}.ln2.hook_normalized"]
        by_hand = gated_mlp_by_hand(block.mlp.parts()[1], x)
        assert torch.count_nonzero(by_hand) > 0
        torch.testing.assert_close(comp[f"L{l}.always_on"], by_hand, rtol=0, atol=1e-5)
        torch.testing.assert_close(sum(comp[lab] for lab in mine), cache["mlp_out", l], rtol=0, atol=1e-5)
        # its neurons, tanh(gate) in: each one by hand, and together the part
        post, down = cache[f"blocks.{l}.mlp.always_on.hook_post"], block.mlp.always_on.down_proj.weight.detach()
        tanh = torch.tanh(cache[f"blocks.{l}.mlp.hook_always_on_gate"])
        own = [rows[f"L{l}.always_on.N{i}"] for i in range(cfg.d_shared)]
        torch.testing.assert_close(neurons[own[3]], tanh * post[..., 3, None] * down[:, 3], rtol=0, atol=1e-6)
        torch.testing.assert_close(neurons[own].sum(0), by_hand, rtol=0, atol=1e-5)
        shared = cache.get_neuron_results(l, shared=True)
        torch.testing.assert_close(shared.movedim(-2, 0), neurons[own], rtol=0, atol=0)
        layer_rows = [i for lab, i in rows.items() if lab.startswith(f"L{l}.")]
        torch.testing.assert_close(neurons[layer_rows].sum(0), cache["mlp_out", l], rtol=0, atol=1e-5)


def test_a_new_arrangement_is_folded_and_viewed_by_its_parts(custom, tokens):
    folded = copy.deepcopy(custom)
    gates = [b.mlp.always_on_gate.weight.detach().clone() for b in custom.blocks]
    ln2 = [b.ln2.weight.detach().clone() for b in custom.blocks]
    assert not all(torch.equal(w, torch.ones_like(w)) for w in ln2)  # there is something to fold
    folded.process_weights_(fold_ln=True)
    names = [f"blocks.{l}.mlp.hook_always_on_out" for l in range(custom.cfg.n_layers)]
    with torch.no_grad():
        _, before = custom.run_with_cache(tokens, names_filter=names)
        _, after = folded.run_with_cache(tokens, names_filter=names)
    for l, block in enumerate(folded.blocks):
        assert torch.equal(block.ln2.weight, torch.ones_like(block.ln2.weight))
        assert torch.equal(block.mlp.always_on_gate.weight, gates[l] * ln2[l])
        # the always-on part does not depend on routing: the fold leaves it unchanged up to rounding
        torch.testing.assert_close(after[names[l]], before[names[l]], rtol=0, atol=1e-5)
    # the weight views find the always-on expert; its gate is no sigmoid
    for l, block in enumerate(custom.blocks):
        assert torch.equal(custom.W_shared_in[l], block.mlp.always_on.up_proj.weight.T)
        assert torch.equal(custom.W_shared_out[l], block.mlp.always_on.down_proj.weight.T)
    with pytest.raises(ValueError, match="not gated by a sigmoid"):
        _ = custom.W_shared_sigmoid_gate
    # a routing table reports the mean factor of the part's gate (here tanh)
    table = routing_table(custom, tokens[:1])
    with torch.no_grad():
        _, cache = custom.run_with_cache(tokens[:1], names_filter=lambda n: n.endswith("hook_always_on_gate"))
    for l, summary in zip(table.layers, table.summaries):
        expected = float(torch.tanh(cache[f"blocks.{l}.mlp.hook_always_on_gate"][0]).mean())
        assert summary.shared_gate == pytest.approx(expected, abs=1e-6)
