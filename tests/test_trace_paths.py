"""Routing paths, routing overlap and expert specialization over traces (DuckDB, out of core): against the
hand trace of test_trace_analysis with its numbers worked out by hand, and against the in-memory analyses
on real traces."""

import copy
import math
from dataclasses import replace

import pytest
import torch
from test_trace_analysis import ROWS, write_trace

from moelens.analysis import expert_specialization, routing_overlap, routing_paths
from moelens.traces import trace_routing_overlap, trace_routing_paths, trace_specialization

duckdb = pytest.importorskip("duckdb")


def h2(p):
    return -sum(x * math.log2(x) for x in p if x > 0)


def jsd_by_hand(p, q):
    p = [x / sum(p) for x in p]
    q = [x / sum(q) for x in q]
    return h2([(a + b) / 2 for a, b in zip(p, q)]) - (h2(p) + h2(q)) / 2


# The hand trace with row 1's layer-0 slots swapped: the top-1 expert (0, weight .7) is now in slot 1.
SWAPPED = [*ROWS[:1], (*ROWS[1][:4], {**ROWS[1][4], 0: ([2, 0], [0.3, 0.7])}), *ROWS[2:]]
FILES = [{"path": "/corpus/a/x.txt", "size": 1, "sha256": "0", "first_doc": 0, "n_docs": 1},
         {"path": "/corpus/b/y.jsonl", "size": 1, "sha256": "1", "first_doc": 1, "n_docs": 1}]


@pytest.fixture
def hand(tmp_path):
    return write_trace(tmp_path / "hand", SWAPPED, files=FILES)


def test_paths_and_entropy_by_hand(hand):
    # top-1 per token (layer 0, layer 1): (0,1) (0,1) (1,2) (1,2) (3,0) (3,3); rows 0, 2 and 4 break a tie by
    # slot, row 1's layer-0 top-1 is its second slot
    paths = trace_routing_paths(hand)
    assert paths.paths == [((0, 1), 2), ((1, 2), 2), ((3, 0), 1), ((3, 3), 1)]
    assert (paths.n_tokens, paths.n_distinct, paths.layers) == (6, 4, [0, 1])
    assert math.isclose(paths.entropy, 2 * (1 / 3) * math.log2(3) + 2 * (1 / 6) * math.log2(6), abs_tol=1e-12)
    assert trace_routing_paths(hand, top=1).paths == [((0, 1), 2)]
    with pytest.raises(ValueError, match="two or more consecutive"):
        trace_routing_paths(hand, layers=[0])


