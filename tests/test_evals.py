"""moelens.evals: TransformerLens's evals on moelens models, checked against values computed by hand (a model whose
logits are all zero has loss log(d_vocab) everywhere; a stand-in model whose logits are known)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F

import moelens
from moelens import evals, utils

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(40)]


@pytest.fixture(scope="module")
def model():
    return moelens.HookedTransformer.from_pretrained("tiny-qwen2-moe", progress=False)


@pytest.fixture(scope="module")
def uniform(model):
    """tiny-qwen2-moe with a zero unembedding: every logit 0, so every next-token loss is log(d_vocab)."""
    uniform = moelens.HookedTransformer.from_pretrained("tiny-qwen2-moe", progress=False)
    with torch.no_grad():
        uniform.unembed.weight.zero_()
    assert uniform.unembed.bias is None
    return uniform


def test_uniform_logits_give_log_vocab(uniform):
    log_v = math.log(uniform.cfg.d_vocab)
    assert evals.sanity_check(uniform).item() == pytest.approx(log_v, rel=1e-6)
    assert evals.induction_loss(uniform, batch_size=2, subseq_len=20, seed=0).item() == pytest.approx(log_v, rel=1e-6)
    loader = evals.make_wiki_data_loader(uniform.tokenizer, batch_size=2, texts=TEXTS, max_length=64)
    assert evals.evaluate_on_dataset(uniform, loader) == pytest.approx(log_v, rel=1e-6)


def test_induction_loss_is_the_second_halfs_loss(model):
    """The same draw made by hand: the pool's ids, repeated, BOS first, the per-token loss from position
    subseq_len + 1 on (TransformerLens's slice)."""
    batch, n = 3, 16
    got = evals.induction_loss(model, batch_size=batch, subseq_len=n, prepend_bos=True, seed=7)
    pool = [i for i in range(100, 260) if i not in (256, 257)]  # byte ids past 100, not end-of-text or pad
    assert evals._induction_pool(260, model.tokenizer).tolist() == pool
    draw = torch.randint(len(pool), (batch, n), generator=torch.Generator().manual_seed(7))
    tokens = torch.tensor(pool)[draw].repeat(1, 2)
    tokens[:, 0] = model.tokenizer.bos_token_id
    logits = model(tokens)
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, 260), tokens[:, 1:].reshape(-1), reduction="none")
    want = losses.view(batch, 2 * n - 1)[:, n + 1 :].mean()
    assert torch.allclose(got, want, rtol=0, atol=1e-6), (got, want)
    assert not torch.equal(evals.induction_loss(model, batch_size=batch, subseq_len=n, seed=8), got)
    assert evals._induction_pool(50, None).tolist() == list(range(50))  # a vocabulary under 100: all of it


def test_text_rows_are_tokenize_and_concatenates(model):
    """A list of strings gives the rows tokenize_and_concatenate makes of the same texts in a datasets.Dataset,
    over more than one of its map batches (each batch's tail is dropped)."""
    datasets = pytest.importorskip("datasets")
    texts = [f"text number {i} " * (1 + i % 5) for i in range(1300)]
    ours = evals.tokenize_texts(texts, model.tokenizer, max_length=32).rows
    theirs = utils.tokenize_and_concatenate(datasets.Dataset.from_dict({"text": texts}), model.tokenizer, max_length=32, num_proc=None)
    theirs = torch.stack([row["tokens"] for row in theirs])
    assert ours.shape[0] > 1000 // 2 and torch.equal(ours, theirs)
    assert (ours[:, 0] == model.tokenizer.bos_token_id).all() and ours.shape[1] == 32
    code = evals.make_code_data_loader(model.tokenizer, 4, datasets.Dataset.from_dict({"content": texts}), max_length=32, shuffle=False)
    assert torch.equal(next(iter(code))["tokens"], theirs[:4])


def test_loaders_without_texts_say_what_is_missing(model, monkeypatch):
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "datasets", None)  # not installed
        with pytest.raises(ImportError, match=r"'wikitext'.*datasets package.*\.\[datasets\].*texts=\[\.\.\.\]"):
            evals.make_wiki_data_loader(model.tokenizer)
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match=r"make_pile_data_loader: the dataset 'NeelNanda/pile-10k' could not be loaded.*no network.*texts="):
        evals.make_pile_data_loader(model.tokenizer)
    with pytest.raises(TypeError, match="list of strings"):
        evals.make_owt_data_loader(model.tokenizer, texts=["a", 3])


class Stub:
    """A stand-in model: forward gives logits[b, p, v] = v * (p + 1) and, for return_type="loss", the next
    value of `losses`."""

    def __init__(self, losses=()):
        self.cfg = type("cfg", (), {"device": "cpu", "default_prepend_bos": True})()
        self.losses, self.calls, self.tokenizer = list(losses), 0, None

    def __call__(self, tokens, return_type="logits"):
        self.calls += 1
        if return_type == "loss":
            return torch.tensor(self.losses[self.calls - 1])
        b, p = tokens.shape
        return torch.arange(260.0).expand(b, p, 260) * (torch.arange(p) + 1.0)[None, :, None]


def test_evaluate_on_dataset_reads_truncate_plus_one_batches():
    stub = Stub(losses=[1.0, 2.0, 3.0, 4.0, 5.0])
    batches = [{"tokens": torch.zeros(2, 4, dtype=torch.long)}] * 5
    assert evals.evaluate_on_dataset(stub, batches, truncate=2) == pytest.approx((1 + 2 + 3) / 3)
    assert stub.calls == 3


def test_evaluate_on_given_texts(uniform, capsys):
    losses = evals.evaluate(uniform, batch_size=2, texts={"wiki": TEXTS, "code": TEXTS[:20]}, max_length=64)
    assert losses.keys() == {"wiki_loss", "code_loss"}
    assert all(v == pytest.approx(math.log(260), rel=1e-6) for v in losses.values())
    assert "wiki: " in capsys.readouterr().out
    with pytest.raises(KeyError, match="'books'"):
        evals.evaluate(uniform, texts={"books": TEXTS})
    with pytest.raises(ValueError, match="gave no batch"):  # one row of 1024 tokens, batches of 2
        evals.evaluate(uniform, batch_size=2, texts={"wiki": TEXTS})


def test_ioi_eval_by_hand(model):
    """Byte-level names " John" / " Mary" first differ at their second token; the logit read is at the position
    before it (the prompt's length less the name's tokens), where the stub's logit of id v is v * (p + 1)."""
    ds = evals.IOIDataset(model.tokenizer, num_samples=12, seed=3)
    assert len(ds) == 12 and evals.IOIDataset(model.tokenizer, num_samples=12, symmetric=True).samples[0]["IO"] in (" John", " Mary")
    item = ds[0]
    assert item["prompt"][0] == model.tokenizer.bos_token_id and item["IO"].tolist() == list(ds.samples[0]["IO"].encode())
    diffs = []
    for sample in ds.samples:
        prompt_len = 1 + len(sample["text"].encode())
        position = prompt_len - len(sample["IO"].encode())  # prefix length + first differing token (1) - 1
        diffs.append((ord(sample["IO"][1]) - ord(sample["S"][1])) * (position + 1))
    got = evals.ioi_eval(Stub(), dataset=ds, batch_size=5)
    assert got["Logit Difference"] == pytest.approx(sum(diffs) / len(diffs))
    assert got["Accuracy"] == pytest.approx(sum(d > 0 for d in diffs) / len(diffs))
    real = evals.ioi_eval(model, dataset=ds, batch_size=4)
    assert real.keys() == {"Logit Difference", "Accuracy"} and math.isfinite(real["Logit Difference"])
