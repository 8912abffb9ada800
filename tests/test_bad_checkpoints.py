"""Bad checkpoints: each is refused with an error naming the file and/or tensor at fault and what was expected."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import moelens
import tiny
from moelens import HookedTransformer
from moelens.defaults import byte_level_tokenizer
from moelens.dtypes import parse_dtype
from moelens.loaders.errors import CheckpointError, CheckpointWarning

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


def test_config_past_16_mib_is_refused_before_it_is_read(ckpt):
    """A config.json of valid JSON padded past 16 MiB loaded (read and parsed whole): refused naming the file and
    its size, from the size alone (a sparse 300 MB one too), and by plan's config reader as well."""
    path = ckpt / "config.json"
    text = json.dumps({**json.loads(path.read_text()), "padding": "x" * 2**24})
    path.write_text(text)
    refused(ckpt, path, f"is {len(text):,} bytes", "at most 16,777,216 bytes")
    with open(path, "r+b") as f:
        f.truncate(300 * 2**20)  # no data written: a read would be what makes it cost 300 MB
    refused(ckpt, path, f"is {300 * 2**20:,} bytes")
    with pytest.raises(CheckpointError, match=f"is {300 * 2**20:,} bytes"):
        moelens.plan.plan(str(path))


def test_config_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2, 3]")
    refused(ckpt, "config.json", "JSON object")


def test_unknown_model_type(ckpt):
    tiny.edit_config(ckpt, model_type="llama_moe_9000")
    refused(ckpt, "config.json", "'llama_moe_9000'", "not supported", "qwen2_moe")


def test_unsupported_quantisation_is_refused_before_reading_weights(ckpt):
    """fp8 and mxfp4 are dequantized at load (tests/test_quantized_checkpoints.py); any other method is refused."""
    tiny.edit_config(ckpt, quantization_config={"quant_method": "gptq", "bits": 4})
    refused(ckpt, "config.json", "quant_method", "'gptq'", "not supported", "'fp8'", "'mxfp4'", "unquantized")


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


# ---- 12: index entries point inside the checkpoint ------------------------------------------------------------


@pytest.mark.parametrize("weight_map", [["model-00001.safetensors"], "model.safetensors", None])
def test_index_weight_map_not_an_object(sharded, weight_map):
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused(sharded, "model.safetensors.index.json", "weight_map", repr(weight_map))


@pytest.mark.parametrize("value", [3, None, ["model-00001-of-00002.safetensors"], {"file": "x"}])
def test_index_weight_map_value_not_a_string(sharded, value):
    index = _index(sharded)
    index["weight_map"][Q_KEY] = value
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(sharded, "model.safetensors.index.json", Q_KEY, repr(value), "strings")


@pytest.mark.parametrize(
    "index_text, why",
    [("[1, 2]", "expected a JSON object, got list"), ("7", "expected a JSON object, got int"),
     ('{"weight_map": ', "not valid JSON"), ("", "not valid JSON")],
)
def test_index_not_a_json_object(sharded, index_text, why):
    (sharded / "model.safetensors.index.json").write_text(index_text)
    refused(sharded, "model.safetensors.index.json", why)


@pytest.fixture
def opened(monkeypatch):
    """The paths safetensors opened during the test."""
    import moelens.loaders.safetensors_files as module

    paths, real = [], module.safe_open

    def spy(path, *args, **kwargs):
        paths.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(module, "safe_open", spy)
    return paths


def _point_shard_elsewhere(sharded, target_name):
    """Move the shard holding Q_KEY out of the folder (a valid file still) and point the index at target_name."""
    index = _index(sharded)
    shard = index["weight_map"][Q_KEY]
    outside = sharded.parent / "outside.safetensors"
    shutil.move(sharded / shard, outside)
    index["weight_map"] = {k: (target_name(outside) if v == shard else v) for k, v in index["weight_map"].items()}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    return outside


@pytest.mark.parametrize("spelling", ["relative", "absolute"])
def test_index_entry_outside_the_folder_is_refused_unopened(sharded, opened, spelling):
    name = (lambda p: "../outside.safetensors") if spelling == "relative" else (lambda p: str(p))
    outside = _point_shard_elsewhere(sharded, name)
    refused(sharded, "model.safetensors.index.json", "outside the checkpoint folder", name(outside))
    assert not any("outside" in p for p in opened)


def test_links_to_weights_elsewhere_load(ckpt):
    """A link is the user's own arrangement (weights on another disk): it is followed. Only a *name* that
    leads out of the folder (an index entry with .. or an absolute path) is refused."""
    outside = ckpt.parent / "elsewhere.safetensors"
    shutil.move(ckpt / "model.safetensors", outside)
    (ckpt / "model.safetensors").symlink_to(outside)
    assert load(ckpt).cfg.n_experts == 8


