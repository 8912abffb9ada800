"""Analyses over routing traces, each against a tiny trace built by hand with numbers worked out by hand."""

import hashlib
import json
import math
import re
import struct
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from moelens.traces.analysis import (
    Trace,
    builtin_class,
    delta_experts,
    delta_steer_hooks,
    trace_activation_difference,
    trace_coactivation,
    trace_coactivations,
    trace_consecutive,
    trace_expert_load,
    trace_selectivity,
    trace_subset_load,
    trace_top_tokens,
)
from moelens.traces.manifest import FORMAT
from moelens.traces.parts import schema

duckdb = pytest.importorskip("duckdb")
NOTES = Path(__file__).parent.parent / "docs" / "traces.md"

# (doc, start, pos, token, {layer: (experts, weights)}): E = 4 experts, top_k = 2, layers 0 and 1.
# Doc 0 has two windows (start 0: three tokens; start 3: one token), doc 1 one window of two tokens.
ROWS = [
    (0, 0, 0, 10, {0: ([0, 1], [0.6, 0.4]), 1: ([1, 2], [0.5, 0.5])}),
    (0, 0, 1, 11, {0: ([0, 2], [0.7, 0.3]), 1: ([1, 2], [0.6, 0.4])}),
    (0, 0, 2, 10, {0: ([1, 0], [0.5, 0.5]), 1: ([2, 3], [0.8, 0.2])}),
    (0, 3, 0, 11, {0: ([1, 0], [0.55, 0.45]), 1: ([2, 3], [0.7, 0.3])}),  # same routing as the token before,
    (1, 0, 0, 12, {0: ([3, 2], [0.9, 0.1]), 1: ([0, 1], [0.5, 0.5])}),  # but in another window: no pair
    (1, 0, 1, 10, {0: ([3, 0], [0.8, 0.2]), 1: ([3, 2], [0.6, 0.4])}),
]