def test_overlap_by_hand(hand, tmp_path):
    rows_b = [list(r) for r in SWAPPED]
    rows_b[0][4] = {**ROWS[0][4], 0: ([0, 2], [0.5, 0.5])}  # {0: .6, 1: .4} against {0: .5, 2: .5}: .5 / 1.5
    rows_b[5][4] = {**ROWS[5][4], 0: ([1, 2], [0.5, 0.5])}  # disjoint: 0; the top-1 moves from 3 to 1
    other = write_trace(tmp_path / "b", [tuple(r) for r in rows_b], files=FILES)
    overlap = trace_routing_overlap(hand, other)
    torch.testing.assert_close(overlap.token_jaccard, torch.tensor([(1 / 3 + 4) / 6, 1.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(overlap.top1_agreement, torch.tensor([5 / 6, 1.0]), rtol=0, atol=0)
    # layer 0's slots: A e0 5, e1 3, e2 2, e3 2; B e0 4, e1 3, e2 4, e3 1: min 10, max 14
    torch.testing.assert_close(overlap.load_jaccard, torch.tensor([10 / 14, 1.0]), rtol=0, atol=1e-6)
    assert overlap.n_tokens == 6
    same = trace_routing_overlap(hand, hand)
    assert torch.equal(same.token_jaccard, torch.ones(2)) and torch.equal(same.top1_agreement, torch.ones(2))


def test_overlap_refuses_traces_of_other_tokens(hand, tmp_path):
    rows = [list(r) for r in SWAPPED]
    rows[3][3] = 12  # another token at doc 0, position 3
    with pytest.raises(ValueError, match="do not hold the same tokens: 1 positions differ.*doc 0"):
        trace_routing_overlap(hand, write_trace(tmp_path / "b", [tuple(r) for r in rows], files=FILES))
    with pytest.raises(ValueError, match="do not hold the same tokens: 2 positions"):
        trace_routing_overlap(hand, write_trace(tmp_path / "c", SWAPPED[:4], files=FILES))


def test_specialization_by_token_and_by_file_by_hand(hand):
    spec = trace_specialization(hand, layers=0)
    # tokens 10, 11, 10, 11, 12, 10 in two slots each: the layer's (3, 2, 1) / 6
    assert spec.classes == ["10", "11", "12"]
    assert spec.counts[0].tolist() == [[3, 2, 0], [2, 1, 0], [0, 1, 1], [1, 0, 1]]
    want = [jsd_by_hand(c, [3, 2, 1]) for c in ([3, 2, 0], [2, 1, 0], [0, 1, 1], [1, 0, 1])]
    torch.testing.assert_close(spec.jsd[0], torch.tensor(want), rtol=0, atol=1e-6)
    by_file = trace_specialization(hand, by="file", layers=0)
    # doc 0 (four tokens) routes e0 4 times, e1 3, e2 1, e3 0; doc 1 (two): e0 1, e2 1, e3 2
    assert by_file.classes == ["/corpus/a/x.txt", "/corpus/b/y.jsonl"]
    assert by_file.counts[0].tolist() == [[4, 1], [3, 0], [1, 1], [0, 2]]
    torch.testing.assert_close(by_file.jsd[0, 3], torch.tensor(jsd_by_hand([0, 1], [2, 1])), rtol=0, atol=1e-6)
    grouped = trace_specialization(hand, classes={10: "x"}, default="y", layers=0)
    assert grouped.classes == ["x", "y"] and grouped.counts[0].tolist() == [[3, 2], [2, 1], [0, 2], [1, 1]]
    with pytest.raises(ValueError, match="no class for 2 traced tokens"):
        trace_specialization(hand, classes={10: "x"})
    with pytest.raises(ValueError, match="not both"):
        trace_specialization(hand, classes={10: "x"}, by="file")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from moelens import HookedTransformer
    from moelens.defaults import default_checkpoint

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    base = HookedTransformer.from_pretrained(default_checkpoint("tiny-qwen2-moe", root=tmp_path_factory.mktemp("cache")), progress=False)
    tuned = copy.deepcopy(base)  # "fine-tuned": the routers moved a little, so some tokens change experts
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in tuned.blocks:
            if block.is_moe:
                for p in block.mlp.router.parameters():
                    p.add_(0.5 * p.std() * torch.randn(p.shape, generator=gen))
    yield base, tuned
    torch.set_num_threads(before)


def test_on_real_traces_the_numbers_are_those_of_the_in_memory_analyses(models, tmp_path):
    from moelens.traces import trace

    base, tuned = models
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (int(n),), generator=gen) for n in (17, 30, 5, 24)]
    for name, m in (("base", base), ("tuned", tuned)):
        trace(m, docs, tmp_path / name, seq_len=32, batch_size=2, progress=False)
    batches = [d[None] for d in docs]  # one document per forward, as the trace's windows
    ours, theirs = trace_routing_paths(tmp_path / "base", top=50), routing_paths(base, batches, top=50)
    assert ours.n_tokens == 76 and math.isclose(ours.entropy, theirs.entropy, abs_tol=1e-12)  # summed in another order
    assert replace(ours, entropy=0.0) == replace(theirs, entropy=0.0)
    ours, theirs = trace_routing_overlap(tmp_path / "base", tmp_path / "tuned"), routing_overlap(base, tuned, batches)
    assert ours.n_tokens == theirs.n_tokens and torch.equal(ours.top1_agreement, theirs.top1_agreement)
    torch.testing.assert_close(ours.token_jaccard, theirs.token_jaccard, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.load_jaccard, theirs.load_jaccard, rtol=0, atol=1e-6)
    assert (ours.token_jaccard < 1).all() and (ours.token_jaccard > 0).all()  # the perturbation moved some routing
    classes = {t: "even" if t % 2 == 0 else "odd" for t in range(256)}
    for kind in ("token", classes):
        ours = trace_specialization(tmp_path / "base", classes=kind)
        theirs = expert_specialization(base, batches, classes=kind, saliency=False)
        assert ours.classes == theirs.classes and torch.equal(ours.counts, theirs.counts)
        torch.testing.assert_close(ours.jsd, theirs.jsd, rtol=0, atol=0, equal_nan=True)
