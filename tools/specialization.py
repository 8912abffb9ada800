"""Do tiny-code-moe's experts specialize? Trace the held-out part of the standard library with the trained
model and with the same architecture at its random initialisation (same tokenizer), and compare.

    python tools/specialization.py --out traces/specialization [--report report.html]

Prints, per mixture layer, the mutual information between expert choice and token class (whitespace,
punctuation, digits, word, other) for both models, and the rate at which consecutive tokens keep their first
expert, against chance. With --report, also writes the trained model's trace report (its plots go in README).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sysconfig
from pathlib import Path

import torch
from train_tiny_moe import new_model, record_path  # the training script's own initialisation: the untrained twin

import moelens
from moelens import defaults
from moelens.traces import trace, trace_consecutive, trace_report, trace_selectivity

NAME = "tiny-code-moe"


def held_out_files() -> list[Path]:
    """The record's held-out standard-library files that this interpreter has byte for byte."""
    record = json.loads(record_path(defaults.trained_checkpoint(NAME)).read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for rel, digest in sorted(record["data"]["held_out_python"].items()):
        path = root / rel
        if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == digest:
            files.append(path)
    if not files:
        raise SystemExit(f"none of the held-out files of Python {record['python']} is on this interpreter")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the two traces (replaced)")
    parser.add_argument("--report", type=Path, help="also write the trained model's trace report here")
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(2)
    files = held_out_files()
    trained = moelens.HookedTransformer.from_pretrained(NAME, progress=False)
    untrained = new_model(seed=0)
    untrained.set_tokenizer(trained.tokenizer)
    untrained.eval()
    results = {}
    for label, model in (("trained", trained), ("random init", untrained)):
        out = args.out / label.replace(" ", "-")
        shutil.rmtree(out, ignore_errors=True)
        trace(model, files, out, seq_len=args.seq_len, batch_size=8, model_name=label, progress=False)
        results[label] = (trace_selectivity(out, "builtin", decode=trained.tokenizer), trace_consecutive(out))
    n_bytes = sum(f.stat().st_size for f in files)
    print(f"{len(files)} held-out standard-library files ({n_bytes:,} bytes), windows of {args.seq_len} tokens")
    print("layer | I(expert; class) trained | random init | same first expert, consecutive tokens: trained | random init | chance (trained)")
    sel_t, con_t = results["trained"]
    sel_r, con_r = results["random init"]
    for i, layer in enumerate(sel_t.layers):
        print(
            f"{layer} | {float(sel_t.mutual_information[i]):.3f} nats ({float(sel_t.normalized[i]):.1%} of H) | "
            f"{float(sel_r.mutual_information[i]):.3f} nats ({float(sel_r.normalized[i]):.1%}) | "
            f"{float(con_t.same_top1[0, i]):.1%} | {float(con_r.same_top1[0, i]):.1%} | {float(con_t.chance_top1[0, i]):.1%}"
        )
    for i, layer in enumerate(sel_t.layers):
        tops = [f"E{e}: " + ", ".join(f"{c.name} x{c.lift:.1f}" for c in shares[:2]) for e, shares in enumerate(sel_t.top_classes[i])]
        print(f"layer {layer} (trained), each expert's two most frequent classes with lift: " + "; ".join(tops))
    if args.report:
        print(f"report: {trace_report(args.out / 'trained', args.report, decode=trained.tokenizer)}")


if __name__ == "__main__":
    main()