def token_windows_sha256(rows) -> str:
    """The manifest's data_sha256 of these rows' windows, as moelens defines it: per window, int64 doc, start,
    length, then its token ids as int64."""
    windows: list[list] = []
    for doc, start, pos, token, _ in rows:
        if pos == 0:
            windows.append([doc, start, []])
        windows[-1][2].append(token)
    digest = hashlib.sha256()
    for doc, start, tokens in windows:
        digest.update(struct.pack("<3q", doc, start, len(tokens)) + struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.hexdigest()


def write_trace(folder: Path, rows, logits=None, files=None, model_id="m", complete=True) -> Path:
    """A trace folder as moelens.traces.run writes it: one part and its manifest."""
    folder.mkdir(parents=True)
    out = {name: [] for name in schema(logits is not None).names}
    for i, (doc, start, pos, token, routing) in enumerate(rows):
        for layer, (experts, weights) in sorted(routing.items()):
            for name, value in zip(("doc", "start", "pos", "token", "layer", "experts", "weights"), (doc, start, pos, token, layer, experts, weights)):
                out[name].append(value)
            if logits is not None:
                out["router_logits"].append(logits[layer])
    table = pa.Table.from_pydict(out, schema=schema(logits is not None))
    part = folder / "part-000000.parquet"
    pq.write_table(table, part)
    manifest = {
        "format": FORMAT, "model": {"name": model_id, "family": "qwen2_moe", "dtype": "float32", "config_sha256": model_id, "weights_fingerprint": model_id},
        "settings": {"seq_len": 3, "router_logits": logits is not None, "windows_per_part": 8, "max_tokens": None, "layers": [0, 1]},
        "data": {"kind": "files", "files": files} if files else {"kind": "iterable", "type": "builtins.list"},
        "config": {"router_scoring": "softmax"}, "layers": [0, 1], "n_experts": 4, "top_k": {"0": 2, "1": 2},
        "parts": {"0": {"file": "part-000000.parquet", "first_window": 0, "windows": sum(row[2] == 0 for row in rows), "tokens": len(rows), "rows": table.num_rows,
                        "data_sha256": token_windows_sha256(rows), "size": part.stat().st_size, "sha256": hashlib.sha256(part.read_bytes()).hexdigest()}},
        "complete": complete,
    }
    if complete:
        manifest["totals"] = {"parts": 1, "docs": 2, "windows": 3, "tokens": len(rows), "rows": table.num_rows}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.fixture
def hand(tmp_path):
    files = [{"path": "/corpus/a/x.txt", "size": 1, "sha256": "0", "first_doc": 0, "n_docs": 1},
             {"path": "/corpus/b/y.jsonl", "size": 1, "sha256": "1", "first_doc": 1, "n_docs": 1}]
    return write_trace(tmp_path / "hand", ROWS, files=files)


def test_trace_opens_the_manifest_and_refuses_incomplete_or_missing(hand, tmp_path):
    t = Trace(hand)
    assert (t.layers, t.n_experts, t.top_k, t.has_router_logits) == ([0, 1], 4, {0: 2, 1: 2}, False)
    with pytest.raises(FileNotFoundError, match="not a trace folder"):
        Trace(tmp_path)
    partial = write_trace(tmp_path / "partial", ROWS, complete=False)
    with pytest.raises(ValueError, match="incomplete"):
        Trace(partial)
    assert Trace(partial, allow_incomplete=True).layers == [0, 1]
    with pytest.raises(ValueError, match=r"layers \[5\] are not in the trace"):
        trace_expert_load(hand, layers=[5])


def test_expert_load_entropy_and_imbalance(hand):
    load = trace_expert_load(hand)
    # layer 0: expert 0 in 5 of 6 tokens, expert 1 in 3, experts 2 and 3 in 2 each (12 slots)
    # layer 1: 1, 3, 5, 3
    assert load.n_tokens == 6 and load.layers == [0, 1]
    assert load.counts.tolist() == [[5, 3, 2, 2], [1, 3, 5, 3]]
    torch.testing.assert_close(load.load[0], torch.tensor([5, 3, 2, 2]) / 12)
    h0 = -(5 / 12 * math.log(5 / 12) + 3 / 12 * math.log(3 / 12) + 2 * (2 / 12 * math.log(2 / 12)))
    assert load.load_entropy[0].item() == pytest.approx(h0, rel=1e-6)
    # mean 3; population std of (5, 3, 2, 2) = sqrt((4 + 0 + 1 + 1) / 4)
    assert load.cv[0].item() == pytest.approx(math.sqrt(6 / 4) / 3, rel=1e-6)
    assert load.max_over_mean.tolist() == pytest.approx([5 / 3, 5 / 3])
    torch.testing.assert_close(load.rates[1], torch.tensor([1, 3, 5, 3]) / 6)
    assert load.routing_entropy is None


def test_routing_entropy_from_router_logits(tmp_path):
    # softmax of (0, 0, 0, 0) has entropy ln 4; of (0, 0, -1e4, -1e4), ln 2
    logits = {0: [0.0, 0.0, 0.0, 0.0], 1: [0.0, 0.0, -1e4, -1e4]}
    load = trace_expert_load(write_trace(tmp_path / "t", ROWS, logits=logits))
    assert load.routing_entropy.tolist() == pytest.approx([math.log(4), math.log(2)], rel=1e-6)


def test_subset_load_by_file_folder_and_labels(hand):
    by_file = trace_subset_load(hand, "file", layers=0)
    assert by_file.labels == ["/corpus/a/x.txt", "/corpus/b/y.jsonl"]
    # doc 0 at layer 0: (0,1) (0,2) (1,0) (1,0); doc 1: (3,2) (3,0)
    assert by_file.counts[:, 0].tolist() == [[4, 3, 1, 0], [1, 0, 1, 2]]
    assert by_file.n_tokens.tolist() == [4, 2]
    torch.testing.assert_close(by_file.load[1, 0], torch.tensor([0.25, 0, 0.25, 0.5]))
    torch.testing.assert_close(by_file.load[0, 0], torch.tensor([4, 3, 1, 0]) / 8)
    assert trace_subset_load(hand, "folder").labels == ["/corpus/a", "/corpus/b"]
    same = trace_subset_load(hand, {0: "s", 1: "s"})
    assert same.labels == ["s"] and same.counts[0].tolist() == [[5, 3, 2, 2], [1, 3, 5, 3]]
    with pytest.raises(ValueError, match="1 traced documents have no label .*doc 1"):
        trace_subset_load(hand, {0: "only"})


def test_consecutive_tokens_same_expert_rates_and_chance(hand):
    r = trace_consecutive(hand)
    # pairs (window-internal): doc 0 (p0, p1), (p1, p2); doc 1 (p0, p1): 3 per layer
    assert r.n_pairs.tolist() == [[3, 3]]
    # layer 0 first choices: 0 0 | 0 1 | 3 3 -> 2 of 3; sets {0,1}{0,2} {0,2}{1,0} {3,2}{3,0} share -> 3 of 3
    # layer 1 first choices: 1 1 | 1 2 | 0 3 -> 1 of 3; sets {1,2}{1,2} {1,2}{2,3} share, {0,1}{3,2} not -> 2 of 3
    assert r.same_top1[0].tolist() == pytest.approx([2 / 3, 1 / 3])
    assert r.same_any[0].tolist() == pytest.approx([1, 2 / 3])
    # first-choice shares: layer 0 (0, 0, 1, 1, 3, 3) -> 1/3 each of three; layer 1 (1, 1, 2, 2, 0, 3)
    assert r.chance_top1[0].tolist() == pytest.approx([3 / 9, (1 + 4 + 4 + 1) / 36])
    assert r.uniform_top1.tolist() == pytest.approx([0.25, 0.25])
    assert r.uniform_any.tolist() == pytest.approx([1 - 1 / 6] * 2)  # 1 - C(2,2)/C(4,2)
    by_doc = trace_consecutive(hand, layers=[0], by=["d0", "d1"])
    assert by_doc.labels == ["d0", "d1"] and by_doc.n_pairs.tolist() == [[2], [1]]
    assert by_doc.same_top1[:, 0].tolist() == pytest.approx([1 / 2, 1])


def test_selectivity_mutual_information_by_user_classes(hand):
    s = trace_selectivity(hand, {10: "x", 11: "y", 12: "y"}, layers=[0])
    # layer 0 slots per expert (x, y): e0 (3, 2), e1 (2, 1), e2 (0, 2), e3 (1, 1); 6 x and 6 y of 12
    assert s.classes == ["x", "y"] and s.counts[0].tolist() == [[3, 2], [2, 1], [0, 2], [1, 1]]
    kl = [0.6 * math.log(1.2) + 0.4 * math.log(0.8), 2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3), math.log(2), 0.0]
    assert s.expert_kl[0].tolist() == pytest.approx(kl, abs=1e-6)
    mi = 5 / 12 * kl[0] + 3 / 12 * kl[1] + 2 / 12 * kl[2]
    assert s.mutual_information.item() == pytest.approx(mi, rel=1e-6)
    assert s.class_entropy.item() == pytest.approx(math.log(2), rel=1e-6)
    assert s.normalized.item() == pytest.approx(mi / math.log(2), rel=1e-6)
    top = s.top_classes[0][0]
    assert [(c.name, c.share, c.lift) for c in top] == [("x", pytest.approx(0.6), pytest.approx(1.2)), ("y", pytest.approx(0.4), pytest.approx(0.8))]
    with pytest.raises(ValueError, match="no class for 1 traced tokens .*token 12"):
        trace_selectivity(hand, {10: "x", 11: "y"})
    assert trace_selectivity(hand, {10: "x"}, default="rest").classes == ["rest", "x"]


