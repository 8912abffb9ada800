"""What a trace reads, without a model: folders (symlinks, FIFOs, the output folder), long files and JSONL
lines read in bounded pieces, and long documents tokenized in pieces into exactly the whole document's tokens."""

import hashlib
import json
import os
import random
import sysconfig
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from moelens.loaders import read_config
from moelens.tokenizer import MoeTokenizer
from moelens.traces import jsonl, sources, tokenize
from moelens.traces.sources import (
    BROKEN_LINK,
    HIDDEN,
    HIDDEN_FOLDER,
    NOT_REGULAR,
    NOT_TEXT,
    OUTPUT_FOLDER,
    READ_ALREADY,
    FileDocuments,
    LeftOut,
    TextPieces,
    describe_files,
    resolve_files,
    windows,
)
from moelens.traces.tokenize import DocumentTokenizer

DEFAULT_TOKENIZER = Path(__file__).resolve().parent.parent / "moelens" / "defaults" / "tiny-code-moe"


# ---- folders: every entry is traced or listed with its reason -------------------------------------------


def test_symlinked_folders_are_followed_once_and_fifos_are_listed_never_opened(tmp_path):
    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    (corpus / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (corpus / "a.txt").write_text("a")
    (corpus / "sub" / "b.txt").write_text("b")
    (elsewhere / "c.txt").write_text("c")
    (corpus / "linked").symlink_to(elsewhere)  # a folder reached through a symlink: read
    (corpus / "sub" / "loop").symlink_to(corpus)  # a cycle: listed, not followed
    (corpus / "twice").symlink_to(corpus / "sub")  # the same folder again: listed
    (corpus / "gone").symlink_to(tmp_path / "nothing")
    (corpus / ".git").mkdir()
    (corpus / ".git" / "HEAD").write_text("ref")
    (corpus / "image.png").write_bytes(b"\x89PNG")
    os.mkfifo(corpus / "pipe.txt")  # opening it would block forever
    files, left_out = resolve_files(corpus)
    assert files == [(corpus / "a.txt").resolve(), (elsewhere / "c.txt").resolve(), (corpus / "sub" / "b.txt").resolve()]
    assert sorted(left_out, key=lambda x: x.path) == sorted([
        LeftOut(str(corpus / ".git"), HIDDEN_FOLDER),
        LeftOut(str(corpus / "gone"), BROKEN_LINK),
        LeftOut(str(corpus / "image.png"), NOT_TEXT),
        LeftOut(str(corpus / "pipe.txt"), NOT_REGULAR),
        LeftOut(str(corpus / "sub" / "loop"), READ_ALREADY),
        LeftOut(str(corpus / "twice"), READ_ALREADY),
    ], key=lambda x: x.path)
    described = describe_files(corpus)  # reads every listed file: would hang on the FIFO
    assert [Path(f.path).name for f in described.files] == ["a.txt", "c.txt", "b.txt"]


def test_a_fifo_given_by_name_is_an_error_naming_it(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ValueError, match=rf"data: {tmp_path / 'pipe'} is not a regular file or a folder"):
        resolve_files(tmp_path / "pipe")


def test_the_output_folder_is_left_out_of_the_data_whether_or_not_it_exists_yet(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    files, left_out = resolve_files(tmp_path, exclude=tmp_path / "trace")
    assert files == [(tmp_path / "a.txt").resolve()] and left_out == [LeftOut(str((tmp_path / "trace").resolve()), OUTPUT_FOLDER)]
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "manifest.json").write_text("{}")
    files, left_out = resolve_files(tmp_path, exclude=tmp_path / "trace")
    assert files == [(tmp_path / "a.txt").resolve()] and left_out == [LeftOut(str(tmp_path / "trace"), OUTPUT_FOLDER)]
    assert resolve_files(tmp_path)[0][0].name == "a.txt" and len(resolve_files(tmp_path)[0]) == 2  # without it: read


def test_hidden_and_other_suffixes_keep_their_reasons(tmp_path):
    (tmp_path / ".hidden.txt").write_text("x")
    (tmp_path / "data.bin").write_bytes(b"\0")
    (tmp_path / "a.md").write_text("a")
    assert resolve_files(tmp_path)[1] == [LeftOut(str(tmp_path / ".hidden.txt"), HIDDEN), LeftOut(str(tmp_path / "data.bin"), NOT_TEXT)]


# ---- reading in bounded pieces ---------------------------------------------------------------------------


def test_a_long_text_file_reads_in_pieces_exactly_as_read_text(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "READ_CHARS", 7)
    gen = random.Random(0)
    text = "".join(gen.choice(["a", "é", "😀", "\r\n", "\r", "\n", " ", "\u2028"]) for _ in range(500))
    path = tmp_path / "doc.txt"
    path.write_bytes(text.encode("utf-8"))
    (document,) = list(FileDocuments([path]))
    assert isinstance(document, TextPieces)
    pieces = list(document)
    assert max(len(p) for p in pieces) <= 7 and "".join(pieces) == path.read_text(encoding="utf-8")


def test_a_long_text_file_that_is_not_utf8_is_an_error_naming_the_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "READ_CHARS", 4)
    path = tmp_path / "doc.txt"
    path.write_bytes(b"abcdefghij\xffklm")
    with pytest.raises(ValueError, match=rf"{path}: not UTF-8 text \(invalid start byte at byte 10\)"):
        list(next(iter(FileDocuments([path]))))


