"""The trace report and its plots, on the hand-built trace of test_trace_analysis (numbers worked out by hand)."""

import dataclasses

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("matplotlib")

from moelens.analysis.plots import plot_selectivity, plot_subset_load  # noqa: E402
from moelens.traces import trace_report, trace_selectivity, trace_subset_load  # noqa: E402
from moelens.cli import main  # noqa: E402
from test_trace_analysis import hand  # noqa: E402,F401  (the hand-built trace, two folders a/ and b/)

PNG = b"\x89PNG\r\n\x1a\n"
TEXT = {10: "def", 11: " ", 12: "7"}  # token -> text: an identifier, whitespace, a digit


def decode(ids):
    return "".join(TEXT[i] for i in ids)


def test_html_report_holds_the_hand_computed_numbers_and_its_plots(hand, tmp_path):
    out = trace_report(hand, tmp_path / "report.html", decode=decode)
    page = out.read_text()
    # layer 0 slots: E0 5, E1 3, E2 2, E3 2 of 12; folder a (doc 0) E0 4, E1 3, E2 1, E3 0 of 8; b: 1, 0, 1, 2 of 4
    assert "0.50 0.38 0.12 0.00" in page and "0.25 0.00 0.25 0.50" in page
    # consecutive pairs in layer 0: (0,1)->(0,2) same first choice, (0,2)->(1,0) not, doc 1 (3,2)->(3,0) same: 2 of 3
    assert "66.7%" in page
    for image in ("subset_load.png", "selectivity.png"):
        assert f'src="report_files/{image}"' in page
        assert (tmp_path / "report_files" / image).read_bytes().startswith(PNG)
    # expert 3 of layer 0 has tokens 12 (w 0.9) and 10 (w 0.8): the strongest shown first, in context
    block = page.split("expert 3 of layer 0")[1]
    assert block.index("0.9000") < block.index("0.8000") and "[[7]]" in block


def test_folder_report_writes_pngs_and_text(hand, tmp_path):
    out = trace_report(hand, tmp_path / "pngs", decode=decode, by="file")
    assert (out / "subset_load.png").read_bytes().startswith(PNG)
    text = (out / "report.txt").read_text()
    assert "## Expert load by file" in text and "(plot: selectivity.png)" in text


def test_report_without_a_tokenizer_says_what_it_left_out(hand, tmp_path):
    out = trace_report(hand, tmp_path / "r.html")
    assert "left out: no tokenizer" in out.read_text() and not (tmp_path / "r_files" / "selectivity.png").exists()


def test_report_refuses_a_file_that_is_not_html(hand, tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="notes.txt: the report goes into a folder"):
        trace_report(hand, tmp_path / "notes.txt")


def test_plots_return_one_panel_per_layer(hand):
    load = plot_subset_load(trace_subset_load(hand, by="folder"))
    assert len([a for a in load.axes if a.get_title()]) == 2  # layers 0 and 1 (plus the colorbar axis)
    sel = trace_selectivity(hand, "builtin", decode=decode)
    fig = plot_selectivity(sel)
    titles = [a.get_title() for a in fig.axes if a.get_title()]
    assert titles[0].startswith("layer 0: I = ") and len(titles) == 2
    with pytest.raises(ValueError, match="holds no counts"):
        plot_selectivity(dataclasses.replace(sel, counts=None))


def test_trace_report_command(hand, tmp_path, capsys):
    # the recorded model ("m") is neither local nor embedded: no tokenizer, said on stderr, report still written
    assert main(["trace-report", str(hand), "--out", str(tmp_path / "c.html")]) == 0
    captured = capsys.readouterr()
    assert "no tokenizer for m" in captured.err and "report written to" in captured.out
    assert main(["trace-report", str(tmp_path), "--out", str(tmp_path / "d.html")]) == 2
    assert "not a trace folder" in capsys.readouterr().err


def test_subset_plot_shows_folders_relative_to_the_one_they_share(hand):
    fig = plot_subset_load(trace_subset_load(hand, by="folder"))
    shown = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert shown == ["a (4 tok)", "b (2 tok)"]  # /corpus/a and /corpus/b: doc 0 has 4 tokens, doc 1 two


def test_top_tokens_print_one_line_each_with_newlines_shown(hand):
    from moelens.traces import trace_top_tokens

    text = {10: "a\n", 11: "\t", 12: "b"}
    top = trace_top_tokens(hand, layer=0, expert=3, k=2, decode=lambda ids: "".join(text[i] for i in ids))
    lines = str(top).splitlines()
    assert len(lines) == 3 and lines[1].endswith("[[b]]a\\n") and "\\t" not in lines[1]


def test_folder_and_file_names_with_dollars_are_drawn_as_text(tmp_path, capsys):
    """A folder named like "$\\foo$" made matplotlib's mathtext raise ParseFatalException, and "$x^2$" was
    drawn as math: data labels are plain text."""
    from test_trace_analysis import ROWS, write_trace

    files = [{"path": "/corpus/$\\foo$/x.txt", "size": 1, "sha256": "0", "first_doc": 0, "n_docs": 1},
             {"path": "/corpus/$x^2$/y.jsonl", "size": 1, "sha256": "1", "first_doc": 1, "n_docs": 1}]
    dollars = write_trace(tmp_path / "dollars", ROWS, files=files)
    assert main(["trace-report", str(dollars), "--out", str(tmp_path / "r.html")]) == 0, capsys.readouterr().err
    assert (tmp_path / "r_files" / "subset_load.png").read_bytes().startswith(PNG)
    fig = plot_subset_load(trace_subset_load(dollars, by="folder"))
    fig.canvas.draw()
    labels = fig.axes[0].get_yticklabels()
    assert [t.get_text() for t in labels] == ["$\\foo$ (4 tok)", "$x^2$ (2 tok)"]
    assert not any(t.get_parse_math() for t in labels)
    sel = trace_selectivity(dollars, {10: "$\\foo$", 11: "$x^2$", 12: "$x^2$"})
    fig = plot_selectivity(sel)
    fig.canvas.draw()
    labels = fig.axes[0].get_xticklabels()
    assert sorted(t.get_text() for t in labels) == ["$\\foo$", "$x^2$"] and not any(t.get_parse_math() for t in labels)