def test_selectivity_by_token_and_builtin_classes(hand):
    by_token = trace_selectivity(hand, "token", layers=[1])
    assert by_token.classes == ["10", "11", "12"]
    # layer 1, token 12 only at expert 0 and 1 (one slot each): tokens (10, 11, 12) per expert
    assert by_token.counts[0].tolist() == [[0, 0, 1], [1, 1, 1], [3, 2, 0], [2, 1, 0]]
    text = {10: " ", 11: "foo_1", 12: "7"}
    builtin = trace_selectivity(hand, "builtin", decode=lambda ids: "".join(text[i] for i in ids), layers=[0])
    assert builtin.classes == ["whitespace", "digits", "word"]
    assert builtin.counts[0].tolist() == [[3, 0, 2], [2, 0, 1], [0, 1, 1], [1, 1, 0]]
    with pytest.raises(ValueError, match="needs decode="):
        trace_selectivity(hand, "builtin")


@pytest.mark.parametrize(
    "text, expected",
    [("  ", "whitespace"), ("\n", "whitespace"), (",", "punctuation"), (" ->", "punctuation"), ("42", "digits"),
     (" the", "word"), ("foo_bar2", "word"), ("_", "punctuation"), ("a1!", "other"), ("", "other"), ("\ufffd", "other")],
)
def test_builtin_classes(text, expected):
    assert builtin_class(text) == expected


