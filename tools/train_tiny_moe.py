"""Train tiny-code-moe, the trained embedded default, on the Python of the running interpreter's environment.

    python tools/train_tiny_moe.py --out /tmp/tcm-stage1
    python tools/train_tiny_moe.py --out moelens/defaults/tiny-code-moe --steps 700 --init-from /tmp/tcm-stage1 --data-seed 2

The model is a Qwen2-MoE-family checkpoint (a dense first block, then mixture blocks of routed experts with
top-2 routing and a sigmoid-gated shared expert), trained with moelens's own HookedQwen2Moe (torch expert
backend) and written in transformers' checkpoint layout, so moelens and transformers both load it.

Data, read offline from the interpreter's own files:
- Python: the standard library's .py files (test suites, site-packages and build configs left out); every
  20th file by a hash of its relative path is held out for evaluation and for the README's trace.
- Python: every installed distribution's .py files (listed by its RECORD; test suites, vendored copies,
  files over MAX_FILE_BYTES and non-UTF-8 files left out), at most PACKAGE_TRAIN_BYTES per distribution.
  Whole distributions are held out: those whose name (normalized, trailing digits removed, so a numbered
  fork goes with its original) hashes to 0 modulo HELD_OUT_PACKAGE_EVERY.
- English: the prose of pydoc_data's help topics; every 10th topic (sorted by name) is held out.
A training file with the same bytes as a held-out one is dropped. The tokenizer is trained on the training
split only.

Everything is seeded: the same installed files, interpreter version, torch version and thread count give the
same weights. --init-from continues an earlier run on the same data (its tokenizer is checked) with a fresh
optimizer and schedule. The script writes, next to the weights, MODEL_CARD.md (what a person reads) and
training_record.json (the package versions and exact file lists with hashes, the tokenizer's hash, every
setting, the loss curves and the evaluations). For the shipped default (--out moelens/defaults/tiny-code-moe)
the record goes to tools/tiny-code-moe/ instead, beside this script: the package does not ship its 1.1 MB.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import importlib.metadata
import json
import math
import platform
import re
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import moelens
from moelens.families import family_for
from moelens.loaders.checkpoint import expected_keys

EOS, PAD = "<|endoftext|>", "<|pad|>"
SKIPPED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "ensurepip"}
# test suites, and vendored copies of other packages (a held-out package must not come back through them)
PACKAGE_SKIPPED_DIRS = {"test", "tests", "_tests", "testing", "__pycache__", "_vendor", "vendor", "vendored",
                        "_vendored", "extern", "_extern", "_distutils"}
MAX_FILE_BYTES = 200_000  # larger files are mostly generated tables
PACKAGE_TRAIN_BYTES = 500_000  # per training package, so that torch or transformers do not dominate
PACKAGE_EVAL_BYTES = 100_000  # per held-out package evaluated
HELD_OUT_PYTHON_EVERY = 20
HELD_OUT_PACKAGE_EVERY = 8
HELD_OUT_TOPIC_EVERY = 10

CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "vocab_size": 4096,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 96,
    "shared_expert_intermediate_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": False,
    "mlp_only_layers": [0],
    "qkv_bias": True,
    "router_aux_loss_coef": 0.01,
    "output_router_logits": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 1,
    "dtype": "float32",
}


@dataclass(frozen=True)
class Settings:
    seed: int = 0
    data_seed: int = 1  # draws the training windows; a continuation run takes another one
    steps: int = 500
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01  # Switch-style load balancing over the mixture blocks, as transformers' Qwen2-MoE
    threads: int = 1  # one thread: as fast per core, and the run cannot stall on a busy second core


# ---- data --------------------------------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def python_files(root: Path) -> list[Path]:
    """The standard library's .py files, test suites, site-packages and build configs left out."""
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIPPED_DIRS & set(rel.parts[:-1]) or rel.parts[0].startswith("config-") or rel.parts[0] == "pydoc_data":
            continue
        files.append(path)
    return files


def hash_int(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest(), 16)


