"""TransformerLens-style helpers for code written against its `utils` module."""

from __future__ import annotations

import re

import torch

from moelens.names import SITES, alias_candidates, site_pattern

# TransformerLens's shorthands, applied before anything else (so TL code gets TL's names).
_ACT_NAME_ALIAS = {
    "attn": "pattern",
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
    "mlp_pre": "pre",
    "mlp_mid": "mid",
    "mlp_post": "post",
}
_LAYER_TYPE_ALIAS = {"a": "attn", "m": "mlp", "b": "", "block": "", "blocks": "", "attention": "attn"}
_ATTN_NAMES = ("k", "v", "q", "z", "rot_k", "rot_q", "result", "pattern", "attn_scores")
_MLP_NAMES = ("pre", "post", "mid", "pre_linear")
_LN_NAMES = ("scale", "normalized")
_COMPACT = re.compile(r"([a-z]+)(\d+)([a-z]?.*)")  # "k6", "scale4ln1", "pre5"

# Every site a name may denote: moelens's own and TransformerLens's (which moelens may not emit).
_KNOWN_SITES = frozenset(s.name for s in SITES) | {
    "hook_tokens",
    "hook_pos_embed",
    "blocks.L.hook_attn_in",
    "blocks.L.hook_q_input",
    "blocks.L.hook_k_input",
    "blocks.L.hook_v_input",
    "blocks.L.hook_mlp_in",
    "blocks.L.attn.hook_result",
    "blocks.L.mlp.hook_mid",
    "blocks.L.ln1.hook_scale",
    "blocks.L.ln1.hook_normalized",
    "blocks.L.ln2.hook_scale",
    "blocks.L.ln2.hook_normalized",
    "ln_final.hook_scale",
    "ln_final.hook_normalized",
}


def _is_site(full_name: str, layer) -> bool:
    pattern = re.sub(r"^blocks\.[^.]+\.", "blocks.L.", full_name)
    if pattern in _KNOWN_SITES or site_pattern(full_name) in _KNOWN_SITES:
        return True
    # Without a layer TransformerLens returns a per-block site's tail (get_act_name("resid_pre") ->
    # "hook_resid_pre", handy with name.endswith): accept it where some block site ends so.
    return layer is None and any(s.startswith("blocks.L.") and s[len("blocks.L."):] == full_name for s in _KNOWN_SITES)


def get_act_name(name: str, layer: int | str | None = None, layer_type: str | None = None) -> str:
    """Full hook name of a shorthand, by TransformerLens's rules (transformer_lens.utils.get_act_name):

    get_act_name('k', 6, 'a') == 'blocks.6.attn.hook_k'; get_act_name('pre', 2) == 'blocks.2.mlp.hook_pre';
    get_act_name('embed') == 'hook_embed'; get_act_name('normalized', 27, 'ln2') == 'blocks.27.ln2.hook_normalized';
    get_act_name('k6') == 'blocks.6.attn.hook_k'; get_act_name('scale4ln1') == 'blocks.4.ln1.hook_scale';
    get_act_name('pre5') == 'blocks.5.mlp.hook_pre'; get_act_name('scale') == 'ln_final.hook_scale'.

    A full name (with a '.' or starting 'hook_') given without layer and layer_type comes back as it is. A
    compact "<name><layer><layer_type>" is split on its first digits. Aliases: attn -> pattern, attn_logits ->
    attn_scores, key/query/value -> k/q/v, mlp_pre/mlp_mid/mlp_post -> pre/mid/post. Attention names (k, q, v,
    z, rot_k, rot_q, result, pattern, attn_scores) always go to 'attn', MLP names (pre, post, mid, pre_linear)
    to 'mlp'; layer types a/attention -> attn, m -> mlp, b/block/blocks -> none. scale/normalized without a
    layer are ln_final's. The layer number is not checked and no model is needed.

    moelens's own names, where the rules above name no site, resolve as cache keys do: ('router_logits', 0)
    -> 'blocks.0.mlp.hook_router_logits', ('layer_output', 2) -> 'blocks.2.hook_resid_post',
    ('expert_post', 1) -> 'blocks.1.mlp.experts.hook_post' (for "mlp_neurons", the dense MLP's site).

    Raises ValueError where the result can be no hook (unknown name or layer type, or a per-block moelens
    name without a layer).
    """
    if ("." in name or name.startswith("hook_")) and layer is None and layer_type is None:
        return name
    given_name, given_layer_type = name, layer_type
    match = _COMPACT.match(name)
    if match is not None:
        name, layer, layer_type = match.groups(0)
    name = _ACT_NAME_ALIAS.get(name, name)
    if name in _ATTN_NAMES:
        layer_type = "attn"
    elif name in _MLP_NAMES:
        layer_type = "mlp"
    elif layer_type in _LAYER_TYPE_ALIAS:
        layer_type = _LAYER_TYPE_ALIAS[layer_type]
    full = f"blocks.{layer}." if layer is not None else ""
    full += (f"{layer_type}." if layer_type else "") + f"hook_{name}"
    if name in _LN_NAMES and layer is None:
        full = f"ln_final.{full}"
    if _is_site(full, layer):
        return full
    if match is None and not given_layer_type:
        # moelens aliases (router_logits, expert_post, the family notes' standard names, ...)
        try:
            candidate = alias_candidates(given_name, layer)[0]
        except KeyError as err:
            raise ValueError(f"get_act_name({given_name!r}): {err.args[0]}") from None
        if candidate != given_name:
            return candidate
    raise ValueError(
        f"get_act_name({given_name!r}, {layer!r}, {given_layer_type!r}) -> {full!r} names no hook site"
        + (f" (unknown layer type {layer_type!r})" if layer_type and layer_type not in ("attn", "mlp", "ln1", "ln2") else "")
    )


