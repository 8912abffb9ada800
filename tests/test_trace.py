"""moelens trace: windows, schema, equality with run_with_cache, resume after a crash, refusal of other inputs."""

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import moelens.traces.run as trace_module
from moelens import HookedTransformer
from moelens.cli import main
from moelens.defaults import default_checkpoint
from moelens.traces import TraceMismatch, trace
from moelens.traces import manifest as manifest_module
from moelens.traces.parts import PartWriter, schema
from moelens.traces import Trace
from moelens.traces.sources import HIDDEN, NOT_REGULAR, NOT_TEXT, OUTPUT_FOLDER, LeftOut, describe_files, windows

pytest.importorskip("duckdb")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny forwards run far faster on one thread where the cores are shared; the SIGKILL test's subprocess
    uses one too, so that its numbers are bit for bit the in-process run's."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return default_checkpoint("tiny-qwen2-moe", root=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def model(model_path):
    return HookedTransformer.from_pretrained(model_path, progress=False)


def read(out: Path) -> pa.Table:
    """The whole trace, as recorded by its manifest, in a canonical order."""
    manifest = json.loads((out / "manifest.json").read_text())
    parts = [out / p["file"] for _, p in sorted(manifest["parts"].items(), key=lambda kv: int(kv[0]))]
    table = pa.concat_tables([pq.read_table(p) for p in parts])
    return table.sort_by([("doc", "ascending"), ("start", "ascending"), ("layer", "ascending"), ("pos", "ascending")])


def token_docs(n_docs: int = 7, seed: int = 0) -> list[list[int]]:
    gen = np.random.default_rng(seed)
    return [gen.integers(0, 256, size=int(gen.integers(1, 90))).tolist() for _ in range(n_docs)]


# ---- windows and schema ----------------------------------------------------------------------------


@pytest.mark.parametrize("n, s", [(10, 4), (8, 4), (1, 5), (5, 5), (0, 3), (13, 1)])
def test_a_document_of_n_tokens_gives_ceil_n_over_s_windows(n, s):
    doc = list(range(n))
    got = list(windows([doc], None, s, d_vocab=100))
    assert len(got) == math.ceil(n / s)
    assert [w.start for w in got] == list(range(0, n, s))
    assert all(w.doc == 0 for w in got)
    assert np.concatenate([w.tokens for w in got] or [np.zeros(0, dtype=np.int64)]).tolist() == doc
    assert all(len(w.tokens) == s for w in got[:-1])


def test_max_tokens_cuts_exactly_and_documents_are_numbered_in_order():
    got = list(windows([[1] * 5, [], [2] * 7], None, 4, d_vocab=10, max_tokens=10))
    assert [(w.doc, w.start, len(w.tokens)) for w in got] == [(0, 0, 4), (0, 4, 1), (2, 0, 4), (2, 4, 1)]


def test_trace_rows_cover_every_window_with_its_start(model, tmp_path):
    docs = [list(range(10, 10 + n)) for n in (33, 16, 1, 40)]
    trace(model, docs, tmp_path / "t", seq_len=16, batch_size=3, windows_per_part=2, progress=False)
    table = read(tmp_path / "t")
    layers = model.cfg.moe_layer_indices
    assert table.num_rows == sum(len(d) for d in docs) * len(layers)
    layer0 = table.filter(pa.compute.equal(table["layer"], layers[0]))
    for doc, ids in enumerate(docs):
        rows = layer0.filter(pa.compute.equal(layer0["doc"], doc))
        starts = sorted(set(rows["start"].to_pylist()))
        assert starts == list(range(0, len(ids), 16))  # ceil(N / 16) windows
        assert [s + p for s, p in zip(rows["start"].to_pylist(), rows["pos"].to_pylist())] == list(range(len(ids)))
        assert rows["token"].to_pylist() == ids


@pytest.mark.parametrize("router_logits", [False, True])
def test_schema_has_exact_columns_and_types(model, tmp_path, router_logits):
    trace(model, token_docs(2), tmp_path / "t", seq_len=32, router_logits=router_logits, progress=False)
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    got = pq.read_schema(tmp_path / "t" / manifest["parts"]["0"]["file"])
    expected = [("doc", pa.int64()), ("start", pa.int64()), ("pos", pa.int32()), ("token", pa.int32()), ("layer", pa.int16()),
                ("experts", pa.list_(pa.int16())), ("weights", pa.list_(pa.float32()))]
    if router_logits:
        expected.append(("router_logits", pa.list_(pa.float32())))
    assert got.names == [name for name, _ in expected]
    for name, type_ in expected:
        assert got.field(name).type == type_, name
    assert got == schema(router_logits)
    assert manifest["columns"] == {name: str(type_) for name, type_ in expected}


# ---- equality with the model's own routing -----------------------------------------------------------