def held_out(rel: str) -> bool:
    return hash_int(rel) % HELD_OUT_PYTHON_EVERY == 0


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def package_group(name: str) -> str:
    """Forks published under a numbered name (httpx2 of httpx) share their original's group, so that a held-out
    package is not trained on through its fork."""
    return normalized(name).rstrip("0123456789") or normalized(name)


def held_out_package(name: str) -> bool:
    return hash_int(package_group(name)) % HELD_OUT_PACKAGE_EVERY == 0


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:  # some files are in legacy encodings: leave them out, recorded
        return None


def topics(root: Path) -> dict[str, str]:
    """pydoc_data's help topics (English prose), read without importing: topics.py is one dict literal."""
    tree = ast.parse((root / "pydoc_data" / "topics.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics":
            return dict(ast.literal_eval(node.value))
    raise RuntimeError("pydoc_data/topics.py has no `topics = {...}`")


@dataclass
class Package:
    """One installed distribution's Python: every eligible file (path relative to site-packages, text)."""

    name: str
    version: str
    files: list[tuple[str, str]]

    def selection(self, cap: int) -> list[tuple[str, str]]:
        """Files in the order of a hash of their path, until cap bytes: a deterministic sample of the package
        that no single package can make large."""
        chosen, total = [], 0
        for rel, text in sorted(self.files, key=lambda f: hashlib.sha256(f[0].encode()).hexdigest()):
            if total >= cap:
                break
            chosen.append((rel, text))
            total += len(text.encode())
        return chosen


def installed_packages(root: Path, left_out: list[str]) -> list[Package]:
    """Every distribution installed in site-packages (this project excepted) with the .py files its RECORD
    lists under root: files over MAX_FILE_BYTES, not UTF-8 or blank, in test suites, vendored copies or
    caches are left out (their paths go to left_out)."""
    packages: dict[str, Package] = {}
    for dist in importlib.metadata.distributions(path=[str(root)]):
        name = normalized(dist.metadata["Name"])
        if name in packages or name == "moelens":
            continue
        files = []
        for entry in sorted(str(f) for f in dist.files or ()):
            path = (root / entry).resolve()
            if not entry.endswith(".py") or entry.startswith("..") or not path.is_file():
                continue
            rel = Path(entry)
            if PACKAGE_SKIPPED_DIRS & set(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
                left_out.append(f"{name}: {entry}")
                continue
            text = read_text(path)
            if text is None or not text.strip():
                left_out.append(f"{name}: {entry}")
                continue
            files.append((rel.as_posix(), text))
        if files:
            packages[name] = Package(name, dist.version, files)
    return [packages[n] for n in sorted(packages)]


@dataclass
class Corpus:
    train: list[tuple[str, str]]  # (name, text)
    python_eval: list[tuple[str, str]]  # held-out standard-library files
    packages_eval: dict[str, list[tuple[str, str]]]  # held-out package -> its evaluated files
    english_eval: list[tuple[str, str]]
    train_packages: list[Package]
    held_out_packages: list[Package]
    unreadable: list[str]
    duplicates: list[str]


def corpus(stdlib: Path, site: Path) -> Corpus:
    train, python_eval, unreadable = [], [], []
    for path in python_files(stdlib):
        rel = path.relative_to(stdlib).as_posix()
        text = read_text(path) if path.stat().st_size <= MAX_FILE_BYTES else None
        if text is None or not text.strip():
            unreadable.append(rel)
            continue
        (python_eval if held_out(rel) else train).append((rel, text))
    packages = installed_packages(site, unreadable)
    train_packages = [p for p in packages if not held_out_package(p.name)]
    held_packages = [p for p in packages if held_out_package(p.name)]
    for package in train_packages:
        train.extend((f"site-packages/{rel}", text) for rel, text in package.selection(PACKAGE_TRAIN_BYTES))
    english_eval = []
    for i, (name, text) in enumerate(sorted(topics(stdlib).items())):
        (english_eval if i % HELD_OUT_TOPIC_EVERY == 0 else train).append((f"pydoc_data/topics.py:{name}", text))
    # a file with the same bytes as a held-out file, or as an earlier training file, is not trained on
    seen = {sha256(t.encode()) for _, t in python_eval} | {sha256(t.encode()) for p in held_packages for _, t in p.files}
    kept, duplicates = [], []
    for name, text in train:
        digest = sha256(text.encode())
        if digest in seen:
            duplicates.append(name)
        else:
            seen.add(digest)
            kept.append((name, text))
    packages_eval = {p.name: p.selection(PACKAGE_EVAL_BYTES) for p in held_packages}
    return Corpus(kept, python_eval, packages_eval, english_eval, train_packages, held_packages, unreadable, duplicates)


# ---- tokenizer ---------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): any text round-trips. Specials first, so EOS is 0 and PAD is 1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # encoding puts EOS first, as every training document starts: moelens's default_prepend_bos is then True
    tok.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, 0)])
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(PAD) == 1 and tok.get_vocab_size() == vocab_size
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents, each preceded by EOS (the model's start-of-document token), as one int64 tensor."""
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(0)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int64)


