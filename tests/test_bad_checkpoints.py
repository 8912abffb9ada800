"""Bad checkpoints: each is refused with an error naming the file and/or tensor at fault and what was expected."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import moelens
import tiny
from moelens import HookedTransformer
from moelens.loaders.errors import CheckpointError

EXPERT_KEY = "model.layers.1.mlp.experts.3.up_proj.weight"
Q_KEY = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One good single-file checkpoint, copied by each test that breaks it."""
    return tiny.build_qwen2_moe(tmp_path_factory.mktemp("pristine") / "ckpt", seed=0)


@pytest.fixture
def ckpt(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "ckpt")


def load(folder):
    return HookedTransformer.from_pretrained(folder, progress=False)


def rewrite(folder, edit, name="model.safetensors"):
    """Rewrite one safetensors file through edit(tensors: dict) -> None."""
    path = folder / name
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def refused(folder, *parts, error=CheckpointError):
    """Load folder, expecting `error` whose message contains every one of parts; returns the message."""
    with pytest.raises(error) as info:
        load(folder)
    message = str(info.value)
    for part in parts:
        assert str(part) in message, f"{part!r} not in {message!r}"
    return message


def test_checkpoint_error_is_exported():
    assert moelens.CheckpointError is CheckpointError
    assert issubclass(CheckpointError, ValueError)


def test_pristine_copy_loads(ckpt):
    model = load(ckpt)
    assert model.cfg.n_experts == 8 and model.tokenizer is None


# ---- 1-3: tensors missing, unexpected, misshapen ---------------------------------------------------


def test_missing_tensor(ckpt):
    rewrite(ckpt, lambda t: t.pop(EXPERT_KEY))
    message = refused(ckpt, EXPERT_KEY, "missing", ckpt)
    assert "1 tensor" in message


def test_missing_lm_head_of_untied_model(ckpt):
    rewrite(ckpt, lambda t: t.pop("lm_head.weight"))
    refused(ckpt, "'lm_head.weight'", "missing")


def test_unexpected_tensor(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.layers.0.mlp.experts.99.up_proj.weight": torch.zeros(32, 64)}))
    refused(ckpt, "unexpected", "model.layers.0.mlp.experts.99.up_proj.weight", "model.safetensors")


def test_ignored_inv_freq_buffer_is_not_unexpected(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load(ckpt)


def test_misshapen_tensor(ckpt):
    rewrite(ckpt, lambda t: t.update({Q_KEY: torch.zeros(60, 64)}))
    message = refused(ckpt, Q_KEY, "model.safetensors", "(60, 64)", "(64, 64)", "config.json")
    assert "more" not in message


def test_config_expert_size_mismatches_every_expert(ckpt):
    tiny.edit_config(ckpt, moe_intermediate_size=16)
    message = refused(ckpt, "model.safetensors", "(32, 64)", "(16, 64)", "config.json")
    assert re.search(r"model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj\.weight", message), message
    assert "71 more tensor(s) mismatch" in message  # 3 layers x 8 experts x 3 projections, one named first


def test_config_vocab_mismatch(ckpt):
    tiny.edit_config(ckpt, vocab_size=100)
    refused(ckpt, "model.embed_tokens.weight", "(96, 64)", "(100, 64)")


# ---- 4: unreadable safetensors files ------------------------------------------------------------


def test_truncated_safetensors(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    refused(ckpt, str(path), "truncated")


def test_truncated_to_a_few_bytes(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:5])
    refused(ckpt, str(path))


def test_garbage_header(ckpt):
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff\x00garbage, not a JSON header!!!"[:32]
    path.write_bytes(bytes(data))
    refused(ckpt, str(path), "unreadable")


def test_empty_safetensors_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"")
    refused(ckpt, "model.safetensors")


# ---- 5: pickle weights are never loaded ---------------------------------------------------------


class _Boom:
    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise AssertionError("a pickle file was unpickled")


def test_bin_only_checkpoint_is_refused_without_unpickling(ckpt, monkeypatch):
    (ckpt / "model.safetensors").unlink()
    import pickle

    # a real pickle that fails loudly if anything unpickles it; and torch.load must never be called
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom()))
    monkeypatch.setattr(torch, "load", lambda *a, **k: _explode())
    monkeypatch.setattr(pickle, "load", lambda *a, **k: _explode())
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: _explode())
    message = refused(ckpt, "pytorch_model.bin", "never loads pickle", "safetensors")
    assert "unpickled" not in message


def test_bin_next_to_safetensors_is_ignored(ckpt):
    (ckpt / "pytorch_model.bin").write_bytes(b"\x80\x04 not even a pickle")
    load(ckpt)


def test_no_weights_at_all(ckpt):
    (ckpt / "model.safetensors").unlink()
    refused(ckpt, "no *.safetensors", str(ckpt))


# ---- 6-7: config.json ---------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["hidden_size", "num_experts", "num_hidden_layers", "vocab_size"])
def test_config_without_needed_field(ckpt, field):
    tiny.edit_config(ckpt, **{field: None})
    refused(ckpt, "config.json", repr(field))


def test_config_missing(ckpt):
    (ckpt / "config.json").unlink()
    refused(ckpt, "config.json", str(ckpt))


def test_config_invalid_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "qwen2_moe", ')
    refused(ckpt, "config.json", "not valid JSON")


def test_config_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2, 3]")
    refused(ckpt, "config.json", "JSON object")


def test_unknown_model_type(ckpt):
    tiny.edit_config(ckpt, model_type="llama_moe_9000")
    refused(ckpt, "config.json", "'llama_moe_9000'", "not supported", "qwen2_moe")


