"""Benchmark moelens against transformers on a ~70M-parameter Qwen2-MoE checkpoint, CPU only.

What it measures (all on the same randomly initialised checkpoint, built here with transformers):

1. Forward time, batch 4 x 256 tokens, float32 and bfloat16: moelens vs transformers with its default
   attention (sdpa) and default experts implementation, plus transformers with eager attention as a
   second reference row. torch.no_grad, warmup runs, then the median of N runs.
2. run_with_cache (every hook point cached) vs a plain moelens forward on the same input. Caching the
   attention scores and pattern needs moelens' eager attention, whatever its attention backend.
3. Peak RSS of `from_pretrained` of the float32 checkpoint, each library in a fresh subprocess:
   (peak RSS after loading - peak RSS after imports) / checkpoint bytes. The peak is /proc VmHWM, which
   is ru_maxrss without the parent's peak that Linux carries into a child's ru_maxrss (see RSS_SCRIPT).

Timings are wall clock and need a quiet machine: the script reports how much CPU other processes used
while it timed, and warns above 10%.

Prints a markdown table that can be pasted into README.md.
Usage: python benchmarks/bench_qwen2_moe.py [--quick] [--out DIR] [--threads N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # run from a checkout without installing moelens
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from tiny import perturb  # noqa: E402  (the tests' non-degenerate initialisation)
SEED = 0
BATCH, POS = 4, 256
CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1024,  # dense MLP size; unused here, every layer is MoE
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    num_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=1024,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def build_checkpoint(folder: Path) -> tuple[int, int]:
    """Save a float32 Qwen2-MoE checkpoint (one safetensors file) to folder; returns (params, bytes)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    torch.manual_seed(SEED)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**CONFIG)).float()
    perturb(model, SEED)
    model.save_pretrained(folder, max_shard_size="100GB")
    n_params = sum(p.numel() for p in model.parameters())
    files = list(folder.glob("*.safetensors"))
    assert len(files) == 1, f"expected one safetensors file, got {files}"
    return n_params, files[0].stat().st_size


def median_seconds(fns: dict[str, Callable[[], object]], runs: int, warmup: int) -> dict[str, float]:
    """Median wall time of each fn; runs are interleaved round-robin so background load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        for _ in range(runs):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU-seconds of the whole machine, CPU-seconds of this process) since boot / start (Linux)."""
    ticks = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), usage.ru_utime + usage.ru_stime


