"""The moelens command's rough edges: a missing optional dependency is one line before any work, --threads,
a mistyped option gets its subcommand's suggestion."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moelens.cli import main

ROOT = Path(__file__).resolve().parent.parent


def run_without(module: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`moelens argv` in a fresh process where importing `module` fails as if it were not installed."""
    code = (
        f"import sys; sys.modules[{module!r}] = None\n"  # import of a None entry raises ImportError
        "from moelens.cli import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_trace_without_pyarrow_is_one_line(tmp_path):
    (tmp_path / "doc.txt").write_text("some text")
    done = run_without("pyarrow", ["trace", "--data", "doc.txt", "--out", "out"], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pyarrow" in lines[0] and ".[trace]" in lines[0], done.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_plot_without_matplotlib_fails_before_any_work(tmp_path):
    done = run_without("matplotlib", ["inspect", "--plot", "routing.png"], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "matplotlib" in lines[0] and ".[plot]" in lines[0], done.stderr
    assert done.stdout == ""  # no model loaded, no table printed


def test_trace_report_without_duckdb_is_one_line(tmp_path):
    done = run_without("duckdb", ["trace-report", "no-trace", "--out", "r.html"], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "duckdb" in lines[0], done.stderr


def test_inspect_threads_sets_torch_threads(monkeypatch, capsys):
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    assert main(["inspect", "--threads", "1", "--prompt", "a b"]) == 0
    assert set_to == [1]
    assert main(["inspect", "--prompt", "a b"]) == 0
    assert set_to == [1]  # not given: torch's own default is left alone


def test_trace_threads_sets_torch_threads(monkeypatch, tmp_path, capsys):
    pytest.importorskip("pyarrow")
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    (tmp_path / "doc.txt").write_text("def f(x):\n    return x\n")
    argv = ["trace", "--data", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "t"), "--threads", "1", "--no-progress"]
    assert main(argv + ["--seq-len", "8"]) == 0
    assert set_to == [1]


@pytest.mark.parametrize("bad", ["0", "two"])
def test_threads_must_be_a_positive_integer(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", "--threads", bad])
    assert exit_.value.code == 2
    assert "--threads" in capsys.readouterr().err


def test_mistyped_option_is_reported_by_its_subcommand_with_a_suggestion(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", "--promt", "hello"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moelens inspect: error:") and "--promt (did you mean --prompt?)" in err, err
    assert "see moelens inspect -h" in err and len(err.splitlines()) == 1


def test_plan_of_a_hub_id_fails_fast_when_the_hub_is_unreachable(tmp_path):
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing listens there: every request is refused at once
    }
    times = {}
    for command in ("plan", "inspect"):
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "moelens", command, "someowner/somemodel"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        times[command] = time.monotonic() - start
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "someowner/somemodel" in lines[0], done.stderr
    # hf_hub_download's retries took plan some 25 s (1 + 2 + 4 + 8 + 8 s of back-off); inspect fails at once
    assert times["plan"] < times["inspect"] + 5, times
