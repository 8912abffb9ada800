"""TransformerLens's rough evals (transformer_lens.evals) under its names, with its meaning, on moelens models and
their tokenizers: sanity_check, induction_loss, the data loaders of four Hub datasets, evaluate_on_dataset,
evaluate, and the indirect-object-identification task (IOIDataset, ioi_eval).

What differs, and why:
- The data loaders take `texts`: a list of strings, or a local `datasets.Dataset`. Given a list they need no
  `datasets` package and no network (the rows are those tokenize_and_concatenate makes of the same texts in a
  datasets.Dataset). Without `texts` they load TransformerLens's Hub dataset, which needs the `datasets` package
  (`pip install ".[datasets]"` from moelens's checkout) and the Hub or its cache; where either is missing the
  error says so and names `texts`. A loader shuffles as TransformerLens's does; pass `shuffle=False` for a fixed
  order.
- induction_loss draws its tokens from [100, 20000) as TransformerLens does, cut to the model's vocabulary
  (a vocabulary of at most 100 tokens draws from all of it) and never a special token of the tokenizer (the
  embedded models' vocabularies are small: 260 or 4096 tokens); `seed` makes the draw reproducible.
- device defaults to where the model is (TransformerLens: "cuda").
- No progress bar is drawn unless stderr is a terminal, as in moelens.patching.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from moelens import utils

SANITY_TEXT = (
    "Many important transition points in the history of science have been moments when science 'zoomed in.' At "
    "these points, we develop a visualization or tool that allows us to see the world in a new level of detail, "
    "and a new field of science develops to study the world through this lens."
)


def sanity_check(model) -> Float[torch.Tensor, ""]:
    """The loss on one fixed paragraph (the first of Circuits: Zoom In): a rough and quick check. For a model
    trained on English, below 5 is probably fine and above 7 is broken; it says little more than that."""
    return model(SANITY_TEXT, return_type="loss")


class TokenRows(Dataset):
    """Rows of token ids [n_rows, max_length] as a torch Dataset whose items are {"tokens": row}, as a
    tokenize_and_concatenate dataset's are (a DataLoader over it gives {"tokens": [batch, max_length]})."""

    def __init__(self, rows: Int[torch.Tensor, "rows max_length"]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.rows[index]}


# datasets.Dataset.map's default batch: tokenize_and_concatenate drops each batch's tail that fills no row, so
# a list is cut into the same batches to give the same rows
_MAP_BATCH = 1000


def tokenize_texts(
    texts: Sequence[str], tokenizer: Any, max_length: int = 1024, add_bos_token: bool = True
) -> TokenRows:
    """tokenize_and_concatenate (moelens.utils) on a list of strings, without the `datasets` package: the same
    rows it makes of the same texts in a datasets.Dataset (the texts in batches of 1000, as its map runs)."""
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a list of strings (or a datasets.Dataset)")
    if not texts:
        raise ValueError("texts is empty: there is nothing to evaluate on")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to join documents with")
    if add_bos_token and tokenizer.bos_token_id is None:
        raise ValueError("add_bos_token=True: the tokenizer has no BOS token")
    batches = [
        torch.from_numpy(utils.token_rows(texts[i : i + _MAP_BATCH], tokenizer, max_length, add_bos_token))
        for i in range(0, len(texts), _MAP_BATCH)
    ]
    return TokenRows(torch.cat(batches))


def _hub_dataset(loader: str, path: str, *args: str, column: str) -> Any:
    """TransformerLens's Hub dataset, with an error saying what is missing and how to evaluate without it."""
    instead = (
        f"pass the texts yourself: {loader}(tokenizer, texts=[...]) with a list of strings, or a local "
        f"datasets.Dataset with a {column!r} column"
    )
    try:
        import datasets  # optional: only the Hub datasets need it (see the module's docstring)
    except ImportError:
        raise ImportError(
            f"{loader} loads {path!r} from the Hub with the datasets package, which is not installed (pip install "
            f"'.[datasets]' from moelens's checkout); or {instead}"
        ) from None
    try:
        return datasets.load_dataset(path, *args, split="train")
    except Exception as e:  # offline, not in the cache, or gone from the Hub: datasets raises many kinds
        raise RuntimeError(
            f"{loader}: the dataset {path!r} could not be loaded from the Hub or its cache ({type(e).__name__}: "
            f"{e}); {instead}"
        ) from e


