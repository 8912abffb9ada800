"""from_pretrained's arguments are checked in one place (moelens.load_options), before the name is resolved or
anything read: a bad value is a ValueError or TypeError naming the argument and the value."""

import pytest
import torch

from moelens import HookedTransformer, pretrained
from moelens.load_options import cache_bytes, load_options


@pytest.fixture
def never_resolved(monkeypatch):
    """Fails the test if from_pretrained gets as far as finding the checkpoint."""

    def resolve(*args, **kwargs):
        raise AssertionError("the checkpoint was looked up before the arguments were checked")

    monkeypatch.setattr(pretrained, "resolve", resolve)


def load(**kwargs):
    return HookedTransformer.from_pretrained("tiny-qwen2-moe", **{"progress": False, **kwargs})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1.5, 1e9, True, [1]])
def test_expert_cache_bytes_of_the_wrong_type_is_a_type_error_naming_it(never_resolved, value):
    with pytest.raises(TypeError, match=r"expert_cache_bytes must be an int of bytes >= 0 or a size like '1GB'.*got"):
        load(expert_offload="disk", expert_cache_bytes=value)


@pytest.mark.parametrize("value, message", [(-1, "must be >= 0"), ("lots", "expected a size like"), ("80", "has no unit")])
def test_expert_cache_bytes_out_of_range_or_unreadable(never_resolved, value, message):
    with pytest.raises(ValueError, match=f"expert_cache_bytes.*{message}"):
        load(expert_offload="disk", expert_cache_bytes=value)


def test_expert_cache_bytes_takes_a_size_as_max_memory_does():
    assert cache_bytes("1GB") == 10**9 and cache_bytes("2MiB") == 2 * 2**20 and cache_bytes(0) == 0
    model = load(expert_offload="disk", expert_cache_bytes="1MB")
    assert model.expert_cache.capacity_bytes == 10**6


def test_expert_cache_bytes_is_checked_even_without_offload(never_resolved):
    """The type is checked first; then that it needs expert_offload."""
    with pytest.raises(TypeError, match="expert_cache_bytes"):
        load(expert_cache_bytes=float("nan"))
    with pytest.raises(ValueError, match="needs expert_offload"):
        load(expert_cache_bytes="1GB")


@pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="this machine has a cuda:7")
@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"device": "cuda:7"}, r"device = 'cuda:7'"),
        ({"device_map": {"embed": "cpu", "blocks.0-2": "cuda:7", "ln_final": "cpu", "unembed": "cpu"}},
         r"device_map\['blocks.0-2'\] = 'cuda:7'"),
        ({"device_map": "auto", "max_memory": {"cpu": "1GB", "cuda:7": "80GB"}}, r"max_memory\['cuda:7'\]"),
    ],
)
def test_a_device_this_machine_lacks_is_named(never_resolved, kwargs, named):
    with pytest.raises(ValueError, match=named + r".*this machine has") as info:
        load(**kwargs)
    assert "\n" not in str(info.value)


def test_a_device_map_part_on_meta_is_refused(never_resolved):
    with pytest.raises(ValueError, match=r"device_map\['unembed'\] = 'meta'.*meta device holds none"):
        load(device_map={"embed": "cpu", "blocks.0-2": "cpu", "ln_final": "cpu", "unembed": "meta"})


def test_a_misspelt_device_map_key_is_refused_before_loading(never_resolved):
    with pytest.raises(ValueError, match=r"device_map key 'block.0' is not one of"):
        load(device_map={"embed": "cpu", "block.0": "cpu"})


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"experts_backend": "tritn"}, ValueError, "experts_backend must be one of"),
        ({"fold_ln": "yes"}, TypeError, "fold_ln must be True or False, got 'yes'"),
        ({"check_finite": 0}, TypeError, "check_finite must be True or False, got 0"),
        ({"progress": "no"}, TypeError, "progress must be True or False or None"),
        ({"revision": 3}, TypeError, "revision must be"),
        ({"default_padding_side": "top"}, ValueError, "default_padding_side must be 'left' or 'right'"),
        ({"dtype": "int8"}, ValueError, "dtype 'int8' is not understood"),
        ({"tokenizer": "gpt2"}, TypeError, "a tokenizer must be"),
        ({"expert_parallel": True, "experts_backend": "triton"}, ValueError, "expert_parallel cannot go with experts_backend"),
        ({"cache_dir": "/tmp"}, TypeError, "cache_dir"),
    ],
)
def test_every_argument_is_checked_before_the_checkpoint_is_found(never_resolved, kwargs, error, message):
    with pytest.raises(error, match=message):
        load(**kwargs)


def test_options_in_their_working_form():
    options = load_options("x", dtype="bf16", expert_offload="disk", expert_cache_bytes="3kB", device_map="auto",
                           max_memory={"cpu": "2GB"}, plan_batch=4)
    assert options.dtype == torch.bfloat16 and options.expert_cache_bytes == 3000
    assert options.max_memory == {"cpu": 2 * 10**9} and options.plan_tokens == (4, 2048)
    assert load_options("x", torch_dtype=torch.float16).dtype == torch.float16  # TransformerLens's name wins