def get_attention_mask(
    tokenizer, tokens: torch.Tensor, prepend_bos: bool, padding_side: str | None = None
) -> torch.Tensor:
    """TransformerLens's utils.get_attention_mask: 1 for real tokens, 0 for padding [batch pos].

    Only the padding at the padded end counts: the trailing pad tokens (padding_side "right") or the leading
    ones ("left"; None: tokenizer.padding_side); pad tokens elsewhere stay real. On the left, with prepend_bos
    and a BOS that is the pad token, each row's last leading "pad" is its BOS, a real token. Without a
    tokenizer every token is real."""
    mask = torch.ones_like(tokens)
    if tokenizer is None:
        return mask
    side = padding_side if padding_side is not None else tokenizer.padding_side
    real = tokens.ne(tokenizer.pad_token_id).long()
    if side == "right":
        mask[real.flip(-1).cumsum(-1).flip(-1) == 0] = 0
        return mask
    leading = real.cumsum(-1) == 0
    mask[leading] = 0
    if prepend_bos and tokenizer.bos_token_id == tokenizer.pad_token_id:
        rows = leading.any(-1).nonzero().flatten()
        mask[rows, leading[rows].sum(-1) - 1] = 1
    return mask


def test_prompt(
    prompt: str,
    answer: str | list[str],
    model,
    prepend_space_to_answer: bool = True,
    print_details: bool = True,
    prepend_bos: bool | None = None,
    top_k: int = 10,
) -> None:
    """Print how well the model predicts `answer` after `prompt` (TransformerLens's utils.test_prompt).

    For every answer token: its rank among all tokens, logit and probability, then (print_details) the top_k
    tokens at that position; last, the ranks of the answer tokens, always printed. A list of answers is
    compared on their first token only. prepend_space_to_answer adds a space to an answer not starting with
    one; prepend_bos applies to the prompt (None: model.cfg.default_prepend_bos), never to the answer.
    TransformerLens prints through rich (bold lines); this prints the same text plainly. Returns None.
    """
    answers = [answer] if isinstance(answer, str) else list(answer)
    n_answers = len(answers)
    multiple = n_answers > 1
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    prompt_tokens = model.to_tokens(prompt, prepend_bos=prepend_bos)
    answer_tokens = model.to_tokens(answers, prepend_bos=False).to(prompt_tokens.device)
    if multiple:  # several answers: only their first tokens are compared
        answer_tokens = answer_tokens[:, :1]
    tokens = torch.cat((prompt_tokens.repeat(answer_tokens.shape[0], 1), answer_tokens), dim=1)
    prompt_str_tokens = model.to_str_tokens(prompt, prepend_bos=prepend_bos)
    answer_str_tokens_list = [model.to_str_tokens(a, prepend_bos=False) for a in answers]
    prompt_length = len(prompt_str_tokens)
    answer_length = 1 if multiple else len(answer_str_tokens_list[0])
    if print_details:
        print("Tokenized prompt:", prompt_str_tokens)
        if multiple:
            print("Tokenized answers:", answer_str_tokens_list)
        else:
            print("Tokenized answer:", answer_str_tokens_list[0])
    with torch.no_grad():
        logits = model(tokens)
    probs = logits.softmax(dim=-1)
    answer_ranks = []
    for index in range(prompt_length, prompt_length + answer_length):
        targets = tokens[:, index]
        target_strs = [a[index - prompt_length] for a in answer_str_tokens_list]
        token_probs = probs[:, index - 1]  # position index - 1 predicts token index
        sorted_probs, sorted_ids = token_probs.sort(descending=True)
        ranks = sorted_ids.argsort(-1)[torch.arange(n_answers, device=targets.device), targets].tolist()
        answer_ranks.append(list(zip(target_strs, ranks)))
        if print_details:
            lines = [
                f"Rank: {ranks[i]: <8} Logit: {logits[i, index - 1, targets[i]].item():5.2f} "
                f"Prob: {token_probs[i, targets[i]].item():6.2%} Token: |{target_strs[i]}|"
                for i in range(n_answers)
            ]
            print(f"Performance on answer token{'s' if multiple else ''}:\n" + "\n".join(lines))
            for i in range(top_k):
                print(
                    f"Top {i}th token. Logit: {logits[0, index - 1, sorted_ids[0, i]].item():5.2f} "
                    f"Prob: {sorted_probs[0, i].item():6.2%} Token: |{model.to_string(sorted_ids[0, i])}|"
                )
    shown = [r[0] for r in answer_ranks] if not multiple else answer_ranks
    print(f"Ranks of the answer tokens: {shown}")


test_prompt.__test__ = False  # its name starts with test_: pytest must not collect it where it is imported