def _data_loader(
    loader: str, hub: tuple[str, ...], column: str, tokenizer: Any, batch_size: int, texts: Any,
    max_length: int, shuffle: bool,
) -> DataLoader:
    if texts is None:
        texts = _hub_dataset(loader, *hub, column=column)
    if isinstance(texts, (list, tuple)):
        dataset = tokenize_texts(texts, tokenizer, max_length)
    else:  # a datasets.Dataset (tokenize_and_concatenate checks it is one)
        dataset = utils.tokenize_and_concatenate(texts, tokenizer, max_length=max_length, column_name=column)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=True)


def make_wiki_data_loader(
    tokenizer: Any, batch_size: int = 8, texts: Any = None, *, max_length: int = 1024, shuffle: bool = True
) -> DataLoader:
    """Wikitext 2 (its train split: Wikipedia articles), tokenized and cut into rows of max_length, in batches
    of {"tokens": [batch_size, max_length]}. texts: a list of strings or a local datasets.Dataset ("text"
    column) in its place; without it the Hub's wikitext / wikitext-2-v1 (see the module's docstring)."""
    return _data_loader("make_wiki_data_loader", ("wikitext", "wikitext-2-v1"), "text", tokenizer, batch_size,
                        texts, max_length, shuffle)


def make_owt_data_loader(
    tokenizer: Any, batch_size: int = 8, texts: Any = None, *, max_length: int = 1024, shuffle: bool = True
) -> DataLoader:
    """OpenWebText's first 10k documents (stas/openwebtext-10k), as make_wiki_data_loader."""
    return _data_loader("make_owt_data_loader", ("stas/openwebtext-10k",), "text", tokenizer, batch_size, texts,
                        max_length, shuffle)


def make_pile_data_loader(
    tokenizer: Any, batch_size: int = 8, texts: Any = None, *, max_length: int = 1024, shuffle: bool = True
) -> DataLoader:
    """The Pile's first 10k documents (NeelNanda/pile-10k), as make_wiki_data_loader."""
    return _data_loader("make_pile_data_loader", ("NeelNanda/pile-10k",), "text", tokenizer, batch_size, texts,
                        max_length, shuffle)


def make_code_data_loader(
    tokenizer: Any, batch_size: int = 8, texts: Any = None, *, max_length: int = 1024, shuffle: bool = True
) -> DataLoader:
    """CodeParrot's validation set (codeparrot/codeparrot-valid-v2-near-dedup, Python files; a local
    datasets.Dataset given as texts has them in a "content" column), as make_wiki_data_loader."""
    return _data_loader("make_code_data_loader", ("codeparrot/codeparrot-valid-v2-near-dedup",), "content", tokenizer,
                        batch_size, texts, max_length, shuffle)


DATASET_NAMES = ["wiki", "owt", "pile", "code"]
DATASET_LOADERS: list[Callable[..., DataLoader]] = [
    make_wiki_data_loader,
    make_owt_data_loader,
    make_pile_data_loader,
    make_code_data_loader,
]


def _model_device(model, device) -> torch.device:
    return torch.device(model.cfg.device if device is None else device)


@torch.inference_mode()
def evaluate_on_dataset(model, data_loader, truncate: int = 100, device: str | torch.device | None = None) -> float:
    """The mean over batches of the model's loss on each batch's "tokens" (a batch may also be a tensor of
    token ids). As in TransformerLens it stops after batch truncate + 1 (truncate=100 reads 101 batches)."""
    running_loss, total = 0.0, 0
    for batch in tqdm(data_loader, disable=None):
        tokens = batch["tokens"] if isinstance(batch, dict) else batch
        running_loss += model(tokens.to(_model_device(model, device)), return_type="loss").mean().item()
        total += 1
        if total > truncate:
            break
    if total == 0:
        raise ValueError("evaluate_on_dataset: the data loader gave no batch (fewer rows than one batch?)")
    return running_loss / total