def test_coactivation_across_layers(hand):
    # per token, layer-0 set x layer-1 set, summed over the 6 tokens (worked out in ROWS' order)
    expected = [[0, 2, 5, 3], [0, 1, 3, 2], [1, 2, 1, 0], [1, 1, 1, 1]]
    assert trace_coactivation(hand, 0, 1).tolist() == expected
    both = trace_coactivations(hand, [(0, 1), (1, 0), (0, 0)])
    assert both[(1, 0)].tolist() == torch.tensor(expected).T.tolist()
    within = both[(0, 0)]
    assert within.diagonal().tolist() == [5, 3, 2, 2] and within[0, 1].item() == 3  # tokens routed to both 0 and 1


def test_top_tokens_of_an_expert_with_their_context(hand):
    text = {10: "a", 11: "b", 12: "c"}
    top = trace_top_tokens(hand, layer=0, expert=0, k=3, context=1, decode=lambda ids: "".join(text[i] for i in ids))
    # weights on expert 0 at layer 0: 0.7 (doc 0 pos 1), 0.6 (pos 0), 0.5 (pos 2), 0.45 (doc 0 @3), 0.2 (doc 1)
    assert [(t.doc, t.start, t.pos) for t in top] == [(0, 0, 1), (0, 0, 0), (0, 0, 2)]
    assert [t.value for t in top] == pytest.approx([0.7, 0.6, 0.5])
    first = top[0]
    assert (first.token, first.before, first.after, first.token_str, first.before_str, first.after_str) == (11, [10], [10], "b", "a", "a")
    assert top[1].before == [] and top[2].after == []  # contexts stay inside the window
    assert "[[b]]" in str(top)
    with pytest.raises(ValueError, match="no router logits"):
        trace_top_tokens(hand, 0, 0, by="logit")
    with pytest.raises(IndexError, match="expert 4 is out of range"):
        trace_top_tokens(hand, 0, 4)


# Corpus B: two tokens, both routed to (0, 1) at layer 0 and to (2, 3) at layer 1.
ROWS_B = [(0, 0, p, 10, {0: ([0, 1], [0.5, 0.5]), 1: ([2, 3], [0.5, 0.5])}) for p in range(2)]


