"""The `moelens` command: `inspect` a model's routing of a prompt, `verify` it against transformers, `plan` the
memory and placement a model needs from its config alone, `trace` the routing of a whole corpus to Parquet,
and `trace-report` a trace as a page a person can open."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moelens import defaults
from moelens.analysis import plot_routing, routing_table
from moelens.extras import MissingExtra, require
from moelens.loaders import read_config
from moelens.loaders.errors import CheckpointError
from moelens.locate import resolve
from moelens.models import HookedTransformer
from moelens.plan import parse_size, plan as make_plan, to_json_text
from moelens.tokenizer import MoeTokenizer
from moelens.traces import Trace, trace_report as write_report_of
from moelens.verify import ReferenceUnavailable, verify as run_verify

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# What bad input raises in moelens (a CheckpointError is also a ValueError; OSError: a path that is not there):
# reported in one line. Anything else is a bug in moelens and keeps its traceback.
# A missing optional dependency (MissingExtra) is one line too.
USER_ERRORS = (CheckpointError, ValueError, KeyError, TypeError, OSError, MissingExtra)


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (as ArgumentDefaultsHelpFormatter), except where the help
    already says it in words, or there is none to show (a flag, an option that is off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
            return text
        return f"{text} (default: %(default)s)".lstrip()


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)  # the subcommands' parsers too
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        """Usage errors in one line, like every other user error."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, except that an unknown option is reported by the subcommand it was given to, with the
        closest of that subcommand's options (argparse leaves them to the top-level parser, which knows none)."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            parser = getattr(self, "subcommands", {}).get(getattr(parsed, "command", None), self)
            options = [o for action in parser._actions for o in action.option_strings]
            shown = []
            for arg in unknown:
                close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1) if arg.startswith("-") else []
                shown.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
            parser.error(f"unrecognized arguments: {' '.join(shown)}")
        return parsed


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def size(text: str) -> int:
    """A memory size: 141GB (1e9 bytes), 80GiB (2**30 bytes), 256G."""
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _load(model: str | None, dtype: str):
    """A checkpoint folder, Hub id or embedded default name -> (model, where it came from)."""
    path = model or defaults.DEFAULT
    return HookedTransformer.from_pretrained(path, dtype=DTYPES[dtype]), path


