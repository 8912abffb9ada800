"""tiny-code-moe, the trained embedded default: shipped whole, small, equal to transformers on its own
weights, and genuinely trained (it compresses Python it never saw, from held-out installed packages and the
standard library, clearly better than gzip -9 does)."""

import gzip
import hashlib
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import moelens
from moelens import defaults
from moelens.cli import main

NAME = "tiny-code-moe"
FOLDER = Path(defaults.__file__).parent / NAME
# the record stays in the repository, beside the training script; the package does not ship it
RECORD = json.loads((Path(__file__).resolve().parent.parent / "tools" / "tiny-code-moe" / "training_record.json").read_text())
# what "clearly better than gzip -9" means here: at most this share of gzip's bits, and at most these bits/byte
MARGIN = 0.75
STDLIB_BOUND = 1.7
PACKAGES_BOUND = 1.7


@pytest.fixture(scope="module")
def model():
    return moelens.HookedTransformer.from_pretrained(NAME, progress=False)


def present(root_dirs: list[Path], rel: str, digest: str) -> str | None:
    """The file's text where this interpreter has it byte for byte, else None."""
    for root in root_dirs:
        path = root / rel
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == digest:
            return path.read_text(encoding="utf-8")
    return None


def held_out_python(min_bytes: int = 24_000) -> list[str]:
    """Held-out standard-library files of the record that this interpreter has byte for byte (smallest first,
    until min_bytes); the test is skipped where the standard library differs from the one trained on."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for rel, digest in sorted(RECORD["data"]["held_out_python"].items(), key=lambda kv: (root / kv[0]).stat().st_size if (root / kv[0]).exists() else 0):
        if (root / rel).exists() and (root / rel).stat().st_size < 2_000:
            continue
        text = present([root], rel, digest)
        if text is None:
            continue
        chosen.append(text)
        total += len(chosen[-1].encode())
        if total >= min_bytes:
            return chosen
    pytest.skip(f"this interpreter's standard library differs from Python {RECORD['python']}'s, which the model was trained on")


def held_out_package_files(min_bytes: int = 24_000, sizes: tuple[int, int] = (2_000, 6_000)) -> dict[str, str]:
    """One file from each of the held-out packages (never trained on, whole distributions) that is installed
    here byte for byte, found by the record's sha256: the first of the record's evaluated files within sizes,
    packages in the order of a hash of their name, until min_bytes, so that the sample spans packages. A file
    absent or of another version is passed over; the test is skipped when too few bytes are left."""
    paths = sysconfig.get_paths()
    roots = list(dict.fromkeys(Path(paths[k]) for k in ("purelib", "platlib")))
    packages = RECORD["data"]["held_out_packages"]
    chosen, total = {}, 0
    for name in sorted(packages, key=lambda n: hashlib.sha256(n.encode()).hexdigest()):
        for rel in packages[name]["evaluated"]:
            text = present(roots, rel, packages[name]["files"][rel])
            if text is not None and sizes[0] <= len(text.encode()) <= sizes[1]:
                chosen[name] = text
                total += len(text.encode())
                break
        if total >= min_bytes:
            return chosen
    versions = ", ".join(f"{n} {p['version']}" for n, p in sorted(packages.items()))
    pytest.skip(f"only {total:,} bytes of the held-out packages' files are installed here as trained on ({versions})")


def bits_per_byte(model, texts: list[str]) -> float:
    """Each text preceded by EOS, as in training, in windows of 256 predicted tokens overlapping by one."""
    nats, n_bytes = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = model.to_tokens(text, truncate=False)[0]
            for start in range(0, len(ids) - 1, 256):
                window = ids[start : start + 257][None]
                logits = model(window[:, :-1])
                nats += F.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
            n_bytes += len(text.encode())
    return nats / math.log(2) / n_bytes


def gzip_bits_per_byte(texts: list[str]) -> float:
    """gzip -9 of each text on its own: the oracle the model has to beat."""
    return 8 * sum(len(gzip.compress(t.encode(), 9)) for t in texts) / sum(len(t.encode()) for t in texts)


def test_shipped_files_are_whole_and_small():
    weights = FOLDER / "model.safetensors"
    assert weights.stat().st_size <= 10_000_000
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == RECORD["files"]["model.safetensors"]
    assert hashlib.sha256((FOLDER / "tokenizer.json").read_bytes()).hexdigest() == RECORD["tokenizer_sha256"]
    with safe_open(weights, framework="pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert stored == RECORD["parameters"]
    card = (FOLDER / "MODEL_CARD.md").read_text()
    assert f"{RECORD['parameters']:,}-parameter" in card and f"{RECORD['evaluation']['python_bpb']:.3f}" in card
    for name, package in RECORD["data"]["held_out_packages"].items():
        assert f"{name} {package['version']}" in card
    # the held-out files were not trained on: neither their paths nor their bytes
    assert not set(RECORD["data"]["held_out_python"]) & set(RECORD["data"]["train"])
    held_packages = RECORD["data"]["held_out_packages"]
    assert not set(held_packages) & set(RECORD["data"]["train_packages"])
    assert not {f"site-packages/{rel}" for p in held_packages.values() for rel in p["files"]} & set(RECORD["data"]["train"])
    held_digests = {d for p in held_packages.values() for d in p["files"].values()} | set(RECORD["data"]["held_out_python"].values())
    assert not held_digests & set(RECORD["data"]["train"].values())
    assert not set(RECORD["data"]["held_out_english"]) & set(RECORD["data"]["train"])


def test_it_is_the_default_and_has_every_kind_of_site(model):
    assert defaults.DEFAULT == NAME and not defaults.is_random(NAME)
    assert defaults.default_checkpoint() == FOLDER
    cfg = model.cfg
    assert cfg.family == "qwen2_moe" and cfg.moe_layers == (False, True, True, True)
    names = set(model.hook_dict)
    for site in ("blocks.0.mlp.hook_post", "blocks.1.mlp.hook_router_logits", "blocks.1.mlp.experts.hook_post",
                 "blocks.1.mlp.hook_shared_gate", "blocks.1.mlp.shared_expert.hook_post"):
        assert site in names, site
    assert model.cfg.default_prepend_bos and model.to_tokens("x")[0, 0].item() == model.tokenizer.eos_token_id == 0


def test_logits_equal_transformers_on_its_weights(model):
    transformers = pytest.importorskip("transformers")
    reference = transformers.Qwen2MoeForCausalLM.from_pretrained(FOLDER, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = model.to_tokens("def parse(self, text):\n    return [line.strip() for line in text.splitlines()]\n")
    with torch.no_grad():
        expected = reference(tokens).logits
    assert (model(tokens) - expected).abs().max().item() <= 1e-5


def test_it_compresses_unseen_standard_library_python_clearly_better_than_gzip(model):
    texts = held_out_python()
    model_bits, gzip_bits = bits_per_byte(model, texts), gzip_bits_per_byte(texts)
    assert model_bits <= STDLIB_BOUND and model_bits <= MARGIN * gzip_bits, (model_bits, gzip_bits)


def test_it_compresses_packages_it_never_saw_clearly_better_than_gzip(model):
    """Whole packages were held out (by a hash of their name): this is Python from outside the training
    corpus's style, the case a model that learned one codebase fails."""
    by_package = held_out_package_files()
    texts = list(by_package.values())
    model_bits, gzip_bits = bits_per_byte(model, texts), gzip_bits_per_byte(texts)
    assert model_bits <= PACKAGES_BOUND and model_bits <= MARGIN * gzip_bits, (sorted(by_package), model_bits, gzip_bits)