def test_trace_equals_run_with_cache_on_sampled_windows(model, tmp_path):
    docs = token_docs(9, seed=1)
    trace(model, docs, tmp_path / "t", seq_len=24, batch_size=4, router_logits=True, windows_per_part=3, progress=False)
    table = read(tmp_path / "t")
    keys = sorted({(d, s) for d, s in zip(table["doc"].to_pylist(), table["start"].to_pylist())})
    gen = np.random.default_rng(0)
    for i in gen.choice(len(keys), size=6, replace=False):
        doc, start = keys[i]
        tokens = torch.tensor([docs[doc][start : start + 24]])
        _, cache = model.run_with_cache(tokens)
        for layer in model.cfg.moe_layer_indices:
            rows = table.filter(pa.compute.and_(pa.compute.and_(pa.compute.equal(table["doc"], doc), pa.compute.equal(table["start"], start)),
                                                pa.compute.equal(table["layer"], layer)))
            assert rows["pos"].to_pylist() == list(range(tokens.shape[1]))
            assert rows["token"].to_pylist() == tokens[0].tolist()
            indices = torch.tensor(rows["experts"].to_pylist())
            assert torch.equal(indices, cache[f"blocks.{layer}.mlp.hook_expert_indices"][0])
            weights = torch.tensor(rows["weights"].to_pylist())
            torch.testing.assert_close(weights, cache[f"blocks.{layer}.mlp.hook_expert_weights"][0].float(), rtol=1e-5, atol=1e-6)
            logits = torch.tensor(rows["router_logits"].to_pylist())
            torch.testing.assert_close(logits, cache[f"blocks.{layer}.mlp.hook_router_logits"][0].float(), rtol=1e-5, atol=1e-5)


def test_texts_are_tokenized_whole_and_files_folders_and_jsonl_are_read_in_order(model, tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("alpha beta")
    (corpus / "sub" / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    (corpus / ".hidden.txt").write_text("secret")
    (corpus / "image.png").write_bytes(b"\x89PNG")
    summary = trace(model, corpus, tmp_path / "t", seq_len=4, progress=False)
    assert summary.left_out == [LeftOut(str(corpus / ".hidden.txt"), HIDDEN), LeftOut(str(corpus / "image.png"), NOT_TEXT)]
    table = read(tmp_path / "t")
    layer0 = table.filter(pa.compute.equal(table["layer"], 0))
    texts = {}
    for doc in range(3):
        rows = layer0.filter(pa.compute.equal(layer0["doc"], doc))
        texts[doc] = model.tokenizer.decode(rows["token"].to_pylist())
    assert texts == {0: "alpha beta", 1: "one", 2: "two"}
    files = json.loads((tmp_path / "t" / "manifest.json").read_text())["data"]["files"]
    assert [(Path(f["path"]).name, f["first_doc"], f["n_docs"], f["size"]) for f in files] == [("a.txt", 0, 1, 10), ("b.jsonl", 1, 2, 42)]


def test_a_jsonl_line_without_text_is_an_error_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=rf"{bad}:2: expected a JSON object with a string field 'text', got keys \['content'\]"):
        describe_files(bad)


def test_max_tokens_traces_exactly_that_many(model, tmp_path):
    summary = trace(model, token_docs(5), tmp_path / "t", seq_len=16, max_tokens=37, progress=False)
    assert summary.n_tokens == 37 and read(tmp_path / "t").num_rows == 37 * len(model.cfg.moe_layer_indices)


# ---- resume ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Files, and the trace an uninterrupted run makes of them."""
    folder = tmp_path_factory.mktemp("corpus")
    gen = np.random.default_rng(5)
    for i in range(4):
        words = ["".join(chr(97 + c) for c in gen.integers(0, 26, size=int(gen.integers(1, 8)))) for _ in range(int(gen.integers(20, 60)))]
        (folder / f"doc{i}.txt").write_text(" ".join(words))
    return folder


RESUME = dict(seq_len=32, batch_size=3, windows_per_part=4, progress=False)


@pytest.fixture(scope="module")
def reference(model, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "t"
    summary = trace(model, corpus, out, **RESUME)
    assert summary.parts_written >= 4, "the corpus must span several parts for the resume tests to mean anything"
    return read(out)


class Crash(Exception):
    pass


def finish_and_compare(model, corpus, out, reference):
    summary = trace(model, corpus, out, **RESUME)
    assert not summary.already_complete and summary.parts_reused >= 1
    assert read(out).equals(reference)
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and sorted(p.name for p in out.glob("*.parquet")) == sorted(p["file"] for p in manifest["parts"].values())
    return summary


@pytest.mark.parametrize("part", [1, 3])
def test_resume_after_a_crash_mid_part(model, corpus, reference, tmp_path, monkeypatch, part):
    """A crash while a part's rows are being written leaves its temporary file; the rerun redoes that part."""
    real_add = PartWriter.add

    def add(self, table):
        real_add(self, table)
        if self.final.name == f"part-{part:06d}.parquet":
            self._flush()  # some rows are on disk under the temporary name
            raise Crash

    monkeypatch.setattr(PartWriter, "add", add)
    out = tmp_path / "t"
    with pytest.raises(Crash):
        trace(model, corpus, out, **RESUME)
    assert (out / f"part-{part:06d}.parquet.tmp").exists()
    monkeypatch.undo()
    summary = finish_and_compare(model, corpus, out, reference)
    assert summary.parts_reused == part


def test_resume_after_a_crash_between_part_and_manifest(model, corpus, reference, tmp_path, monkeypatch):
    """Part 2 is in place but the manifest does not record it: the rerun deletes and redoes it."""
    real = manifest_module.write_json_atomic
    calls = []

    def write(path, obj):
        calls.append(1)
        if len(calls) == 4:  # the manifest's creation, parts 0 and 1, then part 2's record
            raise Crash
        real(path, obj)

    monkeypatch.setattr(trace_module, "write_json_atomic", write)
    out = tmp_path / "t"
    with pytest.raises(Crash):
        trace(model, corpus, out, **RESUME)
    assert (out / "part-000002.parquet").exists() and "2" not in json.loads((out / "manifest.json").read_text())["parts"]
    monkeypatch.undo()
    assert finish_and_compare(model, corpus, out, reference).parts_reused == 2


def test_resume_after_a_crash_inside_the_manifest_write(model, corpus, reference, tmp_path, monkeypatch):
    """Killed after the manifest's temporary file is written but before it replaces the manifest."""
    real_replace = os.replace
    count = []

    def replace(src, dst):
        if str(dst).endswith("manifest.json"):
            count.append(1)
            if len(count) == 3:
                raise Crash
        real_replace(src, dst)

    monkeypatch.setattr(manifest_module.os, "replace", replace)
    out = tmp_path / "t"
    with pytest.raises(Crash):
        trace(model, corpus, out, **RESUME)
    assert (out / "manifest.json.tmp").exists()
    monkeypatch.undo()
    assert finish_and_compare(model, corpus, out, reference).parts_reused == 1


def test_resume_after_sigkill(model_path, corpus, reference, tmp_path):
    """A real SIGKILL of a tracing process once a part is recorded, then again early in its next run."""
    out = tmp_path / "t"
    script = textwrap.dedent(f"""
        import time
        from moelens.traces import parts
        real = parts.PartWriter.commit
        def slow(self):  # slow the run down so the kill lands mid-trace
            time.sleep(0.3)
            return real(self)
        parts.PartWriter.commit = slow
        from moelens.traces import trace
        trace({str(model_path)!r}, {str(corpus)!r}, {str(out)!r}, seq_len=32, batch_size=3, windows_per_part=4, progress=False)
    """)
    for wanted in (1, 2):
        proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.time() + 60
            while time.time() < deadline and proc.poll() is None:
                try:
                    if len(json.loads((out / "manifest.json").read_text())["parts"]) >= wanted:
                        break
                except (OSError, ValueError):
                    pass
                time.sleep(0.02)
            assert proc.poll() is None, "the tracing process ended before it could be killed"
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
    recorded = json.loads((out / "manifest.json").read_text())
    assert not recorded["complete"] and len(recorded["parts"]) >= 2
    summary = trace(model_path, corpus, out, **RESUME)
    assert summary.parts_reused >= 2 and read(out).equals(reference)


def test_a_completed_trace_reports_already_complete(model, tmp_path, capsys):
    trace(model, token_docs(3), tmp_path / "t", seq_len=16, progress=False)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "t").iterdir())
    summary = trace(model, token_docs(3), tmp_path / "t", seq_len=16, progress=True)
    assert summary.already_complete and summary.parts_written == 0
    assert "already complete" in capsys.readouterr().out
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "t").iterdir()) == before