def test_activation_difference_ranked_and_turned_into_intervention_arguments(hand, tmp_path):
    b = write_trace(tmp_path / "b", ROWS_B)
    deltas = trace_activation_difference(hand, b)
    # rates A: layer 0 (5, 3, 2, 2)/6, layer 1 (1, 3, 5, 3)/6; B: layer 0 (1, 1, 0, 0), layer 1 (0, 0, 1, 1)
    top = [(d.layer, d.expert, round(d.delta, 6)) for d in deltas[:5]]
    assert top == [(0, 1, -0.5), (1, 1, 0.5), (1, 3, -0.5), (0, 2, round(1 / 3, 6)), (0, 3, round(1 / 3, 6))]
    assert deltas[0].rate_a == pytest.approx(0.5) and deltas[0].rate_b == pytest.approx(1.0)
    assert len(deltas) == 8
    assert delta_experts(deltas, top=2) == {1: [1], 0: [2]}
    assert delta_experts(deltas, sign="negative") == {0: [1, 0], 1: [3, 2]}
    assert delta_experts(deltas, sign="negative", threshold=0.2) == {0: [1], 1: [3]}
    other = write_trace(tmp_path / "other", ROWS_B, model_id="another")
    with pytest.raises(ValueError, match="trace different models"):
        trace_activation_difference(hand, other)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from moelens import HookedTransformer
    from moelens.defaults import default_checkpoint

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards on shared cores
    yield HookedTransformer.from_pretrained(default_checkpoint("tiny-qwen2-moe", root=tmp_path_factory.mktemp("cache")), progress=False)
    torch.set_num_threads(before)


def test_on_a_real_trace_the_numbers_are_those_of_the_in_memory_analyses(model, tmp_path):
    from moelens.analysis import coactivations, expert_usage
    from moelens.traces import trace

    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (int(n),), generator=gen) for n in (17, 30, 5, 24)]
    trace(model, docs, tmp_path / "t", seq_len=32, batch_size=2, router_logits=True, progress=False)
    batches = [d[None] for d in docs]  # one document per forward, as the trace's windows
    usage = expert_usage(model, batches)
    load = trace_expert_load(tmp_path / "t")
    assert torch.equal(load.counts, usage.counts) and load.n_tokens == usage.n_tokens
    torch.testing.assert_close(load.routing_entropy, usage.routing_entropy, rtol=1e-4, atol=1e-5)
    pairs = [(0, 1), (2, 2), (3, 0)]
    ours = trace_coactivations(tmp_path / "t", pairs)
    theirs = coactivations(model, batches, pairs)
    assert all(torch.equal(ours[p], theirs[p]) for p in pairs)


def test_delta_steer_hooks_feed_steer_router(hand, tmp_path, model):
    deltas = trace_activation_difference(hand, write_trace(tmp_path / "b", ROWS_B))
    hooks = delta_steer_hooks(model, deltas, value=5.0, top=2)
    assert [name for name, _ in hooks] == ["blocks.1.mlp.hook_router_logits", "blocks.0.mlp.hook_router_logits"]
    tokens = torch.tensor([[1, 2, 3, 4]])
    name = "blocks.0.mlp.hook_router_logits"  # layer 0 sees only its own steering: expert 2 up by 5
    _, plain = model.run_with_cache(tokens, names_filter=[name])
    with model.hooks(fwd_hooks=hooks):
        _, steered = model.run_with_cache(tokens, names_filter=[name])
    diff = steered[name] - plain[name]
    assert torch.allclose(diff[..., 2], torch.tensor(5.0)) and torch.allclose(diff[..., [0, 1, 3, 4, 5, 6, 7]], torch.tensor(0.0))


def sql_blocks() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", NOTES.read_text(), flags=re.S)