# ---- model -------------------------------------------------------------------------------------------------
def new_model(seed: int):
    family = family_for(CONFIG["model_type"])
    cfg = family.config_from_hf(CONFIG)
    model = family(cfg)
    init_weights(model, seed, cfg.n_layers)
    return model


def init_weights(model: torch.nn.Module, seed: int, n_layers: int) -> None:
    """GPT-2 style: N(0, 0.02) matrices, output projections scaled down by sqrt(2 * n_layers), unit norms,
    zero biases. Parameters are visited by name in sorted order, so the draw does not depend on module order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1 and name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.fill_(1.0)
            elif p.ndim == 1:
                p.zero_()
            else:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight", "W_down")) else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The model's parameters under transformers' keys (the inverse of moelens's loader key map)."""
    family = type(model)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    tensors = {}
    for key, target in expected_keys(family.site_map(model.cfg)).items():
        tensors[key] = params[target.param][target.index].detach().clone().contiguous()
    return tensors


def load_weights(model, weights: Path) -> str:
    """Start from a checkpoint this script wrote (the model's parameters under transformers' keys); returns
    its sha256. Every key is required and every parameter is set: reading the tensors back gives the file."""
    stored = load_file(weights)
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    keys = expected_keys(type(model).site_map(model.cfg))
    if set(stored) != set(keys):
        raise ValueError(f"{weights}: keys differ from this model's: missing {sorted(set(keys) - set(stored))[:5]}, "
                         f"unexpected {sorted(set(stored) - set(keys))[:5]}")
    with torch.no_grad():
        for key, target in keys.items():
            slot = params[target.param][target.index]
            if slot.shape != stored[key].shape or stored[key].dtype != slot.dtype:
                raise ValueError(f"{weights}: {key} is {tuple(stored[key].shape)} {stored[key].dtype}, expected {tuple(slot.shape)} {slot.dtype}")
            slot.copy_(stored[key])
    back = checkpoint_tensors(model)
    assert all(torch.equal(back[k], stored[k]) for k in keys), "a parameter was not loaded"
    return sha256(weights.read_bytes())


