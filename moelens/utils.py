"""TransformerLens's `utils` module under moelens's name: get_act_name, Slice, to_numpy, get_corner,
remove_batch_dim, lm_cross_entropy_loss, lm_accuracy, get_device, tokenize_and_concatenate (needs the
`datasets` extra), get_attention_mask, test_prompt, and the small checks TransformerLens's tests use
(is_square, is_lower_triangular, override_or_use_default_value)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
import re
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int

from moelens.factored_matrix import FactoredMatrix
from moelens.hooks import slice_pos
from moelens.hooks.names import alias_candidates, site_pattern
from moelens.hooks.sites import SITES, TRANSFORMER_LENS_ONLY

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

# Every site a name may denote: the table's (per-expert views aside) and TransformerLens's that moelens lacks.
_KNOWN_SITES = frozenset(s.name for s in SITES if not s.per_expert) | set(TRANSFORMER_LENS_ONLY)


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


# ---- tensors -------------------------------------------------------------------------------------------------
def to_numpy(tensor: Any) -> np.ndarray:
    """A numpy array of a tensor (detached, on the CPU; bfloat16, which numpy lacks, as float32), a list,
    tuple, Python scalar or string; a numpy array comes back as it is (TransformerLens's to_numpy).
    Anything else is a ValueError naming its type."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if isinstance(tensor, (list, tuple)):
        return np.array(tensor)
    if isinstance(tensor, torch.Tensor):
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()
    if isinstance(tensor, (int, float, bool, str)):
        return np.array(tensor)
    raise ValueError(f"Input to to_numpy has invalid type: {type(tensor)}")


def get_corner(tensor: torch.Tensor | FactoredMatrix, n: int = 3) -> torch.Tensor:
    """The top-left corner: the first n entries along every axis (TransformerLens's get_corner); for a
    FactoredMatrix, of its product, computed without forming it."""
    if isinstance(tensor, FactoredMatrix):
        return tensor.get_corner(n)
    return tensor[tuple(slice(n) for _ in range(tensor.ndim))]


def remove_batch_dim(tensor: Float[torch.Tensor, "1 ..."]) -> Float[torch.Tensor, "..."]:
    """The tensor without its first axis when that axis has size 1, else the tensor unchanged
    (TransformerLens's remove_batch_dim)."""
    return tensor.squeeze(0) if tensor.shape[0] == 1 else tensor


def transpose(tensor: Float[torch.Tensor, "... a b"]) -> Float[torch.Tensor, "... b a"]:
    """The last two axes swapped, whatever the leading ones (TransformerLens's transpose)."""
    return tensor.transpose(-1, -2)


def is_square(x: torch.Tensor) -> bool:
    """Whether x is a square matrix (two axes of one size)."""
    return x.ndim == 2 and x.shape[0] == x.shape[1]


def is_lower_triangular(x: torch.Tensor) -> bool:
    """Whether x is a square matrix with nothing above its diagonal."""
    return is_square(x) and x.equal(x.tril())


def override_or_use_default_value(default_flag: Any, override: Any = None) -> Any:
    """override, unless it is None: then default_flag (TransformerLens's helper for prepend_bos and the like)."""
    return default_flag if override is None else override


# ---- Slice ---------------------------------------------------------------------------------------------------
SliceInput = int | tuple | slice | list | torch.Tensor | np.ndarray | None


def _as_int(value: Any) -> int | None:
    """An int-like scalar (int, numpy integer, 0-d integer tensor or array) as an int; None otherwise. A bool
    is not one (a Python bool keeps TransformerLens's int mode; tensor / array bools are masks)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0 and value.dtype not in (torch.bool, np.bool_):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return None
        if isinstance(value, np.ndarray) and not np.issubdtype(value.dtype, np.integer):
            return None
        return int(value)
    return None


class Slice:
    """TransformerLens's Slice: one slice of one axis, that can drop the axis (Python's and torch's cannot).

    Modes, by input: an int (or int-like scalar) "int" selects one index and drops the axis; a tuple "slice"
    is slice(*t) ((k,) is :k, (k, m) is k:m, (k, m, n) is k:m:n); a slice "slice"; a list, tensor or array
    "array" gathers those indices (a boolean one is a mask); None "identity" keeps everything.
    Anywhere moelens takes a pos_slice / batch_slice / neuron_slice, a Slice is accepted."""

    slice: int | slice | np.ndarray

    def __init__(self, input_slice: SliceInput = None) -> None:
        as_int = _as_int(input_slice)
        if isinstance(input_slice, bool):
            raise ValueError(f"Invalid input_slice {input_slice!r}: a bool is not an index")
        if as_int is not None:
            self.slice, self.mode = as_int, "int"
        elif isinstance(input_slice, tuple):
            self.slice, self.mode = slice(*input_slice), "slice"
        elif isinstance(input_slice, slice):
            self.slice, self.mode = input_slice, "slice"
        elif isinstance(input_slice, (list, torch.Tensor, np.ndarray)):
            self.slice, self.mode = to_numpy(input_slice), "array"
        elif input_slice is None:
            self.slice, self.mode = slice(None), "identity"
        else:
            raise ValueError(f"Invalid input_slice {input_slice!r}: expected an int, tuple, slice, list, tensor, array or None")

    def apply(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The tensor with this slice applied to axis `dim` (negative counts from the end)."""
        return slice_pos(tensor, self.slice, dim)

    def indices(self, max_ctx: int | None = None) -> np.ndarray:
        """The indices this slice selects from an axis of size max_ctx (needed unless the mode is "int",
        whose index comes back as array([i]))."""
        if self.mode == "int":
            return np.array([self.slice], dtype=np.int64)
        if max_ctx is None:
            raise ValueError("max_ctx must be specified if slice is not an integer")
        return np.arange(max_ctx, dtype=np.int64)[self.slice]

    def __repr__(self) -> str:
        return f"Slice: {self.slice} Mode: {self.mode} "

    @classmethod
    def unwrap(cls, slice_input: Slice | SliceInput) -> Slice:
        """A Slice of slice_input (a Slice as it is); an int (or int-like scalar) becomes [i], so that it
        keeps the axis, as run_with_cache reads its pos_slice."""
        if isinstance(slice_input, Slice):
            return slice_input
        as_int = _as_int(slice_input)
        return cls([as_int] if as_int is not None else slice_input)


# ---- language-model loss and accuracy ------------------------------------------------------------------------
def lm_cross_entropy_loss(
    logits: Float[torch.Tensor, "batch pos d_vocab"],
    tokens: Int[torch.Tensor, "batch pos"],
    attention_mask: Int[torch.Tensor, "batch pos"] | Bool[torch.Tensor, "batch pos"] | None = None,
    per_token: bool = False,
) -> Float[torch.Tensor, ""] | Float[torch.Tensor, "batch pos_minus_1"]:
    """Next-token cross-entropy (TransformerLens's lm_cross_entropy_loss): position p's logits predict token
    p + 1, so the last position's are not used. per_token: the loss at each of the pos - 1 predictions
    [batch, pos - 1]; else their mean. attention_mask [batch pos] (1 real, 0 padding): a prediction counts
    only where it and the token it predicts are both real (masked ones are 0 per token and left out of the
    mean)."""
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"lm_cross_entropy_loss: logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    log_probs = F.log_softmax(logits, dim=-1)
    predicted = log_probs[..., :-1, :].gather(dim=-1, index=tokens[..., 1:, None])[..., 0]
    if attention_mask is not None:
        if attention_mask.shape != tokens.shape:
            raise ValueError(
                f"attention_mask must have the same shape as tokens, got {tuple(attention_mask.shape)} and "
                f"{tuple(tokens.shape)}"
            )
        counted = torch.logical_and(attention_mask[..., :-1].bool(), attention_mask[..., 1:].bool())
        predicted = predicted.masked_fill(~counted, 0.0)
        n_tokens = counted.sum()
    else:
        n_tokens = predicted.numel()
    if per_token:
        return -predicted
    return -predicted.sum() / n_tokens


def lm_accuracy(
    logits: Float[torch.Tensor, "batch pos d_vocab"], tokens: Int[torch.Tensor, "batch pos"], per_token: bool = False
) -> Float[torch.Tensor, ""] | Bool[torch.Tensor, "batch pos_minus_1"]:
    """Top-1 next-token accuracy (TransformerLens's lm_accuracy): per_token, whether position p's argmax is
    token p + 1 [batch, pos - 1]; else the share of positions where it is."""
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"lm_accuracy: logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    correct = logits.argmax(dim=-1)[:, :-1] == tokens[:, 1:]
    return correct if per_token else correct.sum() / correct.numel()


# ---- devices and data ----------------------------------------------------------------------------------------
def get_device() -> str:
    """"cuda" where a CUDA device is visible, else "cpu" (TransformerLens's get_device; moelens does not pick
    Apple's "mps" by itself, as TransformerLens does not without its opt-in: pass device="mps" to choose it)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def tokenize_and_concatenate(
    dataset: Any,
    tokenizer: Any,
    streaming: bool = False,
    max_length: int = 1024,
    column_name: str = "text",
    add_bos_token: bool = True,
    num_proc: int | None = 10,
) -> Any:
    """TransformerLens's tokenize_and_concatenate: a Hugging Face `datasets` Dataset (or IterableDataset) of
    texts -> one of token rows "tokens" [max_length] (torch format). Each batch of documents is tokenized
    without special tokens, joined with the EOS token between documents, and cut into rows of max_length
    (max_length - 1 and a BOS first with add_bos_token); the tail that does not fill a row is dropped, except
    that a batch shorter than one row gives one row padded with the pad token. num_proc: processes for
    `map` (ignored when streaming). Needs the `datasets` package (`pip install ".[datasets]"` from moelens's
    checkout)."""
    try:
        import datasets  # optional: only this function needs it
    except ImportError:
        raise ImportError(
            "tokenize_and_concatenate needs the datasets package: pip install '.[datasets]' from moelens's checkout"
        ) from None
    if not isinstance(dataset, (datasets.Dataset, datasets.IterableDataset)):
        raise TypeError(f"tokenize_and_concatenate takes a datasets.Dataset or IterableDataset, got {type(dataset).__name__}")
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenize_and_concatenate: the tokenizer has no EOS token to join documents with")
    if add_bos_token and tokenizer.bos_token_id is None:
        raise ValueError("tokenize_and_concatenate(add_bos_token=True): the tokenizer has no BOS token")
    columns = list(dataset.features) if dataset.features is not None else [column_name]
    if column_name not in columns:
        raise KeyError(f"tokenize_and_concatenate: the dataset has no column {column_name!r} (columns: {columns})")
    dataset = dataset.remove_columns([c for c in columns if c != column_name])
    if (max_length - 1 if add_bos_token else max_length) < 1:
        raise ValueError(f"tokenize_and_concatenate: max_length {max_length} leaves no room for tokens")

    def tokenize(examples: dict[str, list[str]]) -> dict[str, np.ndarray]:
        return {"tokens": token_rows(examples[column_name], tokenizer, max_length, add_bos_token)}

    kwargs = {} if streaming else {"num_proc": num_proc}
    tokenized = dataset.map(tokenize, batched=True, remove_columns=[column_name], **kwargs)
    return tokenized.with_format(type="torch")


def token_rows(texts: Sequence[str], tokenizer: Any, max_length: int, add_bos_token: bool) -> Int[np.ndarray, "rows max_length"]:
    """One batch of tokenize_and_concatenate: the texts tokenized without special tokens, joined with the EOS
    token, cut into rows of max_length (max_length - 1 and a BOS first with add_bos_token); the tail that does
    not fill a row is dropped, except that a batch shorter than one row gives one row padded with the pad token
    (the EOS token where the tokenizer has none)."""
    seq_len = max_length - 1 if add_bos_token else max_length
    if not texts:
        return np.zeros((0, max_length), dtype=np.int64)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    pieces: list[np.ndarray] = []
    for i, row in enumerate(encoded):
        pieces.append(np.asarray(row, dtype=np.int64))
        if i < len(encoded) - 1:
            pieces.append(np.array([tokenizer.eos_token_id], dtype=np.int64))
    tokens = np.concatenate(pieces)
    if len(tokens) < seq_len:  # one short row, padded
        tokens = np.concatenate([tokens, np.full(seq_len - len(tokens), pad_id, dtype=np.int64)])
    n_rows = len(tokens) // seq_len
    rows = tokens[: n_rows * seq_len].reshape(n_rows, seq_len)
    if add_bos_token:
        rows = np.concatenate([np.full((n_rows, 1), tokenizer.bos_token_id, dtype=np.int64), rows], axis=1)
    return rows