def test_tokenizer_round_trips_any_text(model):
    text = "Grüße, 世界!\n\tif x >= 0x1F: return None  # ok"
    assert model.to_string(model.to_tokens(text, prepend_bos=False)[0]) == text


def test_inspect_defaults_to_it_and_says_it_is_trained(capsys):
    assert main(["inspect", "--prompt", "import os"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith(f"HookedQwen2Moe from {NAME}: trained weights (embedded default")
    assert f"{RECORD['parameters']:,} parameters" in header


def test_a_damaged_installation_names_the_missing_file(tmp_path, monkeypatch):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    monkeypatch.setattr(defaults, "__file__", str(tmp_path.parent / "__init__.py"))
    monkeypatch.setitem(defaults.TRAINED, NAME, tmp_path.name)
    with pytest.raises(FileNotFoundError, match="model.safetensors missing"):
        defaults.default_checkpoint(NAME)


def test_inspect_and_plan_label_both_parameter_counts(model, capsys):
    """cfg.n_params is TransformerLens's count (the weight matrices, without the embedding, unembedding, norms
    and biases); inspect and plan print it beside the total with embeddings, each labelled. Both by hand from
    the file's tensor shapes."""
    with safe_open(FOLDER / "model.safetensors", framework="pt") as f:
        shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
    total = sum(math.prod(shape) for shape in shapes.values())
    hidden = sum(math.prod(shape) for key, shape in shapes.items()
                 if len(shape) >= 2 and not key.startswith(("model.embed_tokens.", "lm_head.")))
    assert model.cfg.n_params == hidden < total
    assert main(["inspect", "--prompt", "import os"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert f"{total:,} parameters in all (embeddings included; cfg.n_params, TransformerLens's count without " \
           f"embeddings, norms and biases: {hidden:,})" in header
    assert main(["plan", NAME]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(f"{total:,} parameters in all (2.05M, embeddings included)")
    assert lines[2].startswith(f"cfg.n_params {hidden:,} (1.53M): TransformerLens's count")
