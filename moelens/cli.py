"""The `moelens` command: `inspect` a model's routing of a prompt, `verify` it against transformers."""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _load(model: str | None, dtype: str):
    """A checkpoint folder, Hub id or embedded default name -> (model, where it came from)."""
    from moelens import HookedTransformer
    from moelens.defaults import DEFAULT

    path = model or DEFAULT
    return HookedTransformer.from_pretrained(path, dtype=DTYPES[dtype]), path


def inspect(args: argparse.Namespace) -> int:
    from moelens.analysis import routing_table

    model, path = _load(args.model, args.dtype)
    print(f"{type(model).__name__} from {path} ({model.cfg.n_layers} layers, {model.cfg.n_experts} experts)")
    if model.tokenizer is None:
        tokens = torch.tensor([[int(t) for t in args.prompt.split()]])
    else:
        tokens = model.to_tokens(args.prompt)
    table = routing_table(model, tokens, top_next=args.top)
    print(table)
    if args.plot:
        from moelens.analysis import plot_routing

        try:
            plot_routing(table, args.plot, n_experts=model.cfg.n_experts)
        except ImportError as err:
            print(err, file=sys.stderr)
            return 2
        print(f"routing plot written to {args.plot}")
    return 0


def verify(args: argparse.Namespace) -> int:
    from moelens.verify import ReferenceUnavailable
    from moelens.verify import verify as run_verify

    try:
        import transformers  # noqa: F401
    except ImportError:
        print("moelens verify needs transformers: pip install 'moelens[test]'", file=sys.stderr)
        return 2
    status = 0
    for name in ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]:
        try:
            report = run_verify(args.model, DTYPES[name], seq_len=args.seq_len)
        except ReferenceUnavailable as err:
            print(err, file=sys.stderr)
            return 2
        print(report)
        ok = report.index_mismatches == 0 and (report.worst() <= 1e-5 if name == "float32" else True)
        print(f"{name}: {'OK' if ok else 'MISMATCH'}\n")
        status |= 0 if ok else 1
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moelens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="per layer, the experts each token is routed to, and the next tokens")
    p.add_argument(
        "model", nargs="?", help="Hub id, local folder, or an embedded default: tiny-qwen2-moe (the default), "
        "tiny-hunyuan-moe, tiny-solar-open"
    )
    p.add_argument("--prompt", default="The quick brown fox", help="text (or space-separated ids without tokenizer)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--top", type=int, default=5, help="how many next tokens to show")
    p.add_argument("--plot", metavar="OUT.png", help="also write the routing plot [token x layer] (needs moelens[plot])")
    p.set_defaults(run=inspect)
    p = sub.add_parser("verify", help="max logit and per-site differences against transformers")
    p.add_argument("model", help="Hub id, local folder or embedded default name")
    p.add_argument("--dtype", choices=[*DTYPES, "both"], default="both")
    p.add_argument("--seq-len", type=int, default=24)
    p.set_defaults(run=verify)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