# ---- training ----------------------------------------------------------------------------------------------
class RouterCapture:
    """Permanent hooks that keep each mixture block's router logits and chosen experts (with their graph)."""

    def __init__(self, model) -> None:
        self.logits: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        for layer, is_moe in enumerate(model.cfg.moe_layers):
            if is_moe:
                model.add_perma_hook(f"blocks.{layer}.mlp.hook_router_logits", self._keep(self.logits))
                model.add_perma_hook(f"blocks.{layer}.mlp.hook_expert_indices", self._keep(self.indices))

    @staticmethod
    def _keep(into: list):
        def hook(t, hook):
            into.append(t)

        return hook

    def take(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        out = (self.logits[:], self.indices[:])
        self.logits.clear()
        self.indices.clear()
        return out


def load_balancing_loss(logits: list[torch.Tensor], indices: list[torch.Tensor], n_experts: int) -> torch.Tensor:
    """Switch Transformer's n_experts * sum_e f_e * P_e per mixture block (f_e: share of routing slots sent
    to e, P_e: mean router probability of e), averaged over blocks; 1.0 when perfectly balanced."""
    terms = []
    for lg, idx in zip(logits, indices):
        probs = lg.float().softmax(-1).reshape(-1, n_experts)
        share = F.one_hot(idx.reshape(-1), n_experts).float().mean(0)
        terms.append(n_experts * (share * probs.mean(0)).sum())
    return torch.stack(terms).mean()


def lr_at(step: int, s: Settings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, stream: torch.Tensor, s: Settings, log) -> list[dict]:
    gen = torch.Generator().manual_seed(s.data_seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
    capture = RouterCapture(model)
    curve, started = [], time.time()
    model.train()
    for step in range(s.steps):
        starts = torch.randint(0, len(stream) - s.seq_len - 1, (s.batch,), generator=gen)
        windows = torch.stack([stream[i : i + s.seq_len + 1] for i in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        logits = model(windows[:, :-1])
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
        aux = load_balancing_loss(*capture.take(), model.cfg.n_experts)
        loss = lm + s.aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        if step % 50 == 0 or step == 20 or step == s.steps - 1:
            row = {"step": step, "loss": round(lm.item(), 4), "aux": round(aux.item(), 4), "seconds": round(time.time() - started, 1)}
            curve.append(row)
            log(row)
    model.reset_hooks(including_permanent=True)
    model.eval()
    return curve


# ---- evaluation --------------------------------------------------------------------------------------------
@torch.no_grad()
def bits_per_byte(model, tok: Tokenizer, docs: list[tuple[str, str]], seq_len: int) -> float:
    """Each document preceded by EOS and cut into windows that overlap by one token, so every token of the
    document is predicted exactly once from the tokens before it in its window; nats summed, divided by
    ln 2 times the document's UTF-8 bytes."""
    nats, n_bytes = 0.0, 0
    for _, text in docs:
        ids = [0] + tok.encode(text, add_special_tokens=False).ids
        for start in range(0, len(ids) - 1, seq_len):
            window = torch.tensor(ids[start : start + seq_len + 1])[None]
            logits = model(window[:, :-1])
            nats += F.cross_entropy(logits[0].float(), window[0, 1:], reduction="sum").item()
        n_bytes += len(text.encode("utf-8"))
    return nats / math.log(2) / n_bytes


def gzip_bits_per_byte(docs: list[tuple[str, str]]) -> float:
    """gzip -9 of each document on its own: the compressor baseline on the same text."""
    raw = [text.encode("utf-8") for _, text in docs]
    return 8 * sum(len(gzip.compress(b, 9)) for b in raw) / sum(len(b) for b in raw)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- output ------------------------------------------------------------------------------------------------
TOOLS = Path(__file__).resolve().parent
SHIPPED = TOOLS.parent / "moelens" / "defaults" / "tiny-code-moe"


def record_path(out: Path) -> Path:
    """Where a checkpoint folder's training record is: beside its weights, or, for the default the package
    ships, in the repository's tools/tiny-code-moe/ (kept out of the package)."""
    if out.resolve() == SHIPPED:
        return TOOLS / "tiny-code-moe" / "training_record.json"
    return out / "training_record.json"


def write(out: Path, model, tok: Tokenizer, record: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(model), out / "model.safetensors", metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    record["tokenizer_sha256"] = record["files"]["tokenizer.json"] = sha256((out / "tokenizer.json").read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": EOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    record["files"]["model.safetensors"] = sha256((out / "model.safetensors").read_bytes())
    record_path(out).parent.mkdir(parents=True, exist_ok=True)
    record_path(out).write_text(json.dumps(record, indent=1) + "\n")
    (out / "MODEL_CARD.md").write_text(model_card(record))


def model_card(r: dict) -> str:
    e, s, c, d = r["evaluation"], r["settings"], r["config"], r["data"]
    package_rows = "\n".join(
        f"| {name} {d['held_out_packages'][name]['version']} | {v['files']} | {v['bytes']:,} | {v['bpb']:.3f} | {v['gzip_bpb']:.3f} |"
        for name, v in e["packages"].items()
    )
    trained_on = ", ".join(f"{n} {v}" for n, v in d["train_packages"].items())
    runs, run = [], r
    while run:  # this run, then the runs it continued, earliest last
        runs.append(run)
        run = run.get("init_from")
    runs.reverse()
    steps = sum(run["settings"]["steps"] for run in runs)
    seconds = sum(run["training_seconds"] for run in runs)
    continued = "" if len(runs) == 1 else (
        f" In {len(runs)} runs of the script, each after the first started from the previous one's weights "
        f"(`--init-from`) with a fresh optimizer and schedule and its own draw of windows: "
        + " then ".join(f"{run['settings']['steps']} steps (data seed {run['settings'].get('data_seed', 1)})" for run in runs) + "."
    )
    return f"""# tiny-code-moe

A {r['parameters']:,}-parameter Qwen2-MoE-family model (model_type `qwen2_moe`), trained by
`tools/train_tiny_moe.py` on Python's standard library ({r['python']}) and the Python of
{len(d['train_packages'])} installed packages. It is moelens's trained embedded default, so that
`moelens inspect` and `moelens trace` show routing that means something.

- **Architecture.** {c['num_hidden_layers']} blocks, d_model {c['hidden_size']}, {c['num_attention_heads']} heads
  ({c['num_key_value_heads']} key/value heads). Block 0 is dense (width {c['intermediate_size']}). Blocks 1 to
  {c['num_hidden_layers'] - 1} are mixtures of {c['num_experts']} routed experts (width {c['moe_intermediate_size']},
  top-{c['num_experts_per_tok']}) plus a sigmoid-gated shared expert (width {c['shared_expert_intermediate_size']}).
  Embeddings are tied; weights are float32.
- **Tokenizer.** Byte-level BPE with {c['vocab_size']} tokens, trained by the same script on the training
  text only (`tokenizers`). `{EOS}` (id 0) starts every document; `{PAD}` is id 1.
  sha256 of tokenizer.json: `{r['tokenizer_sha256']}`.
- **Training.** {steps} steps of {s['batch']} x {s['seq_len']} tokens ({steps * s['batch'] * s['seq_len']:,} tokens,
  {steps * s['batch'] * s['seq_len'] / r['training_tokens']:.2f} of a pass over the {r['training_tokens']:,} training tokens).{continued}
  AdamW: lr {s['lr']}, warmup {s['warmup']} steps, cosine decay to {s['min_lr_ratio']} of the peak, weight decay
  {s['weight_decay']}. Load-balancing loss weight {s['aux_loss_coef']}. Seed {s['seed']}.
  Run with torch {r['torch']} on {s['threads']} CPU thread(s) ({r['machine']}) in {seconds:.0f} s.
  Training loss on the last batch: {r['curve'][-1]['loss']} nats/token; its load balance {r['curve'][-1]['aux']} (1.0 is perfectly even).
- **Training text.** {d['train_files']} standard-library .py files ({d['train_python_bytes']:,} bytes),
  {d['train_package_files']} .py files of {len(d['train_packages'])} installed packages ({d['train_package_bytes']:,} bytes:
  at most {d['rules']['package_train_bytes']:,} bytes per package, files taken in the order of a hash of their path)
  and {d['train_topics']} pydoc help topics ({d['train_english_bytes']:,} bytes). Left out: test suites, vendored
  copies of other packages, files over {d['rules']['max_file_bytes']:,} bytes or not UTF-8, lib2to3, ensurepip,
  build configs, and any file with the same bytes as a held-out file.
  Packages trained on: {trained_on}.

## What was held out

- **Whole packages**: every installed distribution whose group (the normalized name with trailing digits
  removed, so that a fork such as httpx2 goes with httpx) has a sha256 that is 0 modulo {HELD_OUT_PACKAGE_EVERY}.
  None of their files was trained on; at most {d['rules']['package_eval_bytes']:,} bytes of each (same hash order)
  are evaluated.
- **Standard library**: every {HELD_OUT_PYTHON_EVERY}th file by a hash of its path ({e['python_files']} files).
- **English**: every {HELD_OUT_TOPIC_EVERY}th pydoc help topic by name ({e['english_topics']} topics).

## Evaluation on text it did not see

| held-out package | files | bytes | tiny-code-moe bits/byte | gzip -9 bits/byte |
|---|---|---|---|---|
{package_rows}
| **all held-out packages** | {e['packages_files']} | {e['packages_bytes']:,} | **{e['packages_bpb']:.3f}** | {e['packages_gzip_bpb']:.3f} |

| held-out text | bytes | tiny-code-moe bits/byte | gzip -9 bits/byte |
|---|---|---|---|
| Python: every {HELD_OUT_PYTHON_EVERY}th stdlib file by path hash ({e['python_files']} files) | {e['python_bytes']:,} | {e['python_bpb']:.3f} | {e['python_gzip_bpb']:.3f} |
| English: every {HELD_OUT_TOPIC_EVERY}th pydoc topic ({e['english_topics']} topics) | {e['english_bytes']:,} | {e['english_bpb']:.3f} | {e['english_gzip_bpb']:.3f} |

gzip compresses each file on its own; the model reads each file from its start, in windows of
{s['seq_len']} tokens. `training_record.json` (for the shipped default, in the repository's
tools/tiny-code-moe/, not in the package) holds the exact file lists (with the sha256 of each file, the
package versions), every setting and the loss curve.
"""


def continuation_of(folder: Path, tok: Tokenizer) -> dict:
    """What a continuation starts from: the earlier run's record (settings, curve, time); its tokenizer must be
    the one this run trained, byte for byte, or the token ids would mean other things."""
    record = json.loads(record_path(folder).read_text())
    if tok.to_str() != Tokenizer.from_file(str(folder / "tokenizer.json")).to_str():
        raise ValueError(f"{folder / 'tokenizer.json'} differs from the tokenizer trained on this data: continue only "
                         "a run on the same installed packages and standard library")
    return {"folder": str(folder), "command": record["command"], "settings": record["settings"],
            "training_seconds": record["training_seconds"], "curve": record["curve"],
            "init_from": record.get("init_from")}


def python_bytes(docs: list[tuple[str, str]]) -> int:
    return sum(len(t.encode()) for _, t in docs)


def evaluate(model, tok: Tokenizer, data: Corpus, seq_len: int) -> dict:
    """bits/byte of the model and of gzip -9 on each held-out set: each held-out package, all of them
    together, the held-out standard-library files and the held-out help topics."""
    packages = {}
    for name, docs in data.packages_eval.items():
        packages[name] = {"files": len(docs), "bytes": python_bytes(docs),
                          "bpb": bits_per_byte(model, tok, docs, seq_len), "gzip_bpb": gzip_bits_per_byte(docs)}
        print(json.dumps({name: packages[name]}), flush=True)
    all_package_docs = [d for docs in data.packages_eval.values() for d in docs]
    total_bytes = python_bytes(all_package_docs)
    return {
        "packages": packages,
        "packages_files": len(all_package_docs),
        "packages_bytes": total_bytes,
        # the pooled figure: every evaluated byte counts once, whichever package it is in
        "packages_bpb": sum(v["bpb"] * v["bytes"] for v in packages.values()) / total_bytes,
        "packages_gzip_bpb": gzip_bits_per_byte(all_package_docs),
        "python_files": len(data.python_eval),
        "python_bytes": python_bytes(data.python_eval),
        "python_bpb": bits_per_byte(model, tok, data.python_eval, seq_len),
        "python_gzip_bpb": gzip_bits_per_byte(data.python_eval),
        "english_topics": len(data.english_eval),
        "english_bytes": python_bytes(data.english_eval),
        "english_bpb": bits_per_byte(model, tok, data.english_eval, seq_len),
        "english_gzip_bpb": gzip_bits_per_byte(data.english_eval),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the checkpoint into")
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--init-from", type=Path, help="continue from a checkpoint folder this script wrote on the same "
                        "data (same tokenizer, checked), with a fresh optimizer and schedule")
    parser.add_argument("--data-seed", type=int, default=Settings.data_seed, help="seed of the training windows' draw")
    args = parser.parse_args(argv)
    s = Settings(steps=args.steps, data_seed=args.data_seed)
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    root, site = stdlib_root(), site_packages()
    data = corpus(root, site)
    print(f"{len(data.train)} training documents ({python_bytes(data.train):,} bytes) from the standard library and "
          f"{len(data.train_packages)} packages; held out: {len(data.python_eval)} standard-library files, "
          f"{len(data.held_out_packages)} packages ({', '.join(p.name for p in data.held_out_packages)}), "
          f"{len(data.english_eval)} topics; {len(data.unreadable)} files left out, {len(data.duplicates)} duplicates", flush=True)
    tok = train_tokenizer([t for _, t in data.train], CONFIG["vocab_size"])
    stream = token_stream(tok, [t for _, t in data.train])
    train_bytes = python_bytes(data.train)
    print(f"{len(stream):,} training tokens ({train_bytes / len(stream):.2f} bytes/token)", flush=True)

    model = new_model(s.seed)
    init_from = None
    if args.init_from is not None:
        init_from = continuation_of(args.init_from, tok)
        init_from["model.safetensors"] = load_weights(model, args.init_from / "model.safetensors")
    model.set_experts_backend("torch")
    started = time.time()
    curve = train(model, stream, s, lambda row: print(json.dumps(row), flush=True))
    seconds = time.time() - started

    evaluation = evaluate(model, tok, data, s.seq_len)
    print(json.dumps({k: v for k, v in evaluation.items() if k != "packages"}), flush=True)
    is_stdlib = lambda n: not n.startswith(("pydoc_data/", "site-packages/"))
    is_package = lambda n: n.startswith("site-packages/")
    is_english = lambda n: n.startswith("pydoc_data/")
    record = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "moelens": moelens.__version__ if hasattr(moelens, "__version__") else "",
        "machine": f"{platform.machine()}, {platform.system()}",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "settings": asdict(s),
        "config": CONFIG,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_sha256": "",  # of tokenizer.json as written
        "training_tokens": len(stream),
        "training_seconds": seconds,
        "init_from": init_from,  # the run this one continues (its settings, curve and weights' sha256), or None
        "curve": curve,
        "evaluation": evaluation,
        "data": {
            "stdlib": str(root),
            "site_packages": str(site),
            "rules": {
                "held_out_stdlib": f"sha256 of the path relative to the standard library, as an integer, % {HELD_OUT_PYTHON_EVERY} == 0",
                "held_out_packages": f"sha256 of the package group (the normalized distribution name, trailing digits removed) % {HELD_OUT_PACKAGE_EVERY} == 0",
                "held_out_english": f"every {HELD_OUT_TOPIC_EVERY}th pydoc topic by name, from the first",
                "package_train_bytes": PACKAGE_TRAIN_BYTES,
                "package_eval_bytes": PACKAGE_EVAL_BYTES,
                "max_file_bytes": MAX_FILE_BYTES,
                "package_skipped_dirs": sorted(PACKAGE_SKIPPED_DIRS),
                "stdlib_skipped_dirs": sorted(SKIPPED_DIRS),
            },
            "train_files": sum(is_stdlib(n) for n, _ in data.train),
            "train_package_files": sum(is_package(n) for n, _ in data.train),
            "train_topics": sum(is_english(n) for n, _ in data.train),
            "train_python_bytes": sum(len(t.encode()) for n, t in data.train if is_stdlib(n)),
            "train_package_bytes": sum(len(t.encode()) for n, t in data.train if is_package(n)),
            "train_english_bytes": sum(len(t.encode()) for n, t in data.train if is_english(n)),
            "train_packages": {p.name: p.version for p in data.train_packages},
            "train": {n: sha256(t.encode()) for n, t in data.train},
            "held_out_python": {n: sha256(t.encode()) for n, t in data.python_eval},
            "held_out_packages": {
                p.name: {"version": p.version, "files": {rel: sha256(t.encode()) for rel, t in p.files},
                         "evaluated": [rel for rel, _ in data.packages_eval[p.name]]}
                for p in data.held_out_packages
            },
            "held_out_english": {n: sha256(t.encode()) for n, t in data.english_eval},
            "left_out": data.unreadable,
            "left_out_duplicates": data.duplicates,
        },
        "files": {},
    }
    write(args.out, model, tok, record)
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