# ---- refusals ----------------------------------------------------------------------------------------


def started(model, data, out, **kwargs):
    """A trace stopped after its first part (as a kill would leave it)."""
    with pytest.MonkeyPatch.context() as mp:
        real_commit = PartWriter.commit

        def commit(self):
            rows = real_commit(self)
            if self.final.name == "part-000001.parquet":
                raise Crash
            return rows

        mp.setattr(PartWriter, "commit", commit)
        with pytest.raises(Crash):
            trace(model, data, out, **{**RESUME, **kwargs})


def test_another_model_is_refused(model, model_path, corpus, tmp_path):
    out = tmp_path / "t"
    started(model, corpus, out)
    other = HookedTransformer.from_pretrained(model_path, progress=False)
    with torch.no_grad():
        other.blocks[0].mlp.router.weight.view(-1)[0] += 1.0
    with pytest.raises(TraceMismatch, match="model weights differ"):
        trace(other, corpus, out, **RESUME)
    with pytest.raises(TraceMismatch, match=r"model dtype: 'float32' -> 'bfloat16'"):
        trace(HookedTransformer.from_pretrained(model_path, dtype=torch.bfloat16, progress=False), corpus, out, **RESUME)
    assert len(json.loads((out / "manifest.json").read_text())["parts"]) == 1  # nothing was mixed in


