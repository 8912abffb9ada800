"""The `moelens` command: `inspect` a model's routing of a prompt, `verify` it against transformers."""

from __future__ import annotations

import argparse
import sys

import torch

from moelens.loaders.errors import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# What bad input raises in moelens (a CheckpointError is also a ValueError; OSError: a path that is not there):
# reported in one line. Anything else is a bug in moelens and keeps its traceback.
USER_ERRORS = (CheckpointError, ValueError, KeyError, TypeError, OSError)


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """Usage errors in one line, like every other user error."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


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
        try:
            tokens = torch.tensor([[int(t) for t in args.prompt.split()]], dtype=torch.long)
        except ValueError:
            raise ValueError(
                f"{path} has no tokenizer (no tokenizer.json): --prompt must be space-separated token ids, "
                f"got {args.prompt!r}"
            ) from None
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
    parser = Parser(prog="moelens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="per layer, the experts each token is routed to, and the next tokens")
    p.add_argument(
        "model", nargs="?", help="Hub id, local folder, or an embedded default: tiny-qwen2-moe (the default), "
        "tiny-hunyuan-moe, tiny-solar-open"
    )
    p.add_argument("--prompt", default="The quick brown fox", help="text (or space-separated ids without tokenizer)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--top", type=positive_int, default=5, help="how many next tokens to show")
    p.add_argument("--plot", metavar="OUT.png", help="also write the routing plot [token x layer] (needs moelens[plot])")
    p.set_defaults(run=inspect)
    p = sub.add_parser("verify", help="max logit and per-site differences against transformers")
    p.add_argument("model", help="Hub id, local folder or embedded default name")
    p.add_argument("--dtype", choices=[*DTYPES, "both"], default="both")
    p.add_argument("--seq-len", type=positive_int, default=24)
    p.set_defaults(run=verify)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except USER_ERRORS as err:
        # a KeyError's str() is the repr of its message
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"moelens: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
