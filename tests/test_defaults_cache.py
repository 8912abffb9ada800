"""The embedded defaults' cache: many processes at once, a killed build, a stale folder."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

from safetensors.torch import load_file

from moelens.defaults import COMPLETE, default_checkpoint

BUILD_AND_HASH = """
import hashlib
from moelens.defaults import default_checkpoint
folder = default_checkpoint("tiny-qwen2-moe")
print(hashlib.sha256((folder / "model.safetensors").read_bytes() + (folder / "config.json").read_bytes()).hexdigest())
"""


def digest(folder):
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def test_many_processes_building_at_once_all_succeed_and_agree(tmp_path):
    env = {**os.environ, "MOELENS_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", BUILD_AND_HASH], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(24)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    assert len({out.strip() for out, _ in results}) == 1
    folders = list((tmp_path / "defaults").iterdir())
    assert [f.name for f in folders] == ["tiny-qwen2-moe-seed0"]  # no temporary folder left behind


def test_a_half_built_folder_is_rebuilt(tmp_path):
    good = default_checkpoint("tiny-qwen2-moe", root=tmp_path / "good")
    folder = tmp_path / "cache" / "defaults" / good.name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((good / "config.json").read_text())
    (folder / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:1000])  # cut short
    rebuilt = default_checkpoint("tiny-qwen2-moe", root=tmp_path / "cache")
    assert rebuilt == folder and digest(rebuilt) == digest(good)
    assert load_file(rebuilt / "model.safetensors").keys() == load_file(good / "model.safetensors").keys()
    assert json.loads((rebuilt / COMPLETE).read_text()) == json.loads((good / "config.json").read_text())


def test_a_build_killed_midway_leaves_nothing_that_counts(tmp_path):
    """SIGKILL a process while it builds; the next one builds a complete default and nothing is mixed in."""
    env = {**os.environ, "MOELENS_CACHE": str(tmp_path)}
    for delay in (0.3, 0.8, 1.5):
        proc = subprocess.Popen([sys.executable, "-c", "from moelens.defaults import default_checkpoint; default_checkpoint('tiny-qwen2-moe')"], env=env)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    folder = default_checkpoint("tiny-qwen2-moe", root=tmp_path)
    assert digest(folder) == digest(default_checkpoint("tiny-qwen2-moe", root=tmp_path / "fresh"))