def test_links_inside_the_folder_and_into_a_hub_blob_store_load(pristine_sharded, tmp_path):
    """The Hub cache keeps a snapshot's files as links to ../../blobs: those are the checkpoint's own."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, path in enumerate(sorted(pristine_sharded.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(path, blob)
        (snapshot / path.name).symlink_to(f"../../blobs/{blob.name}")
    load(snapshot)
    local = tmp_path / "local"
    shutil.copytree(pristine_sharded, local / "real")
    for path in (local / "real").iterdir():
        (local / path.name).symlink_to(f"real/{path.name}")
    load(local)


# ---- 13: weights that are not regular files -------------------------------------------------------------------


LOAD_AND_REPORT = """
import json, sys
from moelens import HookedTransformer
try:
    HookedTransformer.from_pretrained(sys.argv[1], progress=False)
    print(json.dumps(None))
except Exception as err:
    print(json.dumps([type(err).__name__, str(err)]))
"""


def _load_within(folder, seconds=120):
    """Load in a subprocess (a thread would not do: a read blocked in safetensors keeps the GIL) and return
    (error type name, message); fail the test if it is still blocked after `seconds`."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", LOAD_AND_REPORT, str(folder)], capture_output=True, text=True, timeout=seconds
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading {folder} blocked for {seconds} s")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _expect(outcome, *parts):
    assert outcome is not None, "loaded without an error"
    name, message = outcome
    assert name == "CheckpointError", outcome
    for part in parts:
        assert str(part) in message, f"{part!r} not in {message!r}"


def test_fifo_instead_of_safetensors_is_refused_without_blocking(ckpt):
    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")
    _expect(_load_within(ckpt), ckpt / "model.safetensors", "a FIFO", "not a regular file")


def test_fifo_shard_listed_in_the_index_is_refused_without_blocking(sharded):
    shard = _index(sharded)["weight_map"][Q_KEY]
    (sharded / shard).unlink()
    os.mkfifo(sharded / shard)
    _expect(_load_within(sharded), shard, "model.safetensors.index.json", "a FIFO")


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors.index.json"])
def test_fifo_instead_of_a_json_file_is_refused_without_blocking(ckpt, name):
    (ckpt / name).unlink(missing_ok=True)
    os.mkfifo(ckpt / name)
    _expect(_load_within(ckpt), ckpt / name, "a FIFO")


def test_directory_named_safetensors_is_refused(ckpt):
    (ckpt / "extra.safetensors").mkdir()
    refused(ckpt, ckpt / "extra.safetensors", "a directory", "not a regular file")