def json_line_cases():
    """Lines in many shapes, about half of them not a JSON object with a string text (the oracle says which)."""
    gen = random.Random(1)
    texts = ["", "plain", 'with \\"quotes\\" and \\\\ slashes', "esc \\n\\t\\r\\b\\f\\/", "\\u00e9\\ud83d\\ude00\\ud800x\\udc00",
             "raw é 😀", "\\u12", "bad \\x", "ctl \x01 char", "a" * 50]
    others = ['"id": 3', '"meta": {"a": [1, 2.5e-3, -0, true, null, NaN, -Infinity]}', '"text": 5', '"x": "y"',
              '"t\\u0065xt": "escaped key"', '"nested": [[[]], {}]', '"n": 1.', '"n": -', '"n": 1e+']
    shapes = ['{"text": "<T>", <O>}', '{<O>, "text": "<T>"}', ' {"text" : "<T>" ,<O> } ', '["<T>", <O>]', '{"text": "<T>", <O>',
              '{"text": "<T>" <O>}', '{"text": "<T>", <O>}garbage', '  ', '{"text": "<T>", <O>,}', '{"text": "<T>", "n": 01}',
              '"<T>"', '\x0b', '{"text": "<T>"}\u3000']
    good_shapes, good_texts, good_others = shapes[:3] * 4 + shapes[3:], texts[:6] * 4 + texts[6:], others[:6] * 3 + others[6:]
    return [gen.choice(good_shapes).replace("<T>", gen.choice(good_texts)).replace("<O>", gen.choice(good_others)) for _ in range(500)]


def reference_line(line: str):
    """json.loads's reading of a line: its text, None for a blank line, or "error"."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return "error"
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        return "error"
    return row["text"]


def test_long_jsonl_lines_are_read_in_pieces_exactly_as_json_loads_reads_them(tmp_path, monkeypatch):
    """Every line is 'long' here (LONG_LINE 4 bytes, 5-byte reads): the streaming scan must agree with
    json.loads on each text, and refuse exactly the lines json.loads refuses."""
    monkeypatch.setattr(jsonl, "LONG_LINE", 4)
    monkeypatch.setattr(jsonl, "READ_BYTES", 5)
    monkeypatch.setattr(jsonl, "TEXT_PIECE", 3)
    cases = json_line_cases()
    assert len({reference_line(c) for c in cases}) > 8 and sum(reference_line(c) == "error" for c in cases) > 50
    for i, line in enumerate(cases):
        path = tmp_path / f"{i}.jsonl"
        path.write_bytes(line.encode("utf-8") + b"\n")
        expected = reference_line(line)
        try:
            with open(path, "rb") as fh:
                got = [(x, "".join(jsonl.long_text(open(path, "rb"), path, x))) for x in jsonl.lines(fh, path)]
        except ValueError as err:
            assert expected == "error", (line, err)
            assert str(err).startswith(f"{path}:1: "), err
            continue
        assert [text for _, text in got] == ([] if expected is None else [expected]), line
        assert all(x.text is None for x, _ in got)  # read by the streaming scan, not json.loads


def test_a_long_jsonl_line_never_is_held_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "LONG_LINE", 1 << 10)
    text = "word " * 200_000 + "\\n" * 1000  # 1 MB of text in one line
    path = tmp_path / "big.jsonl"
    path.write_text('{"id": 1}\n' .replace('{"id": 1}', '{"text": "short"}') + '{"meta": 1, "text": "' + text + '"}\n{"text": "after"}\n')
    tracemalloc.start()
    try:
        documents = list(FileDocuments([path]))
        pieces = [len(p) for p in documents[1]]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert documents[0] == "short" and documents[2] == "after" and isinstance(documents[1], TextPieces)
    assert sum(pieces) == 200_000 * 5 + 1000 and max(pieces) <= 2 * jsonl.TEXT_PIECE
    assert peak < 2_000_000, peak  # the line's megabyte is never in memory at once (pieces of 64 Ki characters)


# ---- long documents tokenized in pieces -------------------------------------------------------------------

QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
TRAINING = ["def f(x):\n    return x + 1\n\n", "The quick brown fox's tail.\n", "  indented line\n\tand tabs\n",
            "numbers 12345 and 3.14\n", "the theme of these things\n", "print('hello world')\n"] * 30


def qwen_style() -> MoeTokenizer:
    """Qwen2's split regex, then byte-level BPE (as Qwen, Llama 3, DeepSeek-V3 tokenizers are built)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(TRAINING, trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.decoder = decoders.ByteLevel()
    return MoeTokenizer(tok, None, None, tok.token_to_id("<|endoftext|>"))