def test_changed_data_and_settings_are_refused_naming_what_changed(model, corpus, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for f in corpus.iterdir():
        (data / f.name).write_text(f.read_text())
    out = tmp_path / "t"
    started(model, data, out)
    with pytest.raises(TraceMismatch, match=r"seq_len: 32 -> 16"):
        trace(model, data, out, **{**RESUME, "seq_len": 16})
    with pytest.raises(TraceMismatch, match=r"router_logits: False -> True"):
        trace(model, data, out, **RESUME, router_logits=True)
    with pytest.raises(TraceMismatch, match=r"max_tokens: None -> 100"):
        trace(model, data, out, **RESUME, max_tokens=100)
    (data / "doc2.txt").write_text("changed")
    with pytest.raises(TraceMismatch, match=rf"data file changed: {data.resolve() / 'doc2.txt'}"):
        trace(model, data, out, **RESUME)
    (data / "doc4.txt").write_text("new")
    with pytest.raises(TraceMismatch, match=rf"data file added: {data.resolve() / 'doc4.txt'}"):
        trace(model, data, out, **RESUME)


def test_changed_iterable_data_is_refused_at_the_first_recorded_part(model, tmp_path):
    docs = token_docs(12, seed=3)
    out = tmp_path / "t"
    started(model, docs, out, seq_len=16, windows_per_part=2)
    changed = [list(d) for d in docs]
    changed[0][0] = (changed[0][0] + 1) % 256
    with pytest.raises(TraceMismatch, match="part 0 was traced from other token windows"):
        trace(model, changed, out, **{**RESUME, "seq_len": 16, "windows_per_part": 2})


def test_a_folder_with_foreign_files_is_refused(model, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds files but no manifest.json"):
        trace(model, token_docs(1), tmp_path / "t", progress=False)


def test_a_users_tmp_files_in_a_folder_without_manifest_are_refused_not_deleted(model_path, tmp_path, capsys):
    """Files ending in .tmp are not a killed run's leftovers unless the trace can prove it wrote them: the run
    refuses the folder with one line naming them, leaves them as they were, and leaves no trace.lock."""
    out = tmp_path / "t"
    out.mkdir()
    (out / "notes.tmp").write_text("my notes")
    (out / "part-000000.parquet.tmp").write_text("mine too")
    err = cli_error(capsys, ["trace", str(model_path), "--data", str(write_corpus(tmp_path)), "--out", str(out), "--seq-len", "16", "--no-progress"])
    assert "notes.tmp" in err and "holds files but no manifest.json" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.tmp", "part-000000.parquet.tmp"]
    assert (out / "notes.tmp").read_text() == "my notes" and (out / "part-000000.parquet.tmp").read_text() == "mine too"


def test_a_users_files_in_a_trace_folder_are_left_alone_on_resume(model, corpus, reference, tmp_path):
    out = tmp_path / "t"
    started(model, corpus, out)
    mine = {"notes.tmp": "my notes", "part-1.parquet": "not a part name", "rank-x.json.tmp": "mine", "README": "hello"}
    for name, text in mine.items():
        (out / name).write_text(text)
    summary = trace(model, corpus, out, **RESUME)
    assert summary.parts_reused >= 1 and read(out).equals(reference)
    assert {name: (out / name).read_text() for name in mine} == mine


def test_a_manifest_temporary_left_by_a_kill_in_the_first_manifest_write_is_taken_as_the_runs(model, tmp_path):
    """What a run killed inside its first manifest write leaves (a beginning of a manifest) is the trace's own."""
    docs = token_docs(3)
    whole = tmp_path / "whole"
    trace(model, docs, whole, seq_len=16, progress=False)
    out = tmp_path / "t"
    out.mkdir()
    (out / "trace.lock").touch()
    (out / "manifest.json.tmp").write_bytes((whole / "manifest.json").read_bytes()[:40])
    trace(model, docs, out, seq_len=16, progress=False)
    assert read(out).equals(read(whole)) and not (out / "manifest.json.tmp").exists()


def write_corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "small_corpus"
    folder.mkdir(exist_ok=True)
    (folder / "a.txt").write_text("one small document " * 5)
    return folder


def change_after_listing(monkeypatch, edit):
    """Run edit() right after the trace has hashed its data files, before it reads them to trace them."""
    real = trace_module.describe_files

    def describe(*args, **kwargs):
        described = real(*args, **kwargs)
        edit()
        return described

    monkeypatch.setattr(trace_module, "describe_files", describe)


@pytest.mark.parametrize("name", ["doc2.txt", "lines.jsonl"])
def test_a_file_changed_between_its_hash_and_its_reading_stops_the_trace_naming_it(model, corpus, tmp_path, monkeypatch, name):
    """The manifest must describe what was traced: a file whose bytes as read are not those hashed at the
    start stops the run, naming it, and no recorded part holds windows of it."""
    data = tmp_path / "data"
    data.mkdir()
    for f in sorted(corpus.iterdir()):
        (data / f.name).write_text(f.read_text())
    (data / "lines.jsonl").write_text("".join(json.dumps({"text": f"line {i} " * 20}) + "\n" for i in range(4)))
    target = data / name
    before = target.read_text()
    after = before.replace("a", "b", 1) if "a" in before else before.replace("line", "lime", 1)
    assert len(after) == len(before) and after != before  # same size: only the hash can tell
    change_after_listing(monkeypatch, lambda: target.write_text(after))
    out = tmp_path / "t"
    with pytest.raises(ValueError, match=f"{target} changed while being traced"):
        trace(model, data, out, **RESUME)
    manifest = json.loads((out / "manifest.json").read_text())
    first_doc = next(f["first_doc"] for f in manifest["data"]["files"] if f["path"] == str(target))
    assert not manifest["complete"] and all(p["docs"][1] < first_doc for p in manifest["parts"].values())
    assert sorted(p.name for p in out.glob("*.parquet")) == sorted(p["file"] for p in manifest["parts"].values())
    monkeypatch.undo()
    target.write_text(before)  # as hashed: the run goes on, tracing again what the stopped run dropped
    whole = tmp_path / "whole"
    trace(model, data, whole, **RESUME)
    trace(model, data, out, **RESUME)
    assert read(out).equals(read(whole))


def test_a_change_in_the_part_of_a_file_that_max_tokens_leaves_unread_is_caught(model, tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    big = tmp_path / "data" / "big.txt"
    big.write_text("lorem ipsum dolor sit amet\n" * 10_000)  # 270 KB: read in pieces, and only its start is traced
    change_after_listing(monkeypatch, lambda: big.write_text("lorem ipsum dolor sit amet\n" * 9_999 + "lorem ipsum dolor sit amen\n"))
    with pytest.raises(ValueError, match="big.txt changed while being traced"):
        trace(model, tmp_path / "data", tmp_path / "t", seq_len=16, max_tokens=64, progress=False)


# ---- CLI and placement -------------------------------------------------------------------------------


def test_cli_traces_and_resumes(model_path, corpus, tmp_path, capsys):
    argv = ["trace", str(model_path), "--data", str(corpus), "--out", str(tmp_path / "t"), "--seq-len", "32",
            "--batch-size", "3", "--windows-per-part", "4", "--no-progress"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "traced" in first and "parts" in first
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["command"][:2] == ["moelens", "trace"] and manifest["complete"]
    assert main(argv) == 0 and "already complete" in capsys.readouterr().out
    assert main([*argv[:-2], "16", "--no-progress"]) == 2
    assert "windows_per_part: 4 -> 16" in capsys.readouterr().err


def test_two_ranks_run_the_forward_and_rank_0_alone_writes(model_path, corpus, reference, tmp_path):
    """Two gloo processes trace into one folder (rank 1 after a partial run by rank 0 alone, so the resume
    decision must reach it): the result is the single-process trace."""
    out = tmp_path / "t"
    script = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist
        from moelens.traces import trace
        import moelens.traces.run as module
        rank = int(sys.argv[1])
        if rank == 1:  # rank 1 must neither read nor write the folder
            def refuse(*args, **kwargs):
                raise AssertionError("rank 1 touched the trace folder")
            module.PartWriter = module.write_json_atomic = module.read_manifest = module._prepare = refuse
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=rank, world_size=2)
        summary = trace({str(model_path)!r}, {str(corpus)!r}, {str(out)!r}, seq_len=32, batch_size=3, windows_per_part=4, progress=False)
        print("reused", summary.parts_reused)
        dist.destroy_process_group()
    """)
    started(str(model_path), corpus, out)  # by path, as the ranks give it: the model's name is part of its identity
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for rank in (0, 1)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all("reused 1" in o for o in outputs), outputs  # both ranks skipped the part rank 0 had recorded
    assert read(out).equals(reference)


def test_under_torch_distributed_rank_0_writes(model, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        summary = trace(model, token_docs(3), tmp_path / "t", seq_len=16, progress=False)
    finally:
        dist.destroy_process_group()
    assert summary.n_tokens == sum(len(d) for d in token_docs(3)) and read(tmp_path / "t").num_rows > 0


DATA_PARALLEL = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from moelens.traces import parts, trace
    rank, world, model_path, corpus, out, store, slow, group = sys.argv[1:]
    rank, world, group = int(rank), int(world), int(group)
    real = parts.PartWriter.commit
    def commit(self):  # says which parts this rank writes; slowed down on the rank that is to be killed
        if int(slow) == rank:
            time.sleep(0.5)
        committed = real(self)
        print("wrote", self.final.name, flush=True)
        return committed
    parts.PartWriter.commit = commit
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    model = model_path
    if group > 1:  # each replica: its experts sharded over `group` ranks
        from moelens import HookedTransformer
        model = HookedTransformer.from_pretrained(model_path, expert_parallel=group, progress=False)
    summary = trace(model, corpus, out, seq_len=32, batch_size=3, windows_per_part=4, progress=False, data_parallel=True,
                    ranks_per_replica=group, model_name=model_path if group > 1 else None)
    print("summary", summary.parts_written, summary.parts_reused, summary.n_tokens, flush=True)
    dist.destroy_process_group()
""")


def launch(world: int, model_path, corpus, out: Path, store: Path, slow: int = -1, group: int = 1) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", DATA_PARALLEL, str(rank), str(world), str(model_path), str(corpus), str(out), str(store),
                              str(slow), str(group)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            for rank in range(world)]


def parts_written(output: str) -> list[int]:
    return [int(line.split("part-")[1][:6]) for line in output.splitlines() if line.startswith("wrote")]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # each about 35 s on 2 shared cores
def test_a_data_parallel_trace_deals_parts_to_ranks_and_equals_one_process(model_path, corpus, reference, tmp_path, world):
    out = tmp_path / "t"
    procs = launch(world, model_path, corpus, out, tmp_path / "store")
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * world, [o[1][-2000:] for o in outputs]
    manifest = json.loads((out / "manifest.json").read_text())
    n_parts = len(manifest["parts"])
    assert n_parts >= 2 * world and manifest["complete"]
    for rank, (stdout, _) in enumerate(outputs):  # part k is traced by rank k % world, and only there
        assert parts_written(stdout) == list(range(rank, n_parts, world))
    assert read(out).equals(reference)
    assert sorted(p.name for p in out.iterdir()) == sorted([*(p["file"] for p in manifest["parts"].values()), "manifest.json", "trace.lock"])


@pytest.mark.slow
def test_replicas_that_are_expert_parallel_groups_trace_as_one_process(model_path, corpus, reference, tmp_path):
    """4 ranks: 2 replicas, each one model whose experts are sharded over 2 ranks; the first rank of each
    replica writes its parts."""
    out = tmp_path / "t"
    procs = launch(4, model_path, corpus, out, tmp_path / "store", group=2)
    outputs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1][-2000:] for o in outputs]
    n_parts = len(json.loads((out / "manifest.json").read_text())["parts"])
    assert [parts_written(stdout) for stdout, _ in outputs] == [list(range(0, n_parts, 2)), [], list(range(1, n_parts, 2)), []]
    assert read(out).equals(reference)


