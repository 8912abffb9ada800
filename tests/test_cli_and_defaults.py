"""The moelens command and the embedded default checkpoint."""

import hashlib
import math

import pytest
import torch
from safetensors import safe_open

from moelens import HookedTransformer
from moelens.cli import main
from moelens.defaults import default_checkpoint


@pytest.fixture(scope="module")
def default_path(tmp_path_factory):
    return default_checkpoint("tiny-qwen2-moe", root=tmp_path_factory.mktemp("cache"))


def test_default_checkpoint_is_deterministic(default_path, tmp_path):
    again = default_checkpoint("tiny-qwen2-moe", root=tmp_path)
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(again) == digest(default_path)


def test_default_checkpoint_matches_transformers(default_path):
    from moelens.verify import verify

    report = verify(default_path)
    assert report.max_logit_diff <= 1e-5 and report.index_mismatches == 0


def test_default_tokenizer_round_trips(default_path):
    model = HookedTransformer.from_pretrained(default_path, progress=False)
    text = "Grüße, 世界!"
    assert model.to_string(model.to_tokens(text)[0]) == text
    tokens, mask = model.tokenize(["a", "abc"])
    assert mask.tolist() == [[0, 0, 1], [1, 1, 1]] and tokens[0, :2].tolist() == [model.tokenizer.pad_token_id] * 2


def test_inspect_prints_the_routing(default_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: default_path.parent.parent)
    assert main(["inspect", "tiny-qwen2-moe", "--prompt", "Hi you"]) == 0
    out = capsys.readouterr().out
    model = HookedTransformer.from_pretrained(default_path, progress=False)
    _, cache = model.run_with_cache("Hi you")
    for layer in range(model.cfg.n_layers):
        assert f"layer {layer}" in out
        w, idx = cache["expert_weights", layer][0, 1], cache["expert_indices", layer][0, 1]
        best = int(w.argmax())
        assert f"E{int(idx[best]):<3d}{float(w[best]):.3f}" in out.split(f"layer {layer}")[1].splitlines()[2]
    assert "next token:" in out


def test_verify_command(qwen_path, capsys):
    assert main(["verify", str(qwen_path), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "blocks.2.mlp.hook_router_logits" in out


def test_string_input_without_tokenizer(qwen_model):
    with pytest.raises(ValueError, match="no tokenizer"):
        qwen_model("hello")
    assert torch.is_tensor(qwen_model(torch.tensor([[1, 2, 3]])))


@pytest.mark.parametrize("name", ["tiny-hunyuan-moe", "tiny-solar-open"])
def test_other_family_defaults_inspect_and_verify(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: tmp_path)
    assert main(["inspect", name, "--prompt", "Hey"]) == 0
    out = capsys.readouterr().out
    model = HookedTransformer.from_pretrained(default_checkpoint(name), progress=False)
    assert type(model).__name__ in out
    for layer in range(model.cfg.n_layers):
        row = out.split(f"layer {layer}\n")[1].splitlines()[0]
        assert row.count(" E") == model.cfg.top_k_per_layer[layer]  # one entry per slot, per-layer top_k honoured
    assert main(["verify", name]) == 0
    out = capsys.readouterr().out
    assert "float32: OK" in out and "bfloat16: OK" in out


def test_verify_says_when_transformers_cannot_load_the_reference(copy_checkpoint, capsys):
    import json

    folder = copy_checkpoint("hunyuan_v1_moe")
    config = json.loads((folder / "config.json").read_text())
    config["attention_head_dim"] = config.pop("head_dim")  # Tencent's spelling: moelens reads it, transformers not
    config["rope_scaling"] = {"type": "dynamic", "alpha": 1000.0}
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    (folder / "config.json").write_text(json.dumps(config))
    HookedTransformer.from_pretrained(folder, progress=False)  # moelens loads it
    assert main(["verify", str(folder), "--dtype", "float32"]) == 2
    assert "transformers could not load" in capsys.readouterr().err


def test_inspect_header_and_layer_summary(default_path, monkeypatch, capsys):
    """The header says what the model is (random embedded weights, parameters as stored in the file); each
    mixture layer's summary line holds the tokens per expert, the mean entropy of the normalised router
    scores and the mean shared-gate sigmoid, recomputed here by hand from the cache."""
    monkeypatch.setattr("moelens.defaults.cache_root", lambda: default_path.parent.parent)
    assert main(["inspect", "tiny-qwen2-moe", "--prompt", "Hi you"]) == 0
    out = capsys.readouterr().out
    with safe_open(default_path / "model.safetensors", framework="pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert out.splitlines()[0].startswith("HookedQwen2Moe from tiny-qwen2-moe: random weights (embedded default; its routing means nothing), ")
    assert f"{stored:,} parameters" in out.splitlines()[0]
    assert "   0  72 'H'" in out and "   5 117 'u'" in out  # each token's id beside its byte
    model = HookedTransformer.from_pretrained(default_path, progress=False)
    _, cache = model.run_with_cache("Hi you")
    for layer in model.cfg.moe_layer_indices:
        line = next(s for s in out.splitlines() if s.strip().startswith(f"L{layer}:"))
        counts: dict[int, int] = {}
        for e in cache["expert_indices", layer][0].flatten().tolist():
            counts[e] = counts.get(e, 0) + 1
        assert line.endswith("tokens per expert " + ", ".join(f"E{e}:{counts[e]}" for e in sorted(counts)))
        entropies = []
        for row in cache["router_scores", layer][0].tolist():
            total = sum(row)
            entropies.append(-sum(p / total * math.log(p / total) for p in row if p > 0))
        assert f"entropy {sum(entropies) / len(entropies):.3f} nats" in line
        gates = [1 / (1 + math.exp(-g)) for g in cache["shared_gate", layer][0].flatten().tolist()]
        assert f"shared gate {sum(gates) / len(gates):.3f}" in line