def load_moelens(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    import moelens

    return moelens.HookedTransformer.from_pretrained(str(folder), dtype=dtype, progress=False)


def load_transformers(folder: Path, dtype: torch.dtype, attn: str | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn} if attn else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval()


def with_backend(model: torch.nn.Module, backend: str, tokens: torch.Tensor) -> torch.Tensor:
    default = model.blocks[0].attn.backend
    model.set_attention_backend(backend)
    try:
        return model(tokens)
    finally:
        model.set_attention_backend(default)


def time_forwards(
    folder: Path, tokens: torch.Tensor, runs: int, warmup: int
) -> tuple[dict[str, float], list[str], str]:
    """Median seconds keyed '<what> <dtype>', notes, and the moelens attention backend that is not the default."""
    times: dict[str, float] = {}
    notes: list[str] = []
    alt = ""
    for dtype, tag in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        ours = load_moelens(folder, dtype)
        ref, ref_eager = load_transformers(folder, dtype), load_transformers(folder, dtype, "eager")
        default = ours.blocks[0].attn.backend
        alt = "fused" if default == "eager" else "eager"  # the other attention backend, for information
        fns: dict[str, Callable[[], object]] = {
            "moelens": lambda: ours(tokens),
            "cache": lambda: ours.run_with_cache(tokens),
            "moelens-alt": lambda: with_backend(ours, alt, tokens),
            "hf": lambda: ref(tokens).logits,
            "hf-eager": lambda: ref_eager(tokens).logits,
        }
        times |= {f"{name} {tag}": t for name, t in median_seconds(fns, runs, warmup).items()}
        # The same two, alternating with nothing else: what a loop of run_with_cache calls sees. Interleaved
        # with the other models, each cached run first has to fault in fresh pages for its ~0.5 GB of kept
        # activations (the allocator gave the last model's memory back to the OS).
        pair = median_seconds({"moelens": fns["moelens"], "cache": fns["cache"]}, runs, warmup)
        times |= {f"{name}-pair {tag}": t for name, t in pair.items()}
        config = ref.config
        notes.append(
            f"transformers default ({tag}): attention {getattr(config, '_attn_implementation', '?')}, "
            f"experts {getattr(config, '_experts_implementation', '?')}; moelens default attention {default!r}"
        )
        with torch.no_grad():
            logits = ours(tokens).float()
            for key, model in (("hf", ref), ("hf-eager", ref_eager)):
                diff = (model(tokens).logits.float() - logits).abs().max().item()
                notes.append(f"max |logits diff| moelens vs transformers ({key}, {tag}): {diff:.3g}")
        del ours, ref, ref_eager, fns
    return times, notes, alt


# VmHWM is the peak resident set of this process's own address space. ru_maxrss would be the same number in
# a process started from a small parent, but Linux carries the parent's peak into a child's ru_maxrss across
# fork + exec, and this parent holds several models by then; so the child reports both and VmHWM is used.
RSS_SCRIPT = """
import resource, sys, torch
{imports}
def status(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field + ":")).split()[1])
before = status("VmHWM"), status("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = {load}
after = status("VmHWM"), status("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(*before, *after)
"""
RSS_LIBS = {
    "moelens": (
        "import moelens",
        "moelens.HookedTransformer.from_pretrained(sys.argv[1], dtype=torch.float32, progress=False)",
    ),
    "transformers": (
        "from transformers import AutoModelForCausalLM\nimport transformers.models.qwen2_moe.modeling_qwen2_moe",
        "AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)",
    ),
}
# moelens builds its model under torch.device("meta"); nn.Embedding's init there goes through torch._refs,
# which imports torch._dynamo (and sympy, ...) once per process: a fixed cost, shown apart.
LAZY_IMPORTS = "import torch._dynamo"


def load_rss(lib: str, folder: Path, preimport: str = "") -> tuple[int, int]:
    """(peak growth, resident growth) in bytes of from_pretrained in a fresh process, imports excluded."""
    imports, load = RSS_LIBS[lib]
    code = RSS_SCRIPT.format(imports=imports + "\n" + preimport, load=load)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-c", code, str(folder)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    hwm0, rss0, _, hwm1, rss1, _ = (int(x) for x in out.stdout.split()[-6:])
    return (hwm1 - hwm0) * 1024, (rss1 - rss0) * 1024


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 timed runs and 1 warmup instead of 5 and 2")
    parser.add_argument("--out", type=Path, help="checkpoint folder (default: a temporary directory)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's default)")
    args = parser.parse_args()
    runs, warmup = (2, 1) if args.quick else (5, 2)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = f"{torch.get_num_threads()} ({'--threads' if args.threads else 'torch default'})"

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.out or Path(tmp) / "qwen2_moe_bench"
        n_params, n_bytes = build_checkpoint(folder)
        print(f"checkpoint: {folder}: {n_params:,} parameters, {n_bytes:,} bytes (float32, one file)")
        tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, POS), generator=torch.Generator().manual_seed(SEED))
        (busy0, own0), start = cpu_seconds(), time.perf_counter()
        times, notes, alt = time_forwards(folder, tokens, runs, warmup)
        (busy1, own1), elapsed = cpu_seconds(), time.perf_counter() - start
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (elapsed * (os.cpu_count() or 1))
        rss = {lib: load_rss(lib, folder) for lib in RSS_LIBS}
        rss_warm = {lib: load_rss(lib, folder, LAZY_IMPORTS) for lib in RSS_LIBS}

    rows: list[tuple[str, str, str, str, str]] = []
    for tag in ("float32", "bfloat16"):
        ours = times[f"moelens {tag}"]
        for key, ref_name in (("hf", "transformers (default)"), ("hf-eager", "transformers (eager attn)")):
            ref = times[f"{key} {tag}"]
            rows.append((f"forward {tag}, vs {ref_name}", fmt_s(ours), fmt_s(ref), f"{ours / ref:.2f}x", "-"))
    for tag in ("float32", "bfloat16"):
        plain, cached = times[f"moelens {tag}"], times[f"cache {tag}"]
        ratio = f"{cached / plain:.2f}x"
        rows.append((f"run_with_cache {tag}, vs moelens forward", fmt_s(cached), fmt_s(plain), ratio, "<= 1.3x"))
        plain, cached = times[f"moelens-pair {tag}"], times[f"cache-pair {tag}"]
        rows.append(("(info) the same, the two alternating alone", fmt_s(cached), fmt_s(plain), f"{cached / plain:.2f}x", "-"))
    for tag in ("float32", "bfloat16"):
        ours, ref = times[f"moelens-alt {tag}"], times[f"hf {tag}"]
        name = f"(info) forward {tag}, moelens attention={alt!r} vs transformers (default)"
        rows.append((name, fmt_s(ours), fmt_s(ref), f"{ours / ref:.2f}x", "-"))
    for name, (ours, ref), target in (
        ("load peak RSS / checkpoint bytes", (rss["moelens"][0], rss["transformers"][0]), "moelens < 1.2x"),
        (f"(info) the same, `{LAZY_IMPORTS}` before the baseline", (rss_warm["moelens"][0], rss_warm["transformers"][0]), "-"),
        ("(info) resident after load / checkpoint bytes", (rss["moelens"][1], rss["transformers"][1]), "-"),
    ):
        rows.append((name, f"{ours / n_bytes:.2f}x", f"{ref / n_bytes:.2f}x", f"{ours / ref:.2f}x", target))

    import transformers

    print()
    print(
        f"Qwen2-MoE {n_params / 1e6:.0f}M params (hidden 512, 8 layers, 16 experts top-4, 1 shared expert), "
        f"batch {BATCH} x {POS} tokens, CPU. {datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch threads {threads}, median of {runs} interleaved runs after {warmup} warmup; "
        f"other processes used {others:.0%} of the CPUs while timing."
    )
    print()
    print("| measurement | moelens | reference | ratio | target |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()
    for note in notes:
        print(f"- {note}")
    if others > 0.1:
        print(f"- WARNING: other processes used {others:.0%} of the CPUs while timing: the timings are noisy")


if __name__ == "__main__":
    main()
