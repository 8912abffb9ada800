"""SteerMoE's activation-rate difference between two prompt sets in memory, and co-activation lift."""

from __future__ import annotations

import math

import pytest
import torch

from moelens import HookedTransformer
from moelens.analysis import activation_difference, coactivation, coactivation_lift
from moelens.traces import delta_experts

SET_A = ["def add(a, b):\n    return a + b", "for i in range(10):\n    print(i)"]
SET_B = ["The quick brown fox jumps over the lazy dog.", "Once upon a time there was a king."]


@pytest.fixture(scope="module")
def model():
    return HookedTransformer.from_pretrained("tiny-code-moe")


def rates_by_hand(model, texts, layer):
    """Share of the texts' tokens routed to each expert, from each run's cached expert indices."""
    counts, n = torch.zeros(model.cfg.n_experts), 0
    for text in texts:
        _, cache = model.run_with_cache(text)
        chosen = cache[f"blocks.{layer}.mlp.hook_expert_indices"][0]  # [pos top_k]
        for row in chosen.tolist():
            for e in set(row):
                counts[e] += 1
        n += chosen.shape[0]
    return counts / n


def test_activation_difference_between_two_prompt_sets(model):
    layers = model.cfg.moe_layer_indices
    deltas = activation_difference(model, SET_A, SET_B)
    assert len(deltas) == len(layers) * model.cfg.n_experts
    by_hand = {layer: (rates_by_hand(model, SET_A, layer), rates_by_hand(model, SET_B, layer)) for layer in layers}
    for d in deltas:
        a, b = by_hand[d.layer]
        assert d.rate_a == pytest.approx(float(a[d.expert]), abs=1e-6)
        assert d.rate_b == pytest.approx(float(b[d.expert]), abs=1e-6)
        assert d.delta == pytest.approx(float(a[d.expert] - b[d.expert]), abs=1e-6)
    magnitudes = [abs(d.delta) for d in deltas]
    assert magnitudes == sorted(magnitudes, reverse=True) and magnitudes[0] > 0
    # the trace helpers take it as they take a trace's
    sign = "positive" if deltas[0].delta > 0 else "negative"
    assert delta_experts(deltas, top=1, sign=sign) == {deltas[0].layer: [deltas[0].expert]}


def test_coactivation_lift_by_hand():
    # layer a top-1 experts of 4 tokens: 0 0 1 2; layer b: 1 1 2 2
    counts = torch.tensor([[0, 2, 0], [0, 0, 1], [0, 0, 1]])
    lift = coactivation_lift(counts)
    # p(a=0, b=1) = 1/2, p(a=0) = 1/2, p(b=1) = 1/2 -> 2; p(a=1, b=2) = 1/4 / (1/4 * 1/2) = 2; p(a=2, b=2) = 2
    assert lift[0, 1].item() == pytest.approx(2) and lift[1, 2].item() == pytest.approx(2) and lift[2, 2].item() == pytest.approx(2)
    assert lift[0, 2].item() == 0 and math.isnan(lift[0, 0].item())  # b never chose expert 0: no rate, NaN
    # within one top-2 layer, tokens {0,1} {0,1} {1,2} {0,2}: counts per expert 3 3 2 of 4 tokens
    within = torch.tensor([[3, 2, 1], [2, 3, 1], [1, 1, 2]])
    lift = coactivation_lift(within)
    assert lift[0, 1].item() == pytest.approx((2 / 4) / (3 / 4 * 3 / 4))
    assert lift[1, 2].item() == pytest.approx((1 / 4) / (3 / 4 * 2 / 4))
    assert lift[2, 2].item() == pytest.approx(4 / 2)  # the diagonal: 1 / p(e)
    with pytest.raises(ValueError, match="counts"):
        coactivation_lift(within.float())


def test_coactivation_lift_of_a_model_run(model):
    counts = coactivation(model, SET_A, 1, 2)
    lift = coactivation_lift(counts)
    # independent rates from the model's own counts per layer: the same ratio, by hand
    within_a, within_b = coactivation(model, SET_A, 1), coactivation(model, SET_A, 2)
    n = sum(model.to_tokens(t).shape[1] for t in SET_A)
    p_a, p_b = within_a.diagonal().double() / n, within_b.diagonal().double() / n
    expected = counts.double() / n / (p_a[:, None] * p_b[None, :])
    torch.testing.assert_close(lift.double(), expected, equal_nan=True, rtol=1e-6, atol=1e-6)