@pytest.mark.slow
def test_the_command_under_torchrun_traces_data_parallel(model_path, corpus, reference, tmp_path):
    """README's launch, on CPU: torchrun starts two processes, each a replica on the CPU."""
    out = tmp_path / "t"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "moelens",
                          "trace", str(model_path), "--data", str(corpus), "--out", str(out), "--seq-len", "32", "--batch-size", "3",
                          "--windows-per-part", "4", "--no-progress", "--data-parallel"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("traced ") == 1  # rank 0 alone says what the trace did
    assert read(out).equals(reference)


def test_data_parallel_without_torchrun_is_one_line(model_path, corpus, tmp_path, capsys):
    argv = ["trace", str(model_path), "--data", str(corpus), "--out", str(tmp_path / "t"), "--no-progress"]
    assert "runs one process per replica under torchrun" in cli_error(capsys, [*argv, "--data-parallel"])
    assert "add --data-parallel" in cli_error(capsys, [*argv, "--replica", "device-map"])
    assert not (tmp_path / "t").exists()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_killed_replica_s_parts_are_traced_again_on_resume(model_path, corpus, reference, tmp_path, world):
    """Rank 1 is killed once its journal records a part (rank 0 then stops too, as torchrun stops every rank);
    the same command again keeps every finished part, traces the rest, and gives one process's rows."""
    out = tmp_path / "t"
    procs = launch(world, model_path, corpus, out, tmp_path / "store1", slow=1)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "rank-00001.json").exists():
            assert procs[1].poll() is None, procs[1].communicate()[1][-2000:]
            time.sleep(0.02)
        procs[1].send_signal(signal.SIGKILL)
        for p in procs[:1] + procs[2:]:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    journal = json.loads((out / "rank-00001.json").read_text())["parts"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert journal and not manifest["complete"]
    procs = launch(world, model_path, corpus, out, tmp_path / "store2")
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * world, [o[1][-2000:] for o in outputs]
    again = {k for stdout, _ in outputs for k in parts_written(stdout)}
    assert again and not again & {int(k) for k in journal}  # rank 1's finished parts are kept, the rest traced
    assert read(out).equals(reference) and json.loads((out / "manifest.json").read_text())["complete"]
    assert not list(out.glob("rank-*.json"))


# ---- the data folder: the trace's own folder inside it, symlinks, FIFOs ----------------------------------


def test_a_trace_into_its_own_data_folder_leaves_itself_out_and_resumes(model, corpus, reference, tmp_path):
    """--out inside --data: the trace's files (manifest.json is a .json) must never count as data, or a
    killed run could never resume ("data file added")."""
    data = tmp_path / "data"
    data.mkdir()
    for f in corpus.iterdir():
        (data / f.name).write_text(f.read_text())
    out = data / "traces" / "t"
    started(model, data, out)
    summary = finish_and_compare(model, data, out, reference)
    assert summary.left_out == [LeftOut(str(out), OUTPUT_FOLDER)]


def test_a_symlinked_folder_is_traced_and_a_fifo_is_listed(model, tmp_path):
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    elsewhere.mkdir()
    (data / "a.txt").write_text("alpha")
    (elsewhere / "b.txt").write_text("beta")
    (data / "more").symlink_to(elsewhere)
    os.mkfifo(data / "pipe.txt")
    summary = trace(model, data, tmp_path / "t", seq_len=8, progress=False)
    files = json.loads((tmp_path / "t" / "manifest.json").read_text())["data"]["files"]
    assert [Path(f["path"]).name for f in files] == ["a.txt", "b.txt"]
    assert summary.left_out == [LeftOut(str(data / "pipe.txt"), NOT_REGULAR)]


# ---- damaged parts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "copied over", "deleted"])
def test_a_damaged_part_is_found_named_and_traced_again(model, corpus, reference, tmp_path, capsys, damage):
    out = tmp_path / "t"
    trace(model, corpus, out, **RESUME)
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(p["size"] == (out / p["file"]).stat().st_size for p in manifest["parts"].values())
    part = out / "part-000002.parquet"
    if damage == "truncated":
        part.write_bytes(part.read_bytes()[:-100])
    elif damage == "copied over":
        part.write_bytes((out / "part-000001.parquet").read_bytes())
    else:
        part.unlink()
    if damage != "copied over":  # a reader sees a wrong size or a missing file at once
        with pytest.raises((ValueError, FileNotFoundError), match="part-000002.parquet"):
            Trace(out)
    summary = trace(model, corpus, out, **RESUME)
    assert not summary.already_complete and summary.parts_written == 1 and len(summary.redone) == 1
    assert "part-000002.parquet" in summary.redone[0] and "part-000002.parquet" in capsys.readouterr().err
    assert read(out).equals(reference)
    assert Trace(out).n_tokens == reference.num_rows // len(model.cfg.moe_layer_indices)
    assert trace(model, corpus, out, **RESUME).already_complete


def forge_part(out: Path, index: int, source: Path) -> None:
    """Copy source over part index of the trace in out, and make the manifest's size and sha256 match it."""
    part = out / f"part-{index:06d}.parquet"
    part.write_bytes(source.read_bytes())
    edit_manifest(out, lambda m: m["parts"][str(index)].update(size=part.stat().st_size, sha256=hashlib.sha256(part.read_bytes()).hexdigest()))


@pytest.mark.parametrize("source", ["another model", "other data"])
def test_a_part_copied_from_another_trace_with_a_forged_hash_is_refused_and_traced_again(model, model_path, tmp_path, capsys, source):
    """A part copied from another model's (or other data's) trace, the manifest's size and sha256 edited to
    match it: Trace(), trace-report and a re-run all see that it is not this trace's part."""
    docs, kwargs = token_docs(6), dict(seq_len=16, batch_size=2, windows_per_part=3, progress=False)
    out, other = tmp_path / "t", tmp_path / "other"
    trace(model, docs, out, **kwargs)
    reference = read(out)
    if source == "another model":
        other_model = HookedTransformer.from_pretrained(default_checkpoint("tiny-olmoe", root=tmp_path / "cache"), progress=False)
        trace(other_model, docs, other, **kwargs)
    else:
        trace(model, token_docs(6, seed=1), other, **kwargs)
    forge_part(out, 0, other / "part-000000.parquet")
    with pytest.raises(ValueError, match="part-000000.parquet"):
        Trace(out)
    err = cli_error(capsys, ["trace-report", str(out), "--out", str(tmp_path / "r.html")])
    assert "part-000000.parquet" in err
    summary = trace(model, docs, out, **kwargs)
    assert not summary.already_complete and len(summary.redone) == 1 and "part-000000.parquet" in summary.redone[0]
    assert read(out).equals(reference) and Trace(out).complete


def test_a_part_recorded_without_a_hash_is_checked_by_its_rows_and_then_hashed(model, corpus, reference, tmp_path):
    """Traces written before parts had hashes: their parts are checked by the Parquet footer's row count."""
    out = tmp_path / "t"
    trace(model, corpus, out, **RESUME)
    manifest = json.loads((out / "manifest.json").read_text())
    for p in manifest["parts"].values():
        del p["size"], p["sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert trace(model, corpus, out, **RESUME).already_complete
    assert all("sha256" in p for p in json.loads((out / "manifest.json").read_text())["parts"].values())


# ---- two runs into one folder -------------------------------------------------------------------------


def test_a_second_run_into_a_folder_in_use_stops_with_one_line(model_path, corpus, tmp_path, capsys):
    import fcntl

    out = tmp_path / "t"
    out.mkdir()
    with open(out / "trace.lock", "a") as held:  # as a running trace holds it
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        argv = ["trace", str(model_path), "--data", str(corpus), "--out", str(out), "--no-progress"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{out} is being written by another moelens trace" in err
        assert sorted(p.name for p in out.iterdir()) == ["trace.lock"]  # nothing written or deleted
    assert main(argv) == 0  # once the other run is gone


def test_two_processes_tracing_one_folder_at_once_one_refuses_the_other_finishes(model_path, corpus, reference, tmp_path):
    out = tmp_path / "t"
    script = textwrap.dedent(f"""
        import os, sys, time
        from moelens.traces import parts
        real = parts.PartWriter.commit
        def slow(self):  # keep the folder in use until the test lets go
            while not os.path.exists({str(tmp_path / "release")!r}):
                time.sleep(0.05)
            return real(self)
        parts.PartWriter.commit = slow
        from moelens.cli import main
        sys.exit(main(["trace", {str(model_path)!r}, "--data", {str(corpus)!r}, "--out", {str(out)!r}, "--seq-len", "32",
                       "--batch-size", "3", "--windows-per-part", "4", "--no-progress"]))
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not (out / "manifest.json").exists():
        time.sleep(0.02)
    second = subprocess.run([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True, timeout=120)
    (tmp_path / "release").touch()
    first_err = first.communicate(timeout=120)[1]
    assert first.returncode == 0, first_err
    assert second.returncode == 2 and second.stderr.count("\n") == 1 and "is being written by another moelens trace" in second.stderr
    assert read(out).equals(reference)


# ---- one-line errors -------------------------------------------------------------------------------------


def cli_error(capsys, argv) -> str:
    try:
        status = main(argv)
    except SystemExit as exit:  # argparse's own refusal
        status = exit.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    return err


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
def test_a_device_this_machine_lacks_is_one_line(model_path, corpus, tmp_path, capsys):
    err = cli_error(capsys, ["trace", str(model_path), "--data", str(corpus), "--out", str(tmp_path / "t"), "--device", "cuda:7"])
    assert "device: cuda:7" in err
    assert "device: 'nonsense'" in cli_error(capsys, ["trace", str(model_path), "--data", str(corpus), "--out", str(tmp_path / "t"), "--device", "nonsense"])


@pytest.mark.parametrize("value", [str(2**63), str(10**30), "0", "-1"])
def test_windows_per_part_out_of_range_is_one_line(model_path, corpus, tmp_path, capsys, value):
    err = cli_error(capsys, ["trace", str(model_path), "--data", str(corpus), "--out", str(tmp_path / "t"), "--windows-per-part", value])
    assert "windows_per_part must be a positive integer up to 2**63 - 1" in err or "--windows-per-part" in err


def edit_manifest(out: Path, edit) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit, field", [
    (lambda m: m.pop("parts"), "parts should be"),
    (lambda m: m["parts"].update({"0": "part-000000.parquet"}), "parts['0'] should be"),
    (lambda m: m["parts"]["0"].update(file="../part-000000.parquet"), "parts['0'].file should be 'part-000000.parquet', got '../part-000000.parquet'"),
    (lambda m: m["parts"]["0"].update(file="/etc/passwd"), "parts['0'].file should be"),
    (lambda m: m["parts"]["0"].update(tokens="many"), "parts['0'].tokens should be a count"),
])
def test_a_damaged_manifest_is_one_line_naming_the_field(model_path, corpus, tmp_path, capsys, edit, field):
    out = tmp_path / "t"
    started(str(model_path), corpus, out)  # by path, as the command gives it
    edit_manifest(out, edit)
    argv = ["trace", str(model_path), "--data", str(corpus), "--out", str(out), "--seq-len", "32", "--batch-size", "3",
            "--windows-per-part", "4", "--no-progress"]
    err = cli_error(capsys, argv)
    assert f"{out / 'manifest.json'}: {field}" in err
    err = cli_error(capsys, ["trace-report", str(out), "--out", str(tmp_path / "r.html")])
    assert f"{out / 'manifest.json'}: {field}" in err


def test_a_folder_named_like_a_temporary_file_is_one_line(model_path, corpus, tmp_path, capsys):
    out = tmp_path / "t"
    started(str(model_path), corpus, out)  # by path, as the command gives it
    (out / "part-000001.parquet.tmp").mkdir()
    err = cli_error(capsys, ["trace", str(model_path), "--data", str(corpus), "--out", str(out), "--seq-len", "32",
                             "--batch-size", "3", "--windows-per-part", "4", "--no-progress"])
    assert f"out: {out / 'part-000001.parquet.tmp'} is a folder, not a temporary file of a trace" in err


def test_a_folder_named_like_a_part_is_one_line_and_left_alone(model_path, corpus, tmp_path, capsys):
    out = tmp_path / "t"
    started(str(model_path), corpus, out)
    (out / "part-000009.parquet").mkdir()
    (out / "part-000009.parquet" / "mine.txt").write_text("mine")
    err = cli_error(capsys, ["trace", str(model_path), "--data", str(corpus), "--out", str(out), "--seq-len", "32",
                             "--batch-size", "3", "--windows-per-part", "4", "--no-progress"])
    assert f"out: {out / 'part-000009.parquet'} is a folder, not a part of a trace" in err
    assert (out / "part-000009.parquet" / "mine.txt").read_text() == "mine"


# ---- a long document in bounded pieces, through trace() ----------------------------------------------------


def test_a_one_line_megabyte_document_is_tokenized_in_pieces_and_read_only_as_far_as_max_tokens(model, tmp_path, monkeypatch):
    lengths = []
    backend = model.tokenizer.tokenizer

    class Recording:
        def encode(self, text, *args, **kwargs):
            lengths.append(len(text))
            return backend.encode(text, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(backend, name)

    monkeypatch.setattr(model.tokenizer, "tokenizer", Recording())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "big.txt").write_text("lorem ipsum dolor sit amet " * 40_000)  # 1 MB, one line
    summary = trace(model, tmp_path / "data", tmp_path / "t", seq_len=16, max_tokens=64, progress=False)
    assert summary.n_tokens == 64
    assert max(lengths) < 100_000  # pieces of 2**16 characters and their contexts, of a 1,080,000-character line
    table = read(tmp_path / "t")
    first = table.filter(pa.compute.equal(table["layer"], model.cfg.moe_layer_indices[0]))
    assert first["token"].to_pylist() == backend.encode("lorem ipsum dolor sit amet " * 20, add_special_tokens=True).ids[:64]


# ---- the progress bar's total --------------------------------------------------------------------------


class Bar:
    made = []

    def __init__(self, total=None, **kwargs):
        self.total, self.n, self.kwargs = total, 0, kwargs
        Bar.made.append(self)

    def update(self, n):
        self.n += n

    def set_postfix_str(self, *args, **kwargs):
        pass

    def close(self):
        pass


def test_the_progress_bar_has_a_total_where_the_size_of_the_data_is_known(model, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(trace_module, "tqdm", Bar)
    Bar.made.clear()
    trace(model, corpus, tmp_path / "files", seq_len=32, progress=True)
    size = sum(f.stat().st_size for f in corpus.iterdir())
    assert (Bar.made[-1].total, Bar.made[-1].n, Bar.made[-1].kwargs["unit"]) == (size, size, "B")  # bytes read
    trace(model, corpus, tmp_path / "capped", seq_len=32, max_tokens=50, progress=True)
    assert (Bar.made[-1].total, Bar.made[-1].n, Bar.made[-1].kwargs["unit"]) == (50, 50, "tok")
    docs = token_docs(4)
    trace(model, docs, tmp_path / "ids", seq_len=32, progress=True)
    assert Bar.made[-1].total == Bar.made[-1].n == sum(len(d) for d in docs)
    trace(model, iter(docs), tmp_path / "stream", seq_len=32, progress=True)
    assert Bar.made[-1].total is None  # a stream of unknown length: tokens without a total