def test_the_readme_queries_run_and_give_the_hand_numbers(hand, tmp_path):
    """The three DuckDB queries of docs/traces.md, run as printed (paths substituted)."""
    b = write_trace(tmp_path / "b", ROWS_B)
    load_q, top_q, diff_q = sql_blocks()
    sub = lambda q: q.replace("traces/wiki", str(hand)).replace("traces/code", str(b))  # noqa: E731
    load = duckdb.sql(sub(load_q)).fetchall()
    assert [(layer, e, n) for layer, e, n, _ in load] == [(0, 0, 5), (0, 1, 3), (0, 2, 2), (0, 3, 2), (1, 0, 1), (1, 1, 3), (1, 2, 5), (1, 3, 3)]
    assert load[0][3] == pytest.approx(5 / 12)
    top = duckdb.sql(sub(top_q).replace("layer = 12", "layer = 0").replace("7::SMALLINT", "0::SMALLINT")).fetchall()
    # expert 0 at layer 0: token 10 three times (0.6, 0.5, 0.2), token 11 twice (0.7, 0.45)
    assert [(t, n) for t, n, _ in top] == [(10, 3), (11, 2)] and top[0][2] == pytest.approx((0.6 + 0.5 + 0.2) / 3)
    diff = duckdb.sql(sub(diff_q)).fetchall()
    ours = [(d.layer, d.expert, d.delta) for d in trace_activation_difference(hand, b)]
    assert sorted((layer, e, round(d, 6)) for layer, e, d in diff) == sorted((layer, e, round(d, 6)) for layer, e, d in ours)


def rewrite_part(folder: Path, table: pa.Table) -> None:
    """Replace the part's rows (no footer identity, as an earlier moelens wrote parts), with a manifest whose
    size and sha256 match the new file."""
    part = folder / "part-000000.parquet"
    pq.write_table(pa.Table.from_arrays(table.columns, schema=schema(False)), part)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["parts"]["0"].update(size=part.stat().st_size, sha256=hashlib.sha256(part.read_bytes()).hexdigest())
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_part_without_footer_identity_is_checked_by_its_layers_and_token_windows(hand, tmp_path):
    table = pq.read_table(hand / "part-000000.parquet")
    layer = table["layer"].to_numpy().copy()
    layer[-1] = 5  # one row of a layer the manifest does not record
    rewrite_part(hand, table.set_column(4, "layer", pa.array(layer, pa.int16())))
    with pytest.raises(ValueError, match=r"part-000000.parquet holds rows of layers \{0: 6, 1: 5, 5: 1\}"):
        Trace(hand)
    token = table["token"].to_numpy().copy()
    token[0], token[1] = 11, 11  # the first token, at both layers: other windows on the same layers
    rewrite_part(hand, table.set_column(3, "token", pa.array(token, pa.int32())))
    with pytest.raises(ValueError, match="part-000000.parquet holds other token windows"):
        Trace(hand)
    rewrite_part(hand, table)  # the rows as they were: accepted
    assert Trace(hand).n_tokens == len(ROWS)


def test_result_classes_print_as_tables(hand):
    """Selectivity, ConsecutiveRouting and SubsetLoad print (and repr, as a notebook shows them) as tables of
    their numbers, not as dataclass reprs full of tensors."""
    sub = trace_subset_load(hand, "file", layers=0)
    cons = trace_consecutive(hand)
    sel = trace_selectivity(hand, {10: "x", 11: "y", 12: "y"}, layers=[0])
    for result in (sub, cons, sel):
        for text in (str(result), repr(result)):
            assert "tensor(" not in text and "=" not in text.split("\n")[0].split("(")[0], text
            assert len(text.splitlines()) >= 3, text
    # the rows hold the numbers of the hand-checked tests above
    assert "E0 0.500, E1 0.375, E2 0.125" in str(sub)  # doc 0 at layer 0: counts [4, 3, 1, 0] of 8 slots
    row = next(line for line in str(cons).splitlines() if line.startswith("all") and line.split()[1] == "0")
    assert row.split()[2:5] == ["3", "0.667", "0.333"]  # 3 pairs, 2 of 3 same first choice, chance 3/9
    assert f"{math.log(2):.4f}" in str(sel) and "E2" in str(sel)  # H(C) = ln 2; expert 2 (all y) is the most selective
