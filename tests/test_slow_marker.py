"""`pytest -m "not slow"` is the fast subset for development: it leaves out the tests of a minute or more in all
(Triton's CPU interpreter, multi-process expert parallelism, README's examples run as scripts) and keeps the rest."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_triton_kernels.py", "tests/test_expert_parallel.py", "tests/test_readme_examples.py",
         "tests/test_tl_parity_expert_hooks.py"]


def collected(marker: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marker, *FILES],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the Triton kernels are compiled, not interpreted")
def test_not_slow_leaves_out_the_interpreter_the_ranks_and_the_readme_scripts():
    fast, slow = collected("not slow"), collected("slow")
    assert fast and slow
    assert not [t for t in fast if "triton" in t.lower() or t.startswith("tests/test_expert_parallel.py")]
    assert not [t for t in fast if "test_python_block_runs" in t or "test_moelens_command_runs" in t]
    # what stays: the torch-backend cases and README's static checks
    assert any("torch" in t for t in fast if t.startswith("tests/test_tl_parity_expert_hooks.py"))
    assert any("test_a_block_not_run_compiles" in t for t in fast)