def set_threads(args: argparse.Namespace) -> None:
    """--threads: torch's intra-op threads for this command (its default is one per core, which on a machine
    whose cores are busy with other work makes each forward wait for the slowest)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)


def inspect(args: argparse.Namespace) -> int:
    if args.plot:  # before any work: a missing matplotlib is found now, not after the forward
        require("moelens inspect --plot", "matplotlib")
    set_threads(args)
    model, path = _load(args.model, args.dtype)
    cfg = model.cfg
    top_k = "/".join(str(k) for k in sorted({cfg.top_k_per_layer[i] for i in cfg.moe_layer_indices}))
    # say whether the routing shown means anything: the per-family tiny defaults have seeded random weights
    if str(path) in defaults.TRAINED:
        weights = "trained weights (embedded default; see MODEL_CARD.md in its folder)"
    elif defaults.is_random(str(path)):
        weights = "random weights (embedded default; its routing means nothing)"
    else:
        weights = "checkpoint weights"
    print(
        f"{type(model).__name__} from {path}: {weights}, {sum(p.numel() for p in model.parameters()):,} parameters "
        f"in all (embeddings included; cfg.n_params, TransformerLens's count without embeddings, norms and biases: "
        f"{cfg.n_params:,}), {cfg.n_layers} layers, {cfg.n_experts} experts, top-{top_k}"
    )
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
        plot_routing(table, args.plot, n_experts=model.cfg.n_experts)
        print(f"routing plot written to {args.plot}")
    return 0


def verify(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("moelens verify needs transformers: pip install transformers (or, in moelens's checkout, "
              "pip install '.[test]')", file=sys.stderr)
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


def plan(args: argparse.Namespace) -> int:
    result = make_plan(
        args.model, dtype=args.dtype, devices=args.devices, gpus=args.gpus, gpu_memory=args.gpu_memory,
        cpu_memory=args.cpu_memory, batch=args.batch, seq=args.seq, revision=args.revision,
        expert_storage=args.expert_storage, fp8_scale_dtype=args.fp8_scale_dtype,
    )
    print(to_json_text(result) if args.json else result)
    return 0


def trace(args: argparse.Namespace) -> int:
    require("moelens trace", "pyarrow")
    # the trace extra (pyarrow): imported only when a trace is asked for, so the other commands run without it
    from moelens.traces.run import trace as run_trace

    set_threads(args)

    path = args.model or defaults.DEFAULT
    placement = {"dtype": DTYPES[args.dtype], "device": args.device}
    if args.data_parallel:  # this rank's replica, placed here; the trace deals the parts to the replicas
        placement = {"model_name": path, "ranks_per_replica": args.ranks_per_replica}
        path = replica_model(path, DTYPES[args.dtype], args.device, args.replica, args.devices_per_replica, args.ranks_per_replica)
    elif args.replica != "device" or args.devices_per_replica != 1 or args.ranks_per_replica != 1:
        raise ValueError("--replica, --devices-per-replica and --ranks-per-replica place the replicas of --data-parallel: add --data-parallel")
    summary = run_trace(  # loads the model itself, once the arguments and the device are checked
        path, [Path(p) for p in args.data], args.out, seq_len=args.seq_len, batch_size=args.batch_size,
        max_tokens=args.max_tokens, router_logits=args.router_logits, windows_per_part=args.windows_per_part,
        command=args.argv, progress=args.progress, data_parallel=args.data_parallel, **placement,
    )
    if args.data_parallel and dist.is_initialized():
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0  # rank 0 says what the trace did
    if summary.left_out:
        reasons: dict[str, list[str]] = {}
        for item in summary.left_out:
            reasons.setdefault(item.reason, []).append(item.path)
        for reason, paths in reasons.items():
            shown = ", ".join(paths[:5]) + (", ..." if len(paths) > 5 else "")
            print(f"left out {len(paths)} of the given folders' entries ({reason}): {shown}")
    if summary.already_complete:
        if not args.progress:  # with progress on, the trace said so itself
            print(f"{summary.out}: trace already complete ({summary.n_tokens} tokens, {summary.n_rows} rows)")
    else:
        print(
            f"traced {summary.n_tokens} tokens ({summary.n_rows} rows) into {summary.out}: {summary.parts_written} "
            f"parts written, {summary.parts_reused} kept from an earlier run"
        )
    return 0


def replica_model(path: str, dtype: torch.dtype, device: str, replica: str, per_replica: int, ranks: int) -> HookedTransformer:
    """This torchrun rank's replica of the model for a data-parallel trace: on one device (cuda: the rank's
    LOCAL_RANK-th GPU; cpu); with replica "device-map", over per_replica GPUs of its own (GPUs
    LOCAL_RANK * per_replica onwards), filled in order ("auto" device map); with "expert-parallel", its
    experts sharded over its group of `ranks` consecutive ranks, each on its own device as for "device".
    Joins torchrun's process group."""
    from moelens.traces.run import check_device  # the trace extra (pyarrow), as in trace()

    kind = torch.device(device).type
    if (replica == "expert-parallel") != (ranks != 1):
        raise ValueError(f"--ranks-per-replica {ranks} goes with --replica expert-parallel (and it with more than one rank)")
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(f"--data-parallel runs one process per replica under torchrun ({', '.join(missing)} not set): "
                             "torchrun --nproc_per_node N -m moelens trace ... --data-parallel")
        if replica == "expert-parallel" and kind == "cuda":  # the experts' exchanges run on the GPUs
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:  # the trace's own exchanges are a few Python objects, over gloo whatever the devices
            dist.init_process_group("gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if replica == "expert-parallel":
        placed = f"cuda:{local}" if kind == "cuda" else device
        check_device(placed)
        return HookedTransformer.from_pretrained(path, dtype=dtype, device=placed, expert_parallel=ranks, progress=False)
    if replica == "device":
        if per_replica != 1:
            raise ValueError(f"--devices-per-replica {per_replica} goes with --replica device-map (one device per replica here)")
        if kind == "cuda" and torch.device(device).index is not None and dist.get_world_size() > 1:
            raise ValueError(f"--device {device} with --data-parallel: give --device cuda, and rank r of a node takes cuda:LOCAL_RANK")
        placed = f"cuda:{local}" if kind == "cuda" else device
        check_device(placed)
        return HookedTransformer.from_pretrained(path, dtype=dtype, device=placed, progress=False)
    if kind != "cuda" or torch.device(device).index is not None:
        raise ValueError(f"--replica device-map spreads each replica over GPUs of its own: give --device cuda, got {device}")
    gpus = [f"cuda:{local * per_replica + i}" for i in range(per_replica)]
    for gpu in gpus:
        check_device(gpu)
    memory = {gpu: int(0.9 * torch.cuda.get_device_properties(gpu).total_memory) for gpu in gpus}
    return HookedTransformer.from_pretrained(path, dtype=dtype, device_map="auto", max_memory=memory, progress=False)


def trace_report(args: argparse.Namespace) -> int:
    require("moelens trace-report", "pyarrow", "duckdb", "matplotlib")
    trace = Trace(args.trace)  # pyarrow, duckdb (the trace extra) and matplotlib are imported when used
    name = args.model or trace.manifest["model"]["name"]
    tokenizer = _tokenizer(name)
    if tokenizer is None:
        print(f"no tokenizer for {name}: the report leaves out selectivity by token class (pass --model)", file=sys.stderr)
    written = write_report_of(trace, args.out, decode=tokenizer, by=args.by, top=args.top)
    print(f"report written to {written}")
    return 0


def _tokenizer(name: str):
    """The tokenizer of an embedded default or a local checkpoint folder, without loading weights; None for a
    name that is neither (a Hub id would mean a download: pass a local folder with --model instead)."""
    if name not in defaults.NAMES and not Path(name).is_dir():
        return None
    folder = resolve(name)
    return MoeTokenizer.from_folder(folder, read_config(folder))


def build_parser() -> Parser:
    parser = Parser(prog="moelens", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    parser.subcommands = sub.choices  # name -> its parser, for parse_args's suggestions
    p = sub.add_parser("inspect", help="per layer, the experts each token is routed to, and the next tokens")
    p.add_argument(
        "model", nargs="?", help=f"Hub id, local folder, or an embedded default: {defaults.DEFAULT} (the default, "
        "trained), or one with random weights per family: " + ", ".join(defaults.CONFIGS)
    )
    p.add_argument("--prompt", default="The quick brown fox", help="text (or space-separated ids without tokenizer)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the weights and the forward")
    p.add_argument("--top", type=positive_int, default=5, help="how many next tokens to show")
    p.add_argument("--threads", type=positive_int, help="torch threads for the forward (default: torch's, one per "
                   "core; on a machine whose cores other work keeps busy, 1 is often several times faster)")
    p.add_argument("--plot", metavar="OUT.png", help="also write the routing plot [token x layer] (needs the plot extra; default: no plot)")
    p.set_defaults(run=inspect)
    p = sub.add_parser("verify", help="max logit and per-site differences against transformers")
    p.add_argument("model", help="Hub id, local folder or embedded default name")
    p.add_argument("--dtype", choices=[*DTYPES, "both"], default="both", help="compare in this dtype, or in each")
    p.add_argument("--seq-len", type=positive_int, default=24, help="tokens of the random input both models run")
    p.set_defaults(run=verify)
    p = sub.add_parser(
        "plan", help="parameters, memory and a placement that fits, from config.json alone (no weights downloaded)"
    )
    p.add_argument("model", help="Hub id (only config.json is fetched), local folder, config.json or default name")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16", help="dtype of the weights")
    gpus = p.add_mutually_exclusive_group()
    gpus.add_argument("--devices", help="comma-separated devices, e.g. cuda:0,cuda:1 (memory from torch.cuda, "
                      "else --gpu-memory; default: cuda:0 .. cuda:N-1 for --gpus N)")
    gpus.add_argument("--gpus", type=positive_int, help="plan for N GPUs of --gpu-memory each (default: one GPU "
                      "when only --gpu-memory is given; no GPU option at all: the CPU only)")
    p.add_argument("--gpu-memory", type=size, help="memory of each GPU: 141GB (1e9 bytes), 80GiB (2**30 bytes); "
                   "alone: one GPU (default: each --devices GPU's own, from torch.cuda)")
    p.add_argument("--cpu-memory", type=size, help="CPU memory (default: this machine's)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences per forward (activations, KV cache)")
    p.add_argument("--seq", type=positive_int, default=2048, help="tokens per sequence (activations, KV cache)")
    p.add_argument("--revision", help="Hub revision of config.json (default: the repo's default branch)")
    p.add_argument("--expert-storage", choices=["dequantized", "stored"], default="dequantized",
                   help="a quantized checkpoint (both are shown): the placement to recommend with every weight "
                   "dequantized to --dtype at load, or with the routed experts kept as stored (fp8, mxfp4)")
    p.add_argument("--fp8-scale-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="what a block fp8 checkpoint stores its scales in (config.json does not say)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    p.set_defaults(run=plan)
    p = sub.add_parser(
        "trace", help="routing of every token of a corpus into Parquet (resumable; query with DuckDB or moelens.traces)"
    )
    p.add_argument("model", nargs="?", help=f"Hub id, local folder or embedded default name (default: {defaults.DEFAULT})")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH", help="text files (one document each), .jsonl "
                   "files (one document per line, its 'text' field), or folders of them (recursively, sorted)")
    p.add_argument("--out", required=True, metavar="DIR", help="trace folder: created, or resumed if it holds a partial trace")
    p.add_argument("--seq-len", type=positive_int, default=1024, help="tokens per window (each window is one forward)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="windows per forward")
    p.add_argument("--max-tokens", type=positive_int, help="stop after exactly this many tokens (default: the whole corpus)")
    p.add_argument("--router-logits", action="store_true", help="also store each token's router logits [n_experts]")
    p.add_argument("--windows-per-part", type=positive_int, help="windows per Parquet part (default: 2**17 tokens' worth)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the weights and the forward")
    p.add_argument("--threads", type=positive_int, help="torch threads for the forward (default: torch's, one per "
                   "core; on a machine whose cores other work keeps busy, 1 is often several times faster)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--data-parallel", action="store_true", help="under torchrun: every process a replica of the model, "
                   "each tracing its share of the parts; one manifest (rows equal to one process's)")
    p.add_argument("--replica", choices=["device", "device-map", "expert-parallel"], default="device", help="with "
                   "--data-parallel, what one replica is: one device (cuda: the process's LOCAL_RANK-th GPU), "
                   "--devices-per-replica GPUs of its own, or --ranks-per-replica processes sharding its experts")
    p.add_argument("--devices-per-replica", type=positive_int, default=1, help="GPUs of each replica with --replica device-map")
    p.add_argument("--ranks-per-replica", type=positive_int, default=1, help="processes of each replica with --replica expert-parallel")
    p.set_defaults(run=trace)
    p = sub.add_parser("trace-report", help="an HTML report (or PNGs) of a trace: load, subsets, selectivity, top tokens")
    p.add_argument("trace", help="a trace folder written by moelens trace")
    p.add_argument("--out", required=True, help="report.html (plots in report_files/ beside it), or a folder for PNGs")
    p.add_argument("--model", help="checkpoint folder or embedded default whose tokenizer decodes the tokens "
                   "(default: the model recorded in the trace, when it is local)")
    p.add_argument("--by", choices=["folder", "file"], default="folder", help="corpus subsets for the load heat map")
    p.add_argument("--top", type=positive_int, default=5, help="top tokens shown per expert")
    p.set_defaults(run=trace_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = ["moelens", *(sys.argv[1:] if argv is None else argv)]
    try:
        return args.run(args)
    except USER_ERRORS as err:
        # a KeyError's str() is the repr of its message
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"moelens: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