@torch.inference_mode()
def induction_loss(
    model, tokenizer: Any = None, batch_size: int = 4, subseq_len: int = 384, prepend_bos: bool | None = None,
    device: str | torch.device | None = None, *, seed: int | None = None,
) -> Float[torch.Tensor, ""]:
    """A batch of random token sequences, each repeated twice, and the model's mean loss on the second half
    (from its second token: TransformerLens's slice): low where the model has induction heads, log(d_vocab) for
    a model that predicts nothing. prepend_bos (None: model.cfg.default_prepend_bos) overwrites the first token
    with the tokenizer's BOS, as TransformerLens does. The tokens are drawn from [100, 20000) cut to the
    vocabulary, without the tokenizer's special tokens (see the module's docstring); seed: a generator of
    its own, else torch's global one."""
    tokenizer = model.tokenizer if tokenizer is None else tokenizer
    pool = _induction_pool(model.cfg.d_vocab, tokenizer)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    first_half = pool[torch.randint(len(pool), (batch_size, subseq_len), generator=generator)]
    repeated = first_half.repeat(1, 2).to(_model_device(model, device))
    prepend_bos = utils.override_or_use_default_value(model.cfg.default_prepend_bos, override=prepend_bos)
    if prepend_bos:
        if tokenizer is None or tokenizer.bos_token_id is None:
            raise ValueError("induction_loss(prepend_bos=True) needs a tokenizer with a BOS token; pass prepend_bos=False")
        repeated[:, 0] = tokenizer.bos_token_id
    logits = model(repeated, return_type="logits")
    per_token = utils.lm_cross_entropy_loss(logits, repeated, per_token=True)
    return per_token[:, subseq_len + 1 :].mean()


def _induction_pool(d_vocab: int, tokenizer: Any) -> Int[torch.Tensor, "n"]:
    """The ids induction_loss draws from: [100, 20000) within the vocabulary (all of it where it has at most 100
    ids), less the tokenizer's special tokens."""
    high = min(20000, d_vocab)
    low = 100 if high > 100 else 0
    special = set(getattr(tokenizer, "all_special_ids", None) or []) if tokenizer is not None else set()
    pool = torch.tensor([i for i in range(low, high) if i not in special], dtype=torch.long)
    if len(pool) == 0:
        raise ValueError(f"induction_loss: no token to draw in [{low}, {high}) outside the special tokens {sorted(special)}")
    return pool


@torch.inference_mode()
def evaluate(
    model, truncate: int = 100, batch_size: int = 8, tokenizer: Any = None, *, texts: dict | None = None,
    max_length: int = 1024,
) -> dict[str, float]:
    """evaluate_on_dataset on each of the four datasets (DATASET_NAMES): {"wiki_loss": ..., ...}, each printed
    as TransformerLens prints it. texts: {name: a list of strings or a local datasets.Dataset} to evaluate on
    those instead of the Hub's, and on those names only (an unknown name is refused); max_length: the rows'
    length."""
    tokenizer = model.tokenizer if tokenizer is None else tokenizer
    if texts is not None and set(texts) - set(DATASET_NAMES):
        raise KeyError(f"evaluate(texts=...): unknown dataset names {sorted(set(texts) - set(DATASET_NAMES))}; the names are {DATASET_NAMES}")
    losses = {}
    for name, make_loader in zip(DATASET_NAMES, DATASET_LOADERS, strict=True):
        if texts is not None and name not in texts:
            continue
        data_loader = make_loader(
            tokenizer=tokenizer, batch_size=batch_size, texts=None if texts is None else texts[name], max_length=max_length
        )
        loss = evaluate_on_dataset(model, data_loader, truncate=truncate)
        print(f"{name}: {loss}")
        losses[f"{name}_loss"] = loss
    return losses


