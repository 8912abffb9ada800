"""What the ported TransformerLens tests (tests/test_tl_*.py ported from TransformerLensOrg/TransformerLens) share:
the models they run on, the tokenizer oracle, and the rules by which a TL test was ported.

A TL test is ported changing only how its model is built, except where one of these rules applies (each
ported test says which it uses):

- MODEL. TL's tests build solu-1l, solu-2l, attn-only-2l, gpt2-small, tiny-stories-1M or a random
  HookedTransformerConfig model; here an embedded moelens model, never a download: CODE ("tiny-code-moe", the
  trained default: a byte-level BPE tokenizer that prepends a BOS, as solu's does; block 0 a dense gated MLP,
  blocks 1-3 mixtures with a shared expert; 4 query heads over 2 kv heads), or MHA ("tiny-olmoe", 4 query
  heads over 4 kv heads) where a TL test needs TL's one-kv-head-per-head attention.
- TOKENS. Constants of TL's tokenizer (token ids, token strings, d_vocab, IOI names that are single tokens)
  become those of CODE's tokenizer, read from its tokenizer.json with the `tokenizers` library (`oracle`),
  not through moelens; TL's IOI names become words that are single tokens in CODE's vocabulary.
- LAYERS. Block indices are kept, except where the TL test means "the last block(s)" of its smaller model:
  those count from the end (said at the test).
- POS_EMBED. TL's test models have learned absolute position embeddings; a rotary model has no hook_pos_embed
  and no "pos_embed" component, in TransformerLens too (its HookedTransformer creates neither for rotary
  models). An assertion that hook_pos_embed is in a cache reads `== HAS_POS_EMBED` (False), and a
  comparison of pos_embed runs only where HAS_POS_EMBED.
- MIXTURE. A dense MLP's site that a TL test names at a block that is a mixture here (mlp.hook_pre,
  mlp.hook_post) is its per-routing-slot counterpart, mlp.experts.hook_pre / hook_post [batch pos top_k
  d_expert] (TransformerLens's own MoE has no mlp.hook_pre / hook_post either): `mlp_site`.

Differences that are deliberate are not ported away: the TL test stays as it is, marked
`pytest.mark.xfail(strict=True, reason=...)`, and README's "Differences from TransformerLens" has the row.
"""

from __future__ import annotations

import functools
import json

import tokenizers
import torch

from moelens import HookedTransformer, pretrained

CODE = "tiny-code-moe"
MHA = "tiny-olmoe"
HAS_POS_EMBED = False  # every moelens family is rotary


def load(name: str = CODE) -> HookedTransformer:
    return HookedTransformer.from_pretrained(name, progress=False)


@functools.cache
def oracle(name: str = CODE) -> tokenizers.Tokenizer:
    """The checkpoint's own tokenizer.json read by the `tokenizers` library: the reference for token ids."""
    return tokenizers.Tokenizer.from_file(str(pretrained.resolve(name) / "tokenizer.json"))


@functools.cache
def vocab(name: str = CODE) -> dict[str, int]:
    """token string (byte-level form, "Ġ" for a space) -> id, from tokenizer.json."""
    return json.loads((pretrained.resolve(name) / "tokenizer.json").read_text())["model"]["vocab"]


def ids(text: str, name: str = CODE) -> list[int]:
    """text's token ids without special tokens, by the oracle."""
    return oracle(name).encode(text, add_special_tokens=False).ids


def bos_id(name: str = CODE) -> int:
    """The BOS the checkpoint's tokenizer puts first (its post-processor), by the oracle."""
    with_special = oracle(name).encode("a", add_special_tokens=True).ids
    without = ids("a", name)
    assert len(with_special) == len(without) + 1, "this tokenizer prepends no BOS"
    return with_special[0]


def mlp_site(model: HookedTransformer, name: str, layer: int) -> str:
    """TL's dense-MLP site ("pre" or "post") of block `layer`: blocks.L.mlp.hook_<name> on a dense block, the
    per-slot blocks.L.mlp.experts.hook_<name> on a mixture block (the MIXTURE rule)."""
    assert name in ("pre", "post"), name
    return f"blocks.{layer}.mlp.{'experts.' if model.blocks[layer].is_moe else ''}hook_{name}"


def is_expert_view(name: str) -> bool:
    """A per-expert view blocks.L.mlp.experts.E.hook_* ([routed, d_expert]: rows, no batch or pos axis)."""
    parts = name.split(".")
    return len(parts) == 6 and parts[2:4] == ["mlp", "experts"] and parts[4].isdigit()


def batched(name: str) -> bool:
    """names_filter: every site that has a batch axis (all but the per-expert views)."""
    return not is_expert_view(name)


def no_grad(fn):
    """TL's @torch.no_grad on a test function, keeping pytest's view of its signature."""
    return torch.no_grad()(fn)


@functools.cache
def config_json(name: str = CODE) -> dict:
    """The checkpoint's config.json, as written (vocab_size and the like)."""
    return json.loads((pretrained.resolve(name) / "config.json").read_text())