def sentencepiece_style(metaspace: bool) -> MoeTokenizer:
    """Llama 2 / Mixtral style: "▁" for spaces and before the text, BPE with byte fallback over the whole text,
    a BOS from the post-processor; as a Prepend+Replace normalizer (older conversions) or Metaspace
    prepend_scheme "first" (newer)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    # merges learnt inside words only, as SentencePiece learns them
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"), pre_tokenizers.Split("▁", "merged_with_next")])
    alphabet = sorted(set("".join(TRAINING).replace(" ", "▁")) - {"\n"})
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(TRAINING, trainers.BpeTrainer(vocab_size=len(specials) + 200, special_tokens=specials,
                                                          initial_alphabet=alphabet, show_progress=False))
    if metaspace:
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        tok.pre_tokenizer = None
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return MoeTokenizer(tok, None, tok.token_to_id("<s>"), tok.token_to_id("</s>"))


@pytest.fixture(scope="module")
def tokenizers():
    return {
        "tiny-code-moe (GPT-2 byte-level BPE)": MoeTokenizer.from_folder(DEFAULT_TOKENIZER, read_config(DEFAULT_TOKENIZER)),
        "Qwen-style split + byte-level BPE": qwen_style(),
        "SentencePiece-style, normalizer": sentencepiece_style(metaspace=False),
        "SentencePiece-style, Metaspace": sentencepiece_style(metaspace=True),
    }


def test_the_test_tokenizers_merge_and_add_what_real_ones_do(tokenizers):
    for name, tok in tokenizers.items():
        ids = tok.encode("the theme of these things")
        assert len(ids) < 20, name  # real merges, so that a wrong cut would show
    spm = tokenizers["SentencePiece-style, Metaspace"]
    assert spm.encode("x")[0] == spm.bos_token_id and spm.tokenizer.id_to_token(spm.encode("the")[1]).startswith("▁")


PIECES = ["a", "b", " ", "  ", "\n", "\n\n", " \n", "\t", "\r\n", "é", "😀", "1", "22", ".", "'s", "<|endoftext|>", "<s>",
          "x\n y", "def f(x):\n    return x + 1\n", "\u3000", "\u0301", "The quick", " the", " .", " 1", "theme"]


def test_a_long_document_tokenized_in_pieces_gives_the_whole_documents_tokens(tokenizers):
    """Tiny pieces and contexts, so that every kind of cut is crossed many times; the oracle is the
    tokenizer run over the whole text."""
    gen = random.Random(0)
    for name, tok in tokenizers.items():
        cut = 0
        for _ in range(400):
            text = "".join(gen.choice(PIECES) for _ in range(gen.randint(0, 80)))
            pieces = DocumentTokenizer(tok, piece_chars=gen.randint(2, 30), context_chars=gen.randint(1, 6))
            got = list(pieces.ids(iter([text[i : i + 5] for i in range(0, len(text), 5)])))
            cut += len(got) > 3  # before, pieces, after
            assert np.concatenate(got).tolist() == tok.encode(text), (name, text)
        assert cut > 200, name  # most texts were cut


def test_source_code_in_default_pieces_gives_the_whole_documents_tokens(tokenizers):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(encoding="utf-8") for p in sorted((stdlib / "json").glob("*.py")))
    text = (text * 3)[:150_000]
    for name in ("tiny-code-moe (GPT-2 byte-level BPE)", "Qwen-style split + byte-level BPE"):
        tok = tokenizers[name]
        for document in (text, text.replace("\n", " ")):  # lines, and one line with spaces
            got = list(DocumentTokenizer(tok).ids(document))
            assert len(got) > 3 and np.concatenate(got).tolist() == tok.encode(document), name


class Recording:
    """A tokenizer backend that records the length of every text it is given."""

    def __init__(self, backend):
        self.backend, self.lengths = backend, []

    def encode(self, text, *args, **kwargs):
        self.lengths.append(len(text))
        return self.backend.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def test_a_huge_one_line_document_is_read_and_tokenized_in_bounded_pieces_and_stops_at_max_tokens(tokenizers, tmp_path, monkeypatch):
    """8 MB on one line with max_tokens 64 (pieces of 4 Ki characters): the file is read a few pieces deep,
    the tokenizer never sees more than a piece and its contexts, and Python's peak memory is a small multiple
    of a piece, not of the document."""
    monkeypatch.setattr(sources, "READ_CHARS", 1 << 12)
    tok = tokenizers["tiny-code-moe (GPT-2 byte-level BPE)"]
    recording = Recording(tok.tokenizer)
    tok = MoeTokenizer(recording, tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    pieces = DocumentTokenizer(tok, piece_chars=1 << 12)
    recording.lengths.clear()
    path = tmp_path / "one_line.txt"
    path.write_text("lorem ipsum dolor sit amet " * 300_000)
    reader = FileDocuments([path])
    tracemalloc.start()
    try:
        got = list(windows(reader, pieces, 16, d_vocab=tok.vocab_size + 10, max_tokens=64, position=lambda: reader.bytes_read))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [len(w.tokens) for w in got] == [16] * 4
    assert np.concatenate([w.tokens for w in got]).tolist() == tok.encode("lorem ipsum dolor sit amet " * 100)[:64]
    assert reader.bytes_read <= 4 * sources.READ_CHARS, reader.bytes_read  # of 8.1 MB
    assert max(recording.lengths) <= pieces.piece_chars + 2 * pieces.context_chars
    assert peak < 1_000_000, peak  # the document is 8.1 MB


def test_windows_cut_pieces_at_seq_len_across_piece_boundaries():
    pieces = [np.arange(0, 5), np.arange(5, 6), np.arange(6, 17)]

    class Given:
        def ids(self, document):
            return iter(pieces)

    got = list(windows(["doc"], Given(), 4, d_vocab=100))
    assert [(w.start, w.tokens.tolist()) for w in got] == [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (8, [8, 9, 10, 11]), (12, [12, 13, 14, 15]), (16, [16])]


class CharTokens:
    """A made-up tokenizer backend: one token per character (its code point), except that a newline and the
    character after it are one token where ``joins(position of the newline in the text)`` says so."""

    truncation = padding = None

    def __init__(self, joins):
        self.joins = joins

    def get_added_tokens_decoder(self):
        return {}

    def encode(self, text, add_special_tokens=True):
        ids, offsets, i = [], [], 0
        while i < len(text):
            n = 2 if text[i] == "\n" and i + 1 < len(text) and self.joins(i) else 1
            ids.append(sum(ord(c) for c in text[i : i + n]) % 1000)
            offsets.append((i, i + n))
            i += n

        class Encoding:
            pass

        encoding = Encoding()
        encoding.ids, encoding.offsets, encoding.special_tokens_mask = ids, offsets, [0] * len(ids)
        return encoding


def test_a_cut_a_token_spans_is_not_taken_and_a_tokenizer_that_reaches_far_is_refused():
    text = "\n".join("line %d" % i for i in range(40))
    always = MoeTokenizer(CharTokens(lambda i: True), None, None, None)  # every newline cut is spanned: no cut
    got = list(DocumentTokenizer(always, piece_chars=20, context_chars=4).ids(text.replace(" ", "_")))
    assert len(got) == 3 and np.concatenate(got).tolist() == always.encode(text.replace(" ", "_"))
    near_start = MoeTokenizer(CharTokens(lambda i: i < 10), None, None, None)  # depends on where the text starts
    with pytest.raises(tokenize.TokenizerLocality, match="a token spans a newline cut"):
        list(DocumentTokenizer(near_start, piece_chars=30, context_chars=4).ids(text.replace(" ", "_")))


def test_a_long_jsonl_line_changed_between_its_two_scans_is_named(tmp_path, monkeypatch):
    """A long line is scanned (checked), then read again for its text: the second reading must see the bytes
    the first one did, or the file and line are named."""
    monkeypatch.setattr(jsonl, "LONG_LINE", 16)
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "short"}\n{"text": "' + "abcd " * 40 + '", "id": 1}\n')
    documents = iter(FileDocuments([path]))
    assert "".join(next(documents)) == "short"
    long = next(documents)  # scanned once, whole; its text not read yet
    path.write_text('{"text": "short"}\n{"text": "' + "abcd " * 40 + '", "id": 2}\n')  # same size, after the text
    with pytest.raises(ValueError, match=f"{path}:2 changed while being traced"):
        "".join(long)


def test_a_file_read_to_its_end_must_have_the_hash_given(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("some text")
    assert list(FileDocuments([path], [hashlib.sha256(b"some text").hexdigest()])) == ["some text"]
    with pytest.raises(ValueError, match=f"{path} changed while being traced"):
        list(FileDocuments([path], [hashlib.sha256(b"other text").hexdigest()]))