def test_device_named_safetensors_is_refused_without_blocking(ckpt):
    (ckpt / "model.safetensors").unlink()
    try:
        os.mknod(ckpt / "model.safetensors", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
    except (PermissionError, OSError):
        pytest.skip("cannot make a device node here")
    _expect(_load_within(ckpt), ckpt / "model.safetensors", "a character device")


def test_link_to_a_device_is_refused_without_blocking(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").symlink_to("/dev/zero")
    _expect(_load_within(ckpt), ckpt / "model.safetensors", "/dev/zero")


# ---- 14: tokenizer files ------------------------------------------------------------------------------------------


@pytest.fixture
def with_tokenizer(ckpt):
    byte_level_tokenizer(260, 256, 257).save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    assert load(ckpt).tokenizer.eos_token_id == 256
    return ckpt


@pytest.mark.parametrize(
    "text, why", [("[1, 2]", "expected a JSON object"), ("3", "expected a JSON object"), ('{"eos_token": ', "not valid JSON")]
)
def test_tokenizer_config_not_a_json_object(with_tokenizer, text, why):
    (with_tokenizer / "tokenizer_config.json").write_text(text)
    refused(with_tokenizer, with_tokenizer / "tokenizer_config.json", why)


def test_unparsable_tokenizer_json(with_tokenizer):
    (with_tokenizer / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
    refused(with_tokenizer, with_tokenizer / "tokenizer.json", "cannot read the tokenizer")


@pytest.mark.parametrize("value", ["256", 2.0, True, [], -1])
def test_special_token_id_of_wrong_type(with_tokenizer, value):
    (with_tokenizer / "tokenizer_config.json").write_text("{}")
    tiny.edit_config(with_tokenizer, eos_token_id=value)
    refused(with_tokenizer, "config.json", "eos_token_id", repr(value))


# ---- 15: weights cast or not finite -------------------------------------------------------------------------------


def _checkpoint_warnings(folder, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = HookedTransformer.from_pretrained(folder, progress=False, **kwargs)
    return model, [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


def test_pristine_load_warns_nothing(ckpt):
    assert _checkpoint_warnings(ckpt)[1] == []


@pytest.mark.parametrize("dtype, stored", [(torch.int32, "I32"), (torch.float8_e4m3fn, "F8_E4M3"), (torch.int8, "I8")])
def test_integer_or_float8_weights_are_cast_with_a_warning(ckpt, dtype, stored):
    values = torch.arange(-8, 8).reshape(4, 4).repeat(16, 16).to(dtype)
    rewrite(ckpt, lambda t: t.update({Q_KEY: values}))
    model, caught = _checkpoint_warnings(ckpt)
    assert len(caught) == 1
    for part in (ckpt / "model.safetensors", Q_KEY, stored, "torch.float32"):
        assert str(part) in caught[0]
    assert torch.equal(model.blocks[0].attn.q_proj.weight, values.float())


def test_nan_and_inf_weights_warn(ckpt):
    def poison(tensors):
        tensors[Q_KEY][0, :3] = float("nan")
        tensors[EXPERT_KEY][1, 2] = float("-inf")

    rewrite(ckpt, poison)
    _, caught = _checkpoint_warnings(ckpt)
    assert len(caught) == 1
    message = caught[0]
    assert "2 tensor(s)" in message and "model.safetensors" in message
    assert f"{Q_KEY!r} in model.safetensors: 3 NaN and 0 Inf of 4096" in message
    assert f"{EXPERT_KEY!r} in model.safetensors: 0 NaN and 1 Inf of 2048" in message
    _, caught = _checkpoint_warnings(ckpt, check_finite=False)
    assert caught == []


def test_nan_experts_read_from_disk_warn_as_the_resident_load_does(ckpt):
    """An expert offloaded to disk is checked the first time it is read (here when a forward routes to it),
    with the resident load's warning, once: not loaded silently into NaN logits."""
    rewrite(ckpt, lambda t: t[EXPERT_KEY].__setitem__((1, 2), float("nan")))
    _, resident = _checkpoint_warnings(ckpt)
    assert len(resident) == 1 and f"{EXPERT_KEY!r} in model.safetensors: 1 NaN and 0 Inf" in resident[0]
    to_expert_3 = [("blocks.1.mlp.hook_expert_indices", lambda idx, hook: torch.full_like(idx, 3))]
    tokens = torch.tensor([[1, 2, 3, 4]])
    for check_finite in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = HookedTransformer.from_pretrained(
                ckpt, progress=False, expert_offload="disk", expert_cache_bytes=0, expert_prefetch=False,
                check_finite=check_finite,
            )
            for _ in range(2):  # read twice (a one-expert cache), warned about once
                assert model.run_with_hooks(tokens, fwd_hooks=to_expert_3).isnan().all()
        messages = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
        assert messages == (resident if check_finite else [])


def test_overflow_in_the_cast_warns(ckpt):
    rewrite(ckpt, lambda t: t[Q_KEY].__setitem__((0, 0), 1e6))  # finite as float32, inf as float16
    assert _checkpoint_warnings(ckpt)[1] == []
    _, caught = _checkpoint_warnings(ckpt, dtype=torch.float16)
    assert len(caught) == 1 and "0 NaN and 1 Inf" in caught[0] and "torch.float16" in caught[0]


# ---- 16: dtype and device arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling, dtype",
    [("float32", torch.float32), ("fp32", torch.float32), ("float", torch.float32), ("bfloat16", torch.bfloat16),
     ("bf16", torch.bfloat16), ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16),
     (torch.bfloat16, torch.bfloat16)],
)
def test_dtype_spellings(pristine, spelling, dtype):
    model = HookedTransformer.from_pretrained(pristine, dtype=spelling, progress=False)
    assert model.cfg.dtype == dtype and model.embed.weight.dtype == dtype


@pytest.mark.parametrize("dtype", ["float8", "int8", "bfloat", "", torch.int64, torch.bool, torch.float8_e4m3fn, 32])
def test_unknown_dtype_is_refused_listing_the_spellings(pristine, dtype):
    with pytest.raises(ValueError) as info:
        HookedTransformer.from_pretrained(pristine, dtype=dtype, progress=False)
    message = str(info.value)
    assert str(dtype) in message and "'bf16'" in message and "'float32'" in message and "'half'" in message


def test_parse_dtype():
    assert parse_dtype("BF16") is torch.bfloat16 and parse_dtype("torch.float16") is torch.float16
    assert parse_dtype(torch.float64) is torch.float64


def test_meta_device_builds_the_model_without_reading_weights(pristine, monkeypatch):
    import moelens.loaders.safetensors_files as module

    def no_reads(self, keys):
        raise AssertionError("weights were read for a meta model")

    monkeypatch.setattr(module.SafetensorsFiles, "read", no_reads)
    model = HookedTransformer.from_pretrained(pristine, device="meta", progress=False)
    assert all(p.is_meta for p in model.parameters())
    assert model.cfg.n_experts == 8 and "hook_router_logits" in str(model.support())


def test_meta_device_still_checks_the_checkpoint(ckpt):
    rewrite(ckpt, lambda t: t.update({Q_KEY: torch.zeros(60, 64)}))
    with pytest.raises(CheckpointError, match="60, 64"):
        HookedTransformer.from_pretrained(ckpt, device="meta", progress=False)


def test_meta_device_with_folding_is_refused(pristine):
    with pytest.raises(ValueError, match="meta"):
        HookedTransformer.from_pretrained(pristine, device="meta", fold_ln=True, progress=False)


def test_unknown_device_is_refused(pristine):
    with pytest.raises(ValueError, match="'gpu0'"):
        HookedTransformer.from_pretrained(pristine, device="gpu0", progress=False)
