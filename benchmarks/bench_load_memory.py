"""Peak memory of from_pretrained against the checkpoint's size (target: <= 1.1x).

Builds a float32 Qwen2-MoE checkpoint (the tests' tiny config scaled up to about 270 MB, one safetensors
file) and loads it with HookedTransformer.from_pretrained in fresh subprocesses, each measuring
(peak RSS after loading - peak RSS after imports) / checkpoint bytes. The peak is /proc VmHWM, the peak
resident set of the child's own address space (ru_maxrss would carry the parent's peak into the child).
The median of --runs loads is printed, with the resident growth (what the model keeps) beside it.

Usage: python benchmarks/bench_load_memory.py [--runs N] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # run from a checkout without installing moelens
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

TARGET = 1.1
# the tests' qwen2_moe config, scaled up: about 68M parameters, 273 MB in float32
CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    num_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=1024,
)

# everything moelens and torch import is in the "before" reading: the ratio counts what loading allocates
CHILD = """
import sys, torch, moelens
def status(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field + ":")).split()[1]) * 1024
before = status("VmHWM"), status("VmRSS")
model = moelens.HookedTransformer.from_pretrained(sys.argv[1], dtype=torch.float32, progress=False)
after = status("VmHWM"), status("VmRSS")
print(after[0] - before[0], after[1] - before[1])
"""


def build_checkpoint(folder: Path) -> int:
    """A float32 checkpoint in folder (kept if already there); returns its safetensors bytes."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        import tiny

        tiny.build_qwen2_moe(folder, seed=0, max_shard_size="100GB", **CONFIG)
        files = sorted(folder.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def load_growth(folder: Path) -> tuple[int, int]:
    """(peak growth, resident growth) in bytes of one from_pretrained in a fresh process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"the loading subprocess failed:\n{out.stderr}")
    peak, resident = (int(x) for x in out.stdout.split()[-2:])
    return peak, resident


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="loads to take the median of")
    parser.add_argument("--out", type=Path, help="keep the checkpoint here (reused when present)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        size = build_checkpoint(folder)
        runs = [load_growth(folder) for _ in range(args.runs)]
    peak = statistics.median(r[0] for r in runs)
    resident = statistics.median(r[1] for r in runs)
    print(f"checkpoint: {size / 1e6:.0f} MB (float32)")
    print(f"from_pretrained peak RSS growth: {peak / 1e6:.0f} MB, resident after: {resident / 1e6:.0f} MB "
          f"(median of {args.runs}; peaks {', '.join(f'{r[0] / 1e6:.0f}' for r in runs)} MB)")
    ratio = peak / size
    print(f"peak / checkpoint: {ratio:.3f}x (target <= {TARGET}x){'' if ratio <= TARGET else '  ABOVE TARGET'}")


if __name__ == "__main__":
    main()
