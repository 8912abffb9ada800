"""A name goes to the Hub only in a Hub repo id's shape (owner/name): a mistyped embedded default or a path
that does not exist is a FileNotFoundError at once, naming it, with the nearest embedded names."""

import pytest

from moelens import HookedTransformer, plan
from moelens.plan import source as plan_source
from moelens.cli import main
from moelens.loaders import hub
from moelens.locate import is_hub_id, looks_like_path


@pytest.fixture
def hub_calls(monkeypatch):
    """Every request to the Hub, by repo id (each fails: there is no network in tests)."""
    calls = []

    def download(repo_id, *args, **kwargs):
        calls.append(repo_id)
        raise OSError(f"no network for {repo_id}")

    monkeypatch.setattr(hub, "snapshot_download", download)
    monkeypatch.setattr(plan_source, "hf_hub_download", download)
    return calls


NOT_HUB_IDS = ["tiny-code-mo", "tiny-mixtrl", "gpt2", "nonexistent_config.json", "owner/config.json", "./my-model",
               "../my-model", "~/moelens-nowhere/model", "/nowhere/model", "does/not/exist", "owner//name", ""]


@pytest.mark.parametrize("name", NOT_HUB_IDS)
def test_not_a_hub_id_is_not_found_without_asking_the_hub(hub_calls, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as loading:
        HookedTransformer.from_pretrained(name)
    with pytest.raises(FileNotFoundError) as planning:
        plan.plan(name)
    assert hub_calls == []
    for message in (str(loading.value), str(planning.value)):
        assert name in message if name else "the model name is empty" in message


@pytest.mark.parametrize(
    "name, suggested",
    [("tiny-code-mo", ["tiny-code-moe"]), ("tiny-mixtrl", ["tiny-mixtral"]), ("./tiny-deepseek", ["tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-deepseek-v32"]),
     ("tiny-qwen-moe", ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-qwen3.5-moe"])],
)
def test_the_nearest_embedded_names_are_suggested(hub_calls, name, suggested):
    with pytest.raises(FileNotFoundError) as info:
        HookedTransformer.from_pretrained(name)
    shown = " or ".join(repr(n) for n in suggested)
    assert f"did you mean {shown} (embedded default)?" in str(info.value)


def test_a_name_near_no_embedded_default_lists_them(hub_calls):
    listed = r"'gpt2' is not .* Hub repo id \(owner/name\); the embedded defaults are tiny-code-moe, "
    with pytest.raises(FileNotFoundError, match=listed):
        HookedTransformer.from_pretrained("gpt2")


def test_an_owner_name_id_still_goes_to_the_hub(hub_calls):
    with pytest.raises(FileNotFoundError, match="someone/some-moe"):
        HookedTransformer.from_pretrained("someone/some-moe")
    with pytest.raises(FileNotFoundError, match="someone/some-moe"):
        plan.plan("someone/some-moe")
    assert hub_calls and set(hub_calls) == {"someone/some-moe"}


def test_shapes():
    assert is_hub_id("Qwen/Qwen1.5-MoE-A2.7B") and is_hub_id("upstage/Solar-Open-100B")
    assert not any(is_hub_id(n) for n in ["gpt2", "a/b/c", "a//b", "/a", "a/", "a/b c", "a/b--c"])
    assert looks_like_path("./m") and looks_like_path("~/m") and looks_like_path("m.json") and looks_like_path("a/b/c")
    assert not looks_like_path("Qwen/Qwen1.5-MoE-A2.7B") and not looks_like_path("tiny-code-mo")


@pytest.mark.parametrize("command", [["inspect", "tiny-code-mo"], ["plan", "tiny-code-mo"], ["verify", "tiny-code-mo"]])
def test_the_command_says_it_in_one_line(hub_calls, capsys, command):
    pytest.importorskip("transformers")  # verify checks for it first
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'tiny-code-moe'" in err and "Traceback" not in err
    assert hub_calls == []