def test_missing_model_type(ckpt):
    tiny.edit_config(ckpt, model_type=None)
    refused(ckpt, "config.json", "model_type", "qwen2_moe")


# ---- 8: sharded checkpoints ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine_sharded(tmp_path_factory):
    folder = tiny.build_qwen2_moe(tmp_path_factory.mktemp("sharded") / "ckpt", seed=1, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    return folder


@pytest.fixture
def sharded(pristine_sharded, tmp_path):
    return shutil.copytree(pristine_sharded, tmp_path / "sharded")


def _index(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())


def test_sharded_copy_loads(sharded):
    load(sharded)


def test_index_lists_missing_shard(sharded):
    shard = sorted(set(_index(sharded)["weight_map"].values()))[1]
    (sharded / shard).unlink()
    refused(sharded, shard, "model.safetensors.index.json", "not in")


def test_index_places_key_in_wrong_shard(sharded):
    index = _index(sharded)
    shards = sorted(set(index["weight_map"].values()))
    actual = index["weight_map"][EXPERT_KEY]
    wrong = next(s for s in shards if s != actual)
    index["weight_map"][EXPERT_KEY] = wrong
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(sharded, "model.safetensors.index.json", EXPERT_KEY, wrong, actual)


def test_index_without_weight_map(sharded):
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    refused(sharded, "model.safetensors.index.json", "weight_map")


def test_key_in_two_shards(sharded):
    index = _index(sharded)
    shards = sorted(set(index["weight_map"].values()))
    other = next(s for s in shards if s != index["weight_map"][Q_KEY])
    rewrite(sharded, lambda t: t.update({Q_KEY: torch.zeros(64, 64)}), name=other)
    refused(sharded, Q_KEY, other, index["weight_map"][Q_KEY])


def test_truncated_shard(sharded):
    shard = sorted(set(_index(sharded)["weight_map"].values()))[0]
    path = sharded / shard
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    refused(sharded, shard, "truncated")


# ---- 9: paths -----------------------------------------------------------------------------------


def test_nonexistent_local_path_never_touches_the_network(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.chdir(tmp_path)

    def no_network(*args, **kwargs):
        raise AssertionError("the Hub was asked for a local path")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    for path in ["./does/not/exist", str(tmp_path / "does" / "not" / "exist"), "does/not/exist"]:
        with pytest.raises(FileNotFoundError) as info:
            load(path)
        assert "does/not/exist" in str(info.value)


def test_file_instead_of_folder(ckpt):
    with pytest.raises(NotADirectoryError, match="config.json"):
        load(ckpt / "model.safetensors")


# ---- 10: fused experts ----------------------------------------------------------------------------


def test_fused_checkpoint_with_misshapen_gate_up(ckpt):
    tiny.fuse_experts(ckpt)
    load(ckpt)
    key = "model.layers.2.mlp.experts.gate_up_proj"

    def shrink(tensors):
        assert tuple(tensors[key].shape) == (8, 64, 64)
        tensors[key] = tensors[key][:, :48].contiguous()

    rewrite(ckpt, shrink)
    refused(ckpt, key, "model.safetensors", "(8, 48, 64)", "(8, 64, 64)")


def test_fused_checkpoint_missing_down_proj(ckpt):
    tiny.fuse_experts(ckpt)
    rewrite(ckpt, lambda t: t.pop("model.layers.0.mlp.experts.down_proj"))
    refused(ckpt, "model.layers.0.mlp.experts.down_proj", "missing")


# ---- 11: tied embeddings ----------------------------------------------------------------------------


def test_tied_checkpoint_with_own_lm_head_uses_it(tmp_path):
    folder = tiny.build_qwen2_moe(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    head = torch.randn(96, 64, generator=torch.Generator().manual_seed(5))
    rewrite(folder, lambda t: t.update({"lm_head.weight": head}))
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    model = load(folder)
    assert model.unembed.weight is not model.embed.weight
    assert torch.equal(model.unembed.weight, head)
    assert not torch.equal(model.embed.weight, head)
    # transformers does the same: its head is the stored one, not the embedding
    from transformers import Qwen2MoeForCausalLM

    reference = Qwen2MoeForCausalLM.from_pretrained(folder)
    assert torch.equal(reference.lm_head.weight, model.unembed.weight)
    assert torch.equal(reference.model.embed_tokens.weight, model.embed.weight)


def test_tied_checkpoint_without_lm_head_shares_embedding(tmp_path):
    folder = tiny.build_qwen2_moe(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(folder / "model.safetensors")
    model = load(folder)
    assert model.unembed.weight is model.embed.weight


# ---- inputs to a loaded model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(pristine):
    return load(pristine)


@pytest.mark.parametrize("text", ["hello", ["hello", "world"]])
def test_text_without_tokenizer(model, text):
    with pytest.raises(ValueError, match="tokenizer"):
        model(text)


def test_to_tokens_without_tokenizer(model):
    with pytest.raises(ValueError, match="tokenizer"):
        model.to_tokens("hello")


@pytest.mark.parametrize("bad, where", [(96, "[1, 3]"), (-1, "[1, 3]"), (10_000, "[1, 3]")])
def test_token_id_out_of_range(model, bad, where):
    tokens = torch.zeros(2, 5, dtype=torch.long)
    tokens[1, 3] = bad
    with pytest.raises(ValueError) as info:
        model(tokens)
    message = str(info.value)
    assert f"token id {bad}" in message and where in message and "96" in message


def test_first_bad_token_is_named(model):
    tokens = torch.tensor([[1, 2, 96, 97]])
    with pytest.raises(ValueError, match=r"token id 96 at \[0, 2\]"):
        model(tokens)
