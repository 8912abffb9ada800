"""Compile the expert kernels for an NVIDIA GPU on any machine, and read what only compilation shows.

The triton wheel carries its whole compiler and NVIDIA's ptxas, so a machine without a GPU can take every
kernel through the real pipeline (TTIR -> PTX -> cubin) for sm_80 or sm_90 and report what the interpreter
cannot: that it compiles, its shared memory against the GPU's limit (a launch over the limit fails with
OutOfResources), registers and spills, and which instructions tl.dot became (wgmma / mma.sync and their
input type: bf16, tf32, or none at all for IEEE float32).

Launches are recorded from the real wrappers, run on meta tensors of the real shapes with the kernels
swapped for recorders, so argument types, strides, constexprs and warps are what a GPU launch would use;
integers and pointers are specialised as Triton's launcher does (1 -> constexpr, multiples of 16 ->
divisibility hints). Needs TRITON_INTERPRET unset: interpreted kernels cannot be compiled.

    python -m moelens.kernels.aot --gpu sm_90 sm_80 --dtype bfloat16 float32 [--shape E,k,H,I] [--storage fp8|mxfp4]
        [--bias] [--clamped-swiglu] [--json]

--storage fp8 records the launches for experts kept stored as fp8 (per-expert gate / up / down codes with
float32 scales per --fp8-block, default 128 x 128), which the GEMM kernels dequantize in their tiles; --storage
mxfp4 for experts stored as gpt-oss publishes them (interleaved gate / up rows, E8M0 scales per 32 columns).
--bias and --clamped-swiglu: experts with biases and gpt-oss's activation.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from moelens.experts.spec import ClampedSwiGLU, ExpertTensors, GatedActivation
from moelens.hooks import HookPoint
from moelens.kernels import triton_experts
from moelens.kernels.experts import ExpertHooks
from moelens.kernels.stored_operands import StoredOperand, StoredOperands
from moelens.kernels.tiles import Tile, active_table
from moelens.kernels.triton_experts import SILU_GLU

KERNEL_NAMES = ("_gate_up_kernel", "_down_kernel", "_silu_mul_kernel", "_combine_kernel")


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: int
    shared_limit: int  # bytes of shared memory one block may ask for (the opt-in maximum)

    @property
    def arch(self) -> str:
        return f"sm_{self.capability}{'a' if self.capability >= 90 else ''}"  # wgmma needs sm_90a


GPUS = {
    "sm_90": Gpu("sm_90", 90, 232_448),  # H100 / H200: 227 KiB
    "sm_80": Gpu("sm_80", 80, 166_912),  # A100: 163 KiB
}


@dataclass(frozen=True)
class Launch:
    kernel: JITFunction
    args: dict[str, object]  # every kernel parameter, by name
    options: dict[str, int]  # num_warps, num_stages


@dataclass(frozen=True)
class KernelReport:
    kernel: str
    constexprs: dict[str, object]
    num_warps: int
    num_stages: int
    shared: int  # bytes
    registers: int
    spill_bytes: int  # stores + loads
    dot: str  # e.g. "wgmma.bf16", "mma.tf32", "fma" (IEEE float32: no tensor cores), "none" (no tl.dot)

    @property
    def label(self) -> str:
        tile = "x".join(str(self.constexprs[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if k in self.constexprs)
        pre = " pre" if self.constexprs.get("WRITE_PRE") else ""
        fmt = " fp8" if self.constexprs.get("W_FP8") else " mxfp4" if self.constexprs.get("W_MXFP4") else ""
        fmt += " bias" if self.constexprs.get("HAS_BIAS") else ""
        fmt += " clamped" if self.constexprs.get("ACTIVATION") == triton_experts.ACT_CLAMPED_SWIGLU else ""
        return f"{self.kernel.strip('_').removesuffix('_kernel')}{fmt}{pre} {tile}".strip()


class _Recorder:
    """Stands in for a kernel: `kernel[grid](...)` records the launch instead of running it."""

    def __init__(self, kernel: JITFunction, log: list[Launch]):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = self.kernel.arg_names
            defaults = {p.name: p.default for p in self.kernel.params if p.has_default}
            bound = defaults | dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
            options = {k: v for k, v in kwargs.items() if k not in names}
            self.log.append(Launch(self.kernel, bound, options))

        return launch


def stored_fp8_meta(n_experts: int, d_model: int, d_expert: int, block: tuple[int, int]) -> StoredOperands:
    """Meta fp8 operands as per-expert checkpoints hold them (gate, up and down codes, each with float32 scales
    per block, partial last blocks where the block does not divide)."""
    E, H, I = n_experts, d_model, d_expert

    def operand(rows: int, cols: int) -> StoredOperand:
        grid = (E, -(-rows // block[0]), -(-cols // block[1]))
        codes = torch.empty(E, rows, cols, dtype=torch.uint8, device="meta")
        return StoredOperand("fp8", codes, torch.empty(grid, device="meta"), block, 0, rows)

    return StoredOperands(operand(I, H), operand(I, H), operand(H, I), None)


def stored_mxfp4_meta(n_experts: int, d_model: int, d_expert: int, dtype: torch.dtype, bias: bool) -> StoredOperands:
    """Meta MXFP4 operands as gpt-oss publishes them: gate and up rows interleaved in one stack, down as stored,
    two e2m1 codes per byte and one E8M0 byte per 32 columns; biases (dense, the model's dtype) if asked."""
    E, H, I = n_experts, d_model, d_expert
    if H % 32 or I % 32:
        raise ValueError(f"mxfp4 packs 32 columns per scale: d_model {H} and d_expert {I} must be multiples of 32")

    def stack(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty(E, rows, cols // 2, dtype=torch.uint8, device="meta"),
                torch.empty(E, rows, cols // 32, dtype=torch.uint8, device="meta"))

    gate_up, down = stack(2 * I, H), stack(H, I)
    biases = (torch.empty(E, 2 * I, dtype=dtype, device="meta"), torch.empty(E, H, dtype=dtype, device="meta")) if bias else (None, None)
    return StoredOperands(
        StoredOperand("mxfp4", *gate_up, (1, 32), 0, I, 2), StoredOperand("mxfp4", *gate_up, (1, 32), 1, I, 2),
        StoredOperand("mxfp4", *down, (1, 32), 0, H), None, *biases,
    )


def record_launches(
    n_tokens: int, n_experts: int, top_k: int, d_model: int, d_expert: int, dtype: torch.dtype,
    weight_dtype: torch.dtype | None = None, tile: Tile | None = None, hook_pre: bool = False,
    storage: str | None = None, fp8_block: tuple[int, int] = (128, 128), bias: bool = False, activation: GatedActivation = SILU_GLU,
) -> list[Launch]:
    """The kernel launches of one routed-experts forward at these shapes, without running any of them.
    storage "fp8" / "mxfp4": the experts kept stored so (stored_fp8_meta, stored_mxfp4_meta), dequantized in the
    kernels' tiles. bias: experts with b_gate_up and b_down; activation: the spec's."""
    kernels = {name: getattr(triton_experts, name) for name in KERNEL_NAMES}
    if not all(isinstance(k, JITFunction) for k in kernels.values()):
        raise RuntimeError("the kernels are interpreted (TRITON_INTERPRET=1): compile them in a process without it")
    meta = dict(device="meta", dtype=dtype)
    x = torch.empty(n_tokens, d_model, **meta)
    indices = torch.zeros(n_tokens, top_k, dtype=torch.int64, device="meta")
    weights = torch.empty(n_tokens, top_k, device="meta", dtype=weight_dtype or dtype)
    if storage not in (None, "fp8", "mxfp4"):
        raise ValueError(f"storage must be None, 'fp8' or 'mxfp4' (the kernels dequantize those in their tiles), got {storage!r}")
    if storage == "fp8" and bias:
        raise ValueError("the fp8 survey has no biases (no fp8 family has expert biases)")
    if storage == "fp8":
        experts = stored_fp8_meta(n_experts, d_model, d_expert, fp8_block)
    elif storage == "mxfp4":
        experts = stored_mxfp4_meta(n_experts, d_model, d_expert, dtype, bias)
    else:
        biases = (torch.empty(n_experts, 2 * d_expert, **meta), torch.empty(n_experts, d_model, **meta)) if bias else (None, None)
        experts = ExpertTensors(torch.empty(n_experts, 2 * d_expert, d_model, **meta), torch.empty(n_experts, d_model, d_expert, **meta), *biases)
    hooks = ExpertHooks(*(HookPoint() for _ in range(5)))
    if hook_pre:
        hooks.pre.add_hook(lambda t, hook: t)
    log: list[Launch] = []
    with mock.patch.multiple(triton_experts, **{name: _Recorder(k, log) for name, k in kernels.items()}):
        triton_experts.routed_experts_triton(x, indices, weights, experts, hooks, (1, n_tokens), tile, activation)
    return log


_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
                 torch.uint8: "u8"}


def _specialise(value) -> tuple[str, bool]:
    """(Triton signature type, divisible by 16) as Triton's launcher specialises an argument; meta tensors
    have no address and count as aligned, as fresh allocations are."""
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_TYPES[value.dtype], value.device.type == "meta" or value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "i1", False
    if isinstance(value, int):
        if value == 1:
            return "constexpr", False
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"cannot specialise a kernel argument of type {type(value).__name__}")


def _specialised(launch: Launch) -> tuple[dict[str, str], dict[str, object], dict[tuple[int], list]]:
    """(signature, constexprs, divisibility attrs) of a launch: what its binary is compiled from."""
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(launch.kernel.params):
        value = launch.args[param.name]
        kind, aligned = ("constexpr", False) if param.is_constexpr else _specialise(value)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = value
        elif aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_launch(launch: Launch, gpu: Gpu) -> triton.compiler.CompiledKernel:
    signature, constexprs, attrs = _specialised(launch)
    source = ASTSource(launch.kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", gpu.capability, 32), options=launch.options)


def _ptxas(gpu: Gpu) -> str:
    """The ptxas Triton itself uses for this GPU (its PTX version follows that ptxas)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(gpu.capability).path
    except ImportError:  # Triton before 3.4 ships one ptxas
        return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")


def resource_usage(ptx: str, gpu: Gpu) -> tuple[int, int]:
    """(registers per thread, spill bytes) as ptxas -v reports them."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        done = subprocess.run(
            [_ptxas(gpu), "-v", f"--gpu-name={gpu.arch}", str(src), "-o", str(src.with_suffix(".cubin"))],
            capture_output=True, text=True, check=True,
        )
    log = done.stdout + done.stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    if registers is None:
        raise RuntimeError(f"ptxas -v did not report registers:\n{log}")
    return int(registers.group(1)), sum(spills)


def dot_instructions(ptx: str) -> str:
    """Which instructions the tl.dot calls became, with the input type they multiply."""
    found = set()
    for op, types in re.findall(r"\b(wgmma\.mma_async|mma)\.sync\.aligned\.m\d+n\d+k\d+((?:\.\w+)+)", ptx):
        kind = "wgmma" if op.startswith("wgmma") else "mma"
        inputs = [t for t in types.split(".") if t in ("bf16", "f16", "tf32", "e4m3", "e5m2", "s8")]
        found.add(f"{kind}.{inputs[0] if inputs else '?'}")
    if found:
        return "+".join(sorted(found))
    return "fma" if re.search(r"\bfma\.rn\.f32\b", ptx) else "none"


def report(launch: Launch, gpu: Gpu) -> KernelReport:
    compiled = compile_launch(launch, gpu)
    registers, spills = resource_usage(compiled.asm["ptx"], gpu)
    constexprs = {p.name: launch.args[p.name] for p in launch.kernel.params if p.is_constexpr}
    return KernelReport(
        kernel=launch.kernel.__name__, constexprs=constexprs,
        num_warps=compiled.metadata.num_warps, num_stages=compiled.metadata.num_stages,
        shared=compiled.metadata.shared, registers=registers, spill_bytes=spills,
        dot=dot_instructions(compiled.asm["ptx"]) if "BLOCK_K" in constexprs else "none",
    )


def unique_launches(launches: list[Launch]) -> Iterator[Launch]:
    """One launch per binary: launches with the same kernel, options and specialisation compile alike."""
    seen = set()
    for launch in launches:
        signature, constexprs, attrs = _specialised(launch)
        key = (launch.kernel.__name__, *(tuple(sorted(d.items())) for d in (launch.options, signature, constexprs)), tuple(attrs))
        if key not in seen:
            seen.add(key)
            yield launch


def bucket_token_counts(table=None) -> list[int]:
    """One token count per bucket of the tile table: each bucket's largest (8192 for the open one)."""
    return [upper or 8192 for upper, _ in (table or active_table())]


def survey(
    gpus: list[Gpu], dtypes: list[torch.dtype], shape: tuple[int, int, int, int], token_counts: list[int],
    storage: str | None = None, fp8_block: tuple[int, int] = (128, 128), bias: bool = False,
    activation: GatedActivation = SILU_GLU,
) -> list[dict]:
    """Every distinct binary of a forward (hooks off, and with experts.hook_pre on) at these token counts."""
    n_experts, top_k, d_model, d_expert = shape
    rows = []
    for dtype in dtypes:
        launches, first_tokens = [], {}
        for n in token_counts:
            for hook_pre in (False, True):
                new = record_launches(n, n_experts, top_k, d_model, d_expert, dtype, hook_pre=hook_pre, storage=storage,
                                      fp8_block=fp8_block, bias=bias, activation=activation)
                first_tokens.update({id(launch): n for launch in new})
                launches += new
        for launch in unique_launches(launches):
            for gpu in gpus:
                found = report(launch, gpu)
                rows.append({"gpu": gpu.name, "shared_limit": gpu.shared_limit, "dtype": str(dtype).removeprefix("torch."),
                             "tokens": first_tokens[id(launch)], "label": found.label, **asdict(found)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| GPU | dtype | tokens | kernel | warps | stages | shared KiB (limit) | registers | spill bytes | tl.dot |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['gpu']} | {r['dtype']} | {r['tokens']} | {r['label']} | {r['num_warps']} | {r['num_stages']} | "
                     f"{r['shared'] / 1024:.0f} ({r['shared_limit'] / 1024:.0f}) | {r['registers']} | {r['spill_bytes']} | {r['dot']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moelens.kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", nargs="+", default=["sm_90"], choices=sorted(GPUS))
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--shape", default="64,8,4096,3072", help="experts,top_k,d_model,d_expert (default: Hunyuan-A13B)")
    parser.add_argument("--tokens", help="comma-separated token counts (default: one per bucket of the tile table)")
    parser.add_argument("--tf32", action="store_true", help="compile as if torch allowed tf32 float32 matmuls")
    parser.add_argument("--storage", choices=["fp8", "mxfp4"], help="experts kept stored so, dequantized in the tiles")
    parser.add_argument("--bias", action="store_true", help="experts with biases (gpt-oss's b_gate_up, b_down)")
    parser.add_argument("--clamped-swiglu", action="store_true", help="gpt-oss's ClampedSwiGLU (alpha 1.702, limit 7)")
    parser.add_argument("--fp8-block", default="128,128", help="rows,cols of each fp8 scale's block (with --storage fp8)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a markdown table")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    shape = tuple(int(v) for v in args.shape.split(","))
    if len(shape) != 4:
        parser.error(f"--shape takes experts,top_k,d_model,d_expert, got {args.shape!r}")
    tokens = [int(v) for v in args.tokens.split(",")] if args.tokens else bucket_token_counts()
    fp8_block = tuple(int(v) for v in args.fp8_block.split(","))
    if len(fp8_block) != 2:
        parser.error(f"--fp8-block takes rows,cols, got {args.fp8_block!r}")
    activation = ClampedSwiGLU(alpha=1.702, limit=7.0) if args.clamped_swiglu else SILU_GLU
    rows = survey([GPUS[g] for g in args.gpu], [getattr(torch, d) for d in args.dtype], shape, tokens, args.storage, fp8_block,
                  args.bias, activation)
    print(json.dumps(rows, default=str) if args.json else markdown(rows))


if __name__ == "__main__":
    main()