class IOIDataset(Dataset):
    """Indirect object identification prompts (Wang et al., 2022), TransformerLens's: each item is {"prompt":
    token ids, "IO": the indirect object's tokens, "S": the subject's}, both names with a leading space.
    templates: strings with [A], [B] and [NOUN] placeholders (default: two of TransformerLens's); names
    (default John and Mary); nouns: {placeholder: words}; symmetric: each name pair in both orders;
    prepend_bos: the tokenizer's BOS first; seed: seeds Python's `random` (as TransformerLens does), else its
    current state."""

    def __init__(
        self, tokenizer: Any, templates: list[str] | None = None, names: list[str] | None = None,
        nouns: dict[str, list[str]] | None = None, num_samples: int = 1000, symmetric: bool = False,
        prepend_bos: bool = True, seed: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.prepend_bos = prepend_bos
        if seed is not None:
            random.seed(seed)
        self.templates = templates if templates is not None else self.get_default_templates()
        self.names = names if names is not None else self.get_default_names()
        self.nouns = nouns if nouns is not None else self.get_default_nouns()
        self.samples: list[dict[str, str]] = []
        for _ in range(num_samples // 2 if symmetric else num_samples):
            self.samples.extend(self.get_sample(symmetric=symmetric))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        sample = self.samples[idx]
        prompt = self.tokenizer.encode(sample["text"], add_special_tokens=False)
        if self.prepend_bos:
            prompt = [self.tokenizer.bos_token_id] + prompt
        return {
            "prompt": torch.LongTensor(prompt),
            "IO": torch.LongTensor(self.tokenizer.encode(sample["IO"], add_special_tokens=False)),
            "S": torch.LongTensor(self.tokenizer.encode(sample["S"], add_special_tokens=False)),
        }

    def get_sample(self, symmetric: bool = False) -> list[dict[str, str]]:
        """One prompt (two with symmetric): a template with its nouns and two distinct names filled in."""
        template: str = random.choice(self.templates)
        for noun_type, noun_list in self.nouns.items():
            template = template.replace(f"[{noun_type}]", random.choice(noun_list))
        a, b = random.sample(self.names, 2)
        samples = [{"text": template.replace("[A]", a).replace("[B]", b), "IO": " " + a, "S": " " + b}]
        if symmetric:
            samples.append({"text": template.replace("[A]", b).replace("[B]", a), "IO": " " + b, "S": " " + a})
        return samples

    @staticmethod
    def get_default_names() -> list[str]:
        """TransformerLens's default names."""
        return ["John", "Mary"]

    @staticmethod
    def get_default_templates() -> list[str]:
        """TransformerLens's default templates."""
        return [
            "[A] and [B] went to the [LOCATION] to buy [OBJECT]. [B] handed the [OBJECT] to [A]",
            "Then, [B] and [A] went to the [LOCATION]. [B] gave the [OBJECT] to [A]",
        ]

    @staticmethod
    def get_default_nouns() -> dict[str, list[str]]:
        """TransformerLens's default nouns."""
        return {"LOCATION": ["store", "market"], "OBJECT": ["milk", "eggs", "bread"]}


def _collate_ioi(samples: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    prompts = [sample["prompt"] for sample in samples]
    return {
        "prompt": torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True),  # right-padded: causal, so unread
        "IO": [sample["IO"] for sample in samples],
        "S": [sample["S"] for sample in samples],
        "prompt_length": [p.shape[0] for p in prompts],
    }


@torch.inference_mode()
def ioi_eval(
    model, dataset: Dataset | None = None, batch_size: int = 8, num_samples: int = 1000, tokenizer: Any = None,
    symmetric: bool = False,
) -> dict[str, float]:
    """The indirect-object task: at the position before the indirect object's name, the logit of its first
    token that differs from the subject's minus the subject's ({"Logit Difference": mean, "Accuracy": the
    share above 0}). dataset: items with "prompt", "IO" and "S" (default: IOIDataset(tokenizer, num_samples,
    symmetric)); the prompt ends with the indirect object's tokens."""
    tokenizer = model.tokenizer if tokenizer is None else tokenizer
    if dataset is None:
        dataset = IOIDataset(tokenizer, num_samples=num_samples, symmetric=symmetric)
    data_loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=_collate_ioi)
    total_correct, total_logit_diff = 0, 0.0
    for batch in tqdm(data_loader, disable=None):
        batch_logits = model(batch["prompt"].to(model.cfg.device), return_type="logits")
        for i in range(batch_logits.shape[0]):
            io, s = batch["IO"][i], batch["S"][i]
            prefix_length = batch["prompt_length"][i] - io.shape[0]
            n = min(io.shape[0], s.shape[0])
            differ = torch.where(io[:n] != s[:n])[0]
            if len(differ) == 0:
                raise ValueError(f"ioi_eval: the names' tokens {io.tolist()} and {s.tolist()} do not differ")
            start = int(differ[0])
            logits = batch_logits[i, prefix_length + start - 1]
            logit_diff = logits[io[start]] - logits[s[start]]
            total_correct += int((logit_diff > 0).item())
            total_logit_diff += logit_diff.item()
    return {"Logit Difference": total_logit_diff / len(dataset), "Accuracy": total_correct / len(dataset)}
