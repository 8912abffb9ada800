"""Triton kernels for the routed experts: two grouped GEMMs over slots sorted by expert, and a combine.

Kernel 1 (gate_up): gathers each slot's token row, multiplies by its expert's gate and up rows with fp32
accumulation, and applies SiLU(gate) * up in the epilogue; it writes the per-slot neurons in slot order
(the input of kernel 2, so experts.hook_post is free) and, when a hook asks, the pre-activations.
Kernel 2 (down): per-slot outputs in slot order, times the router weight in the epilogue.
Combine: per token, an fp32 sum over its slots in slot order, cast once.

Epilogues round where the torch path rounds (gate/up and down outputs to the model dtype, the weight
product to the promoted dtype), so hooks see what the torch path shows them up to accumulation order.
Gradients: each kernel is wrapped in an autograd Function whose backward recomputes that step with the
torch path (`slot_linear`) and differentiates it.
Under TRITON_INTERPRET=1 (CPU tests) tiles are upcast to float32 after loading: the interpreter's bf16
arithmetic and tl.dot are not faithful.

Experts kept stored as fp8 or MXFP4 (moelens.kernels.stored_operands): both GEMM kernels load the codes
(float8_e4m3fn bytes; e2m1 nibbles two per byte) and their scales (float32 per block; E8M0 bytes per 32
columns) and dequantize in the weight tile (decode, float32 product, one rounding to the model dtype), the
bits StoredExperts.dequantize gives, so results match dequantize-then-matmul up to accumulation order. A weight tile whose columns lie in one scale block (BLOCK_K divides the block's columns) loads one
scale per row; any other block shape looks scales up per element.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moelens.experts.spec import GLU, ClampedSwiGLU, ExpertTensors, GatedActivation, gather_rows
from moelens.experts.stored import StoredExperts
from moelens.kernels.experts import ExpertHooks, hooked, hooked_site, slot_linear
from moelens.kernels.routing import SlotLayout, align_slots
from moelens.kernels.stored_operands import StoredOperand, StoredOperands, stored_operands
from moelens.kernels.tiles import Tile, tile_for


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dot_precision() -> str:
    """How tl.dot multiplies float32 tiles: as torch's own float32 matmuls do. Triton's NVIDIA default is tf32,
    torch's is IEEE fp32 unless tf32 is allowed (torch.set_float32_matmul_precision("high") or allow_tf32).
    16-bit tiles ignore it."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 and not _interpreting() else "ieee"


@triton.jit
def _round(x, ty: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """fp32 -> ty. The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even): there, round
    the bits to nearest even first, so that its truncation is exact. NaN/inf are not expected here."""
    if EMULATE_RNE and ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(ty)


@triton.jit
def _e4m3_to_f32(code):
    """float8_e4m3fn bits (uint8) -> float32, exactly as torch converts them: sign, 4 exponent bits (bias 7),
    3 mantissa bits; exponent 0 is subnormal (mantissa * 2**-9), 0x7F / 0xFF are NaN, there is no inf.
    Integer ops only, so the interpreter and every GPU architecture decode alike."""
    c = code.to(tl.uint32)
    sign = c >> 7
    exp = (c >> 3) & 0xF
    man = c & 0x7
    normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    subnormal = man.to(tl.float32) * 0.001953125
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    nan = ((sign << 31) | 0x7FC00000).to(tl.float32, bitcast=True)
    return tl.where(exp == 0, subnormal, tl.where((exp == 15) & (man == 7), nan, normal))


@triton.jit
def _e2m1_scaled_to_f32(nibble, scale):
    """An MXFP4 value as float32 bits, exactly what dequantization gives (moelens.loaders.quantized.MXFP4_VALUES,
    torch.ldexp(e2m1 value, scale - 127)): e2m1 nibble (sign, 2 exponent bits, 1 mantissa bit; exponent 0 is
    0 or 0.5) times 2 ** (scale - 127) for an E8M0 byte. The float32 exponent field is scale + e - 1 (the
    subnormal 0.5 too, with no mantissa); field <= 0 gives a float32 subnormal (the implicit bit shifted right,
    exactly), >= 255 inf (2 ** 128 and above, as ldexp overflows). Integer ops only: no flush-to-zero on any
    GPU."""
    c = nibble.to(tl.int32)
    s = scale.to(tl.int32)
    sign = (c >> 3).to(tl.uint32)
    e = (c >> 1) & 3
    m = c & 1
    field = s + e - 1
    # selects written as integer arithmetic: boolean tensors here made Triton 3.9's sm_90 pipeline put an i1
    # tensor in shared memory and fail (TritonGPUReduceDataDuplication) for 32 x 128 x 32 tiles
    normal_e2m1 = (e + 3) >> 2  # e2m1 exponent != 0: the mantissa bit is the float's
    overflow = tl.minimum(tl.maximum(field - 254, 0), 1)  # 2 ** 128 and above: inf, no mantissa
    mant = (m * normal_e2m1 * (1 - overflow)) << 22
    shift = tl.minimum(tl.maximum(1 - field, 0), 31)  # field <= 0: a float32 subnormal, shifted exactly
    bits = (((1 << 23) | mant) >> shift) + ((tl.maximum(tl.minimum(field, 255), 1) - 1) << 23)
    bits = bits * (((c & 7) + 7) >> 3)  # +-0 codes
    return (bits.to(tl.uint32) | (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _weight_tile(
    w_ptr, s_ptr, expert, rows, row_ok, k0, ks, k_ok, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    ty: tl.constexpr, W_FP8: tl.constexpr, QBLOCK_N: tl.constexpr, QBLOCK_K: tl.constexpr, SCALE_PER_ROW: tl.constexpr,
    EMULATE_RNE: tl.constexpr, W_MXFP4: tl.constexpr = False,
):
    """The [BLOCK_K, BLOCK_N] tile of an expert's weight, transposed: element (k, n) is W[expert, rows[n], ks[k]]
    (rows: stored rows).
    W_FP8: w_ptr holds float8_e4m3fn bytes and s_ptr float32 scales, one per QBLOCK_N x QBLOCK_K block; decoded,
    scaled in float32 and rounded once to ty, as the stored experts' dequantization does, so the tile holds
    the dequantized weights' bits. W_MXFP4: w_ptr holds two e2m1 codes per byte along k (k in byte k // 2, low
    nibble first), s_ptr one E8M0 byte per row and QBLOCK_K (32) columns; decoded with the scale exactly in
    float32 and rounded once to ty, the dequantization's bits. SCALE_PER_ROW: BLOCK_K divides QBLOCK_K, so the
    tile's columns lie in one block column and one scale per row is loaded; otherwise the scale is looked up
    per element (a tile may then cut blocks anywhere, partial last blocks included)."""
    mask = k_ok[:, None] & row_ok[None, :]
    if W_MXFP4:
        packed = tl.load(w_ptr + expert * stride_we + rows[None, :] * stride_wn + (ks[:, None] // 2) * stride_wk, mask=mask, other=0)
        nibble = (packed.to(tl.int32) >> ((ks[:, None] & 1) * 4)) & 0xF
        s_base = s_ptr + expert * stride_se + rows[None, :] * stride_sn
        if SCALE_PER_ROW:
            scale = tl.load(s_base + (k0 // QBLOCK_K) * stride_sk, mask=row_ok[None, :], other=0)
        else:
            scale = tl.load(s_base + (ks[:, None] // QBLOCK_K) * stride_sk, mask=mask, other=0)
        w = _round(_e2m1_scaled_to_f32(nibble, scale), ty, EMULATE_RNE)
    else:
        w = tl.load(w_ptr + expert * stride_we + rows[None, :] * stride_wn + ks[:, None] * stride_wk, mask=mask, other=0)
        if W_FP8:
            s_base = s_ptr + expert * stride_se + (rows[None, :] // QBLOCK_N) * stride_sn
            if SCALE_PER_ROW:
                scale = tl.load(s_base + (k0 // QBLOCK_K) * stride_sk, mask=row_ok[None, :], other=0.0)
            else:
                scale = tl.load(s_base + (ks[:, None] // QBLOCK_K) * stride_sk, mask=mask, other=0.0)
            w = _round(_e4m3_to_f32(w) * scale.to(tl.float32), ty, EMULATE_RNE)
    return w


SILU_GLU = GLU("silu")
ACT_SILU_GLU, ACT_CLAMPED_SWIGLU = 0, 1  # the ACTIVATION constexpr: GLU("silu"), ClampedSwiGLU


@triton.jit
def _silu_mul(gate, up, ty: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """SiLU(gate) * up from values already in ty, rounding where the torch path rounds."""
    g = gate.to(tl.float32)
    silu = _round(g * tl.sigmoid(g), ty, EMULATE_RNE).to(tl.float32)
    return _round(silu * up.to(tl.float32), ty, EMULATE_RNE)


@triton.jit
def _clamped_swiglu(gate, up, alpha, limit, ty: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """ClampedSwiGLU from values already in ty, in its op order, each op rounded to ty as torch rounds it:
    g = clamp(gate, max=limit), u = clamp(up, -limit, limit) (limit already in ty, as torch's clamp casts
    its bound; no rounding: the result is one of the inputs), (u + 1) * (g * sigmoid(g * alpha)) with alpha
    a float32 scalar, as torch's opmath multiplies a tensor by a Python float. NaN passes the clamps."""
    g = gate.to(tl.float32)
    u = up.to(tl.float32)
    g = tl.where(g > limit, limit, g)
    u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    z = _round(g * alpha, ty, EMULATE_RNE).to(tl.float32)
    sig = _round(tl.sigmoid(z), ty, EMULATE_RNE).to(tl.float32)
    glu = _round(g * sig, ty, EMULATE_RNE).to(tl.float32)
    u1 = _round(u + 1.0, ty, EMULATE_RNE).to(tl.float32)
    return _round(u1 * glu, ty, EMULATE_RNE)


@triton.jit
def _activate(gate, up, alpha, limit, ty: tl.constexpr, ACTIVATION: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """The neurons from gate and up in ty. Shared by the fused epilogue and the stand-alone kernel, so results
    do not depend on whether a pre-activation is hooked."""
    if ACTIVATION == 1:
        out = _clamped_swiglu(gate, up, alpha, limit, ty, EMULATE_RNE)
    else:
        out = _silu_mul(gate, up, ty, EMULATE_RNE)
    return out


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, n, alpha, limit, BLOCK: tl.constexpr, UPCAST: tl.constexpr, ACTIVATION: tl.constexpr = 0,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    gate = tl.load(gate_ptr + offs, mask=ok, other=0.0)
    up = tl.load(up_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, _activate(gate, up, alpha, limit, out_ptr.dtype.element_ty, ACTIVATION, UPCAST), mask=ok)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, wu_ptr, ws_ptr, wus_ptr, b_ptr, sorted_ptr, block_expert_ptr, n_padded_ptr, post_ptr, pre_ptr, pre_linear_ptr,
    n_slots, top_k, H, I, gate_row0, up_row0, row_step, alpha, limit,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_se, stride_sn, stride_sh, stride_be, stride_bn,
    stride_os, stride_oi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WRITE_POST: tl.constexpr, WRITE_PRE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_FP8: tl.constexpr = False, QBLOCK_N: tl.constexpr = 1, QBLOCK_K: tl.constexpr = 1, SCALE_PER_ROW: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = 0, W_MXFP4: tl.constexpr = False,
):
    """Gate rows gate_row0 + [0, I) of w_ptr's experts, up rows up_row0 + [0, I) of wu_ptr's (dense: one
    stack, up rows from I; fp8 / mxfp4: codes with their scales ws_ptr / wus_ptr, laid out alike), rows row_step
    apart (2: gate and up rows interleaved, gpt-oss's MXFP4). HAS_BIAS: b_ptr is
    b_gate_up [E, 2I] (gate then up), added to the rounded GEMM outputs and rounded again, as the torch path
    adds it."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_padded_ptr):
        return  # past the last expert's rows: the grid is an upper bound
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + rows).to(tl.int64)
    valid = slots < n_slots  # padding rows carry n_slots
    tokens = tl.where(valid, slots // top_k, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    w_ty = x_ptr.dtype.element_ty
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :] * stride_xh, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_gate = _weight_tile(w_ptr, ws_ptr, expert, gate_row0 + cols * row_step, col_ok, k0, ks, k_ok, stride_we, stride_wn,
                              stride_wh, stride_se, stride_sn, stride_sh, w_ty, W_FP8, QBLOCK_N, QBLOCK_K, SCALE_PER_ROW, UPCAST,
                              W_MXFP4)
        w_up = _weight_tile(wu_ptr, wus_ptr, expert, up_row0 + cols * row_step, col_ok, k0, ks, k_ok, stride_we, stride_wn,
                            stride_wh, stride_se, stride_sn, stride_sh, w_ty, W_FP8, QBLOCK_N, QBLOCK_K, SCALE_PER_ROW, UPCAST,
                            W_MXFP4)
        if UPCAST:
            a = a.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        acc_gate = tl.dot(a, w_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    out_ty = post_ptr.dtype.element_ty
    gate = _round(acc_gate, out_ty, UPCAST)
    up = _round(acc_up, out_ty, UPCAST)
    if HAS_BIAS:
        b_gate = tl.load(b_ptr + expert * stride_be + cols * stride_bn, mask=col_ok, other=0.0).to(tl.float32)
        b_up = tl.load(b_ptr + expert * stride_be + (I + cols) * stride_bn, mask=col_ok, other=0.0).to(tl.float32)
        gate = _round(gate.to(tl.float32) + b_gate[None, :], out_ty, UPCAST)
        up = _round(up.to(tl.float32) + b_up[None, :], out_ty, UPCAST)
    out_offsets = slots[:, None] * stride_os + cols[None, :] * stride_oi
    out_mask = valid[:, None] & col_ok[None, :]
    if WRITE_PRE:
        tl.store(pre_ptr + out_offsets, gate, mask=out_mask)
        tl.store(pre_linear_ptr + out_offsets, up, mask=out_mask)
    if WRITE_POST:
        tl.store(post_ptr + out_offsets, _activate(gate, up, alpha, limit, out_ty, ACTIVATION, UPCAST), mask=out_mask)


@triton.jit
def _down_kernel(
    post_ptr, w_ptr, ws_ptr, b_ptr, sorted_ptr, block_expert_ptr, n_padded_ptr, weights_ptr, out_ptr,
    n_slots, H, I, row0,
    stride_ps, stride_pi, stride_we, stride_wh, stride_wi, stride_se, stride_sh, stride_si, stride_be, stride_bh,
    stride_os, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, W_FP8: tl.constexpr = False, QBLOCK_N: tl.constexpr = 1, QBLOCK_K: tl.constexpr = 1,
    SCALE_PER_ROW: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, W_MXFP4: tl.constexpr = False,
):
    """HAS_BIAS: b_ptr is b_down [E, H], added to the rounded GEMM output and rounded again (the torch path's
    down + bias), before the router weight."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(n_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + rows).to(tl.int64)
    valid = slots < n_slots
    safe_slots = tl.where(valid, slots, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < I
        a = tl.load(post_ptr + safe_slots[:, None] * stride_ps + ks[None, :] * stride_pi, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_ptr, ws_ptr, expert, row0 + cols, col_ok, k0, ks, k_ok, stride_we, stride_wh, stride_wi,
                         stride_se, stride_sh, stride_si, post_ptr.dtype.element_ty, W_FP8, QBLOCK_N, QBLOCK_K, SCALE_PER_ROW, UPCAST,
                         W_MXFP4)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    down = _round(acc, post_ptr.dtype.element_ty, UPCAST).to(tl.float32)  # the torch path's down output
    if HAS_BIAS:
        bias = tl.load(b_ptr + expert * stride_be + cols * stride_bh, mask=col_ok, other=0.0).to(tl.float32)
        down = _round(down + bias[None, :], post_ptr.dtype.element_ty, UPCAST).to(tl.float32)
    weight = tl.load(weights_ptr + safe_slots, mask=valid, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    weighted = _round(down * weight[:, None], out_ty, UPCAST)
    tl.store(out_ptr + slots[:, None] * stride_os + cols[None, :] * stride_oh, weighted, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _combine_kernel(
    in_ptr, out_ptr, T, H, top_k, stride_it, stride_ik, stride_ih, stride_ot, stride_oh,
    BLOCK_H: tl.constexpr, UPCAST: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for s in range(0, top_k):  # slot order, as the torch path and the reference sum
        acc += tl.load(in_ptr + t * stride_it + s * stride_ik + cols * stride_ih, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols * stride_oh, _round(acc, out_ptr.dtype.element_ty, UPCAST), mask=ok)


def _grid_m(layout: SlotLayout) -> int:
    return layout.max_blocks


def _stored_args(op: StoredOperand, tile: Tile) -> dict:
    fmt = dict(W_FP8=True) if op.method == "fp8" else dict(W_MXFP4=True)
    return dict(**fmt, QBLOCK_N=op.block[0], QBLOCK_K=op.block[1], SCALE_PER_ROW=op.block[1] % tile.block_k == 0)


def activation_args(activation: GatedActivation, dtype: torch.dtype) -> dict:
    """The kernels' ACTIVATION constexpr and its scalars for `activation` in dtype. ClampedSwiGLU's limit is cast
    to dtype on the host, as torch's clamp casts its bound to the tensor's dtype; alpha stays a float32 scalar."""
    if isinstance(activation, ClampedSwiGLU):
        limit = torch.tensor(activation.limit, dtype=dtype).item()
        return dict(ACTIVATION=ACT_CLAMPED_SWIGLU, alpha=float(activation.alpha), limit=float(limit))
    if activation.silu_glu:
        return dict(ACTIVATION=ACT_SILU_GLU, alpha=1.0, limit=0.0)
    raise ValueError(f"the Triton expert kernels compute SiLU(gate) * up or ClampedSwiGLU, not {activation.formula}")


def _bias_args(bias: torch.Tensor | None, x: torch.Tensor, name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int], dict]:
    if bias is None:
        return x, (0, 0), {}
    if bias.dtype != x.dtype or tuple(bias.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)} in the activations' dtype {x.dtype}, got {list(bias.shape)} {bias.dtype}")
    return bias, bias.stride(), dict(HAS_BIAS=True)


def gate_up(
    x: torch.Tensor, W_gate_up: torch.Tensor | StoredOperands, layout: SlotLayout, tile: Tile, top_k: int, write_pre: bool,
    bias: torch.Tensor | None = None, activation: GatedActivation = SILU_GLU,
):
    """The per-slot neurons [S, I]; or, with write_pre, the pre-activations [S, 2I] (gate then up), for
    hooks that read or replace them before the activation. W_gate_up: the dense stack, or stored experts
    (dequantized in the kernel's tiles). bias: b_gate_up [E, 2I], or None."""
    S, H = layout.n_slots, x.shape[1]
    if isinstance(W_gate_up, StoredOperands):
        gate, up = W_gate_up.gate, W_gate_up.up
        if ((gate.codes.stride(), gate.scales.stride(), gate.block, gate.method, gate.row_step)
                != (up.codes.stride(), up.scales.stride(), up.block, up.method, up.row_step)):
            raise ValueError(f"stored gate and up weights must share strides, blocks, format and row step, got {gate} and {up}")
        I = gate.n_rows
        weights = (gate.codes, up.codes, gate.scales, up.scales)
        rows0, w_strides, s_strides = (gate.row0, up.row0, gate.row_step), gate.codes.stride(), gate.scales.stride()
        quantized = _stored_args(gate, tile)
    else:
        I = W_gate_up.shape[1] // 2
        weights = (W_gate_up, W_gate_up, W_gate_up, W_gate_up)  # no scales: their arguments go unread
        rows0, w_strides, s_strides, quantized = (0, I, 1), W_gate_up.stride(), (0, 0, 0), {}
    b, b_strides, biased = _bias_args(bias, x, "b_gate_up", (_n_experts(W_gate_up), 2 * I))
    act = activation_args(activation, x.dtype)
    out = x.new_empty(S, 2 * I if write_pre else I)
    post, pre, pre_linear = out, out[:, :I], out[:, I:]
    grid = (_grid_m(layout), triton.cdiv(I, tile.block_n))
    _gate_up_kernel[grid](
        x, *weights, b, layout.sorted_slots, layout.block_expert, layout.n_padded, post, pre, pre_linear,
        S, top_k, H, I, *rows0, act["alpha"], act["limit"],
        x.stride(0), x.stride(1), *w_strides, *s_strides, *b_strides, out.stride(0), out.stride(1),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        WRITE_POST=not write_pre, WRITE_PRE=write_pre, UPCAST=_interpreting(), DOT_PRECISION=_dot_precision(),
        num_warps=tile.num_warps, num_stages=tile.num_stages, ACTIVATION=act["ACTIVATION"], **quantized, **biased,
    )
    return out


def _n_experts(W: torch.Tensor | StoredOperands) -> int:
    return W.n_experts if isinstance(W, StoredOperands) else W.shape[0]


def down(
    post: torch.Tensor, W_down: torch.Tensor | StoredOperands, weights: torch.Tensor, layout: SlotLayout, tile: Tile,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted per-slot outputs [S, H], in the promoted dtype of the model and the router weights. bias: b_down
    [E, H], or None."""
    S, I = layout.n_slots, post.shape[1]
    if isinstance(W_down, StoredOperands):
        op = W_down.down
        H, stacks, row0, w_strides, s_strides, quantized = op.n_rows, (op.codes, op.scales), op.row0, op.codes.stride(), op.scales.stride(), _stored_args(op, tile)
        if op.row_step != 1:
            raise ValueError(f"a stored down weight is read with row step 1, got {op}")
    else:
        H, stacks, row0, w_strides, s_strides, quantized = W_down.shape[1], (W_down, W_down), 0, W_down.stride(), (0, 0, 0), {}
    b, b_strides, biased = _bias_args(bias, post, "b_down", (_n_experts(W_down), H))
    out = post.new_empty(S, H, dtype=torch.promote_types(post.dtype, weights.dtype))
    grid = (_grid_m(layout), triton.cdiv(H, tile.block_n))
    _down_kernel[grid](
        post, *stacks, b, layout.sorted_slots, layout.block_expert, layout.n_padded, weights.reshape(-1), out,
        S, H, I, row0,
        post.stride(0), post.stride(1), *w_strides, *s_strides, *b_strides, out.stride(0), out.stride(1),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, UPCAST=_interpreting(),
        DOT_PRECISION=_dot_precision(), num_warps=tile.num_warps, num_stages=tile.num_stages, **quantized, **biased,
    )
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, activation: GatedActivation = SILU_GLU) -> torch.Tensor:
    """The neurons from (possibly hook-replaced) pre-activations: `activation` as the fused epilogue computes it."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    block = 1024
    args = activation_args(activation, gate.dtype)
    _silu_mul_kernel[(triton.cdiv(gate.numel(), block),)](
        gate, up, out, gate.numel(), args["alpha"], args["limit"], BLOCK=block, UPCAST=_interpreting(), ACTIVATION=args["ACTIVATION"],
    )
    return out


def combine(weighted: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    T, k, H = weighted.shape
    out = weighted.new_empty(T, H, dtype=dtype)
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block_h))](
        weighted, out, T, H, k, weighted.stride(0), weighted.stride(1), weighted.stride(2), out.stride(0), out.stride(1),
        BLOCK_H=block_h, UPCAST=_interpreting(),
    )
    return out


# ---- autograd: Triton forward, torch-path backward --------------------------------------------------


def _saved_weight(ctx, weight: torch.Tensor | StoredOperands) -> torch.Tensor:
    """A tensor to save for backward: the weight itself, or an empty placeholder for stored experts (kept on
    ctx, dequantized only if a backward runs)."""
    ctx.stored = weight if isinstance(weight, StoredOperands) else None
    return weight.gate.codes.new_empty(0) if isinstance(weight, StoredOperands) else weight


def _dense_weight(ctx, saved: torch.Tensor, dtype: torch.dtype, index: int) -> torch.Tensor:
    if ctx.stored is None:
        return saved
    if ctx.stored.stored is None:
        raise RuntimeError("stored operands given without their StoredExperts cannot be differentiated")
    return ctx.stored.stored.dequantize(dtype)[index]


def _grads(out: torch.Tensor, leaves: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor | None]:
    """d out / d leaf for the leaves that require grad, None for the others."""
    needed = [t for t in leaves if t.requires_grad]
    found = iter(torch.autograd.grad(out, needed, grad, allow_unused=True)) if needed else iter(())
    return [next(found) if t.requires_grad else None for t in leaves]


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_(t.requires_grad)


class _GateUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W_gate_up, bias, layout, tile, top_k, write_pre, experts, activation):
        ctx.save_for_backward(x, _saved_weight(ctx, W_gate_up), bias, experts)
        ctx.top_k, ctx.write_pre, ctx.activation = top_k, write_pre, activation
        return gate_up(x, W_gate_up, layout, tile, top_k, write_pre, bias, activation)

    @staticmethod
    def backward(ctx, grad):
        x, W_gate_up, bias, experts = ctx.saved_tensors
        W_gate_up = _dense_weight(ctx, W_gate_up, x.dtype, 0)
        with torch.enable_grad():
            x_, W_, b_ = _leaf(x), _leaf(W_gate_up), _leaf(bias)
            out = slot_linear(x_, experts, W_, top_k=ctx.top_k)
            if b_ is not None:
                out = out + gather_rows(b_, experts)
            if not ctx.write_pre:
                out = ctx.activation(*out.chunk(2, dim=-1))
            gx, gW, gb = _grads(out, [x_, W_, b_ if b_ is not None else x_.new_empty(0)], grad)
        return gx, gW, gb, None, None, None, None, None, None


class _Down(torch.autograd.Function):
    @staticmethod
    def forward(ctx, post, W_down, bias, weights, layout, tile, experts):
        ctx.save_for_backward(post, _saved_weight(ctx, W_down), bias, weights, experts)
        return down(post, W_down, weights, layout, tile, bias)

    @staticmethod
    def backward(ctx, grad):
        post, W_down, bias, weights, experts = ctx.saved_tensors
        W_down = _dense_weight(ctx, W_down, post.dtype, 1)
        with torch.enable_grad():
            p_, W_, b_, w_ = _leaf(post), _leaf(W_down), _leaf(bias), _leaf(weights)
            out = slot_linear(p_, experts, W_)
            if b_ is not None:
                out = out + gather_rows(b_, experts)
            out = out * w_.reshape(-1, 1)
            gp, gW, gb, gw = _grads(out, [p_, W_, b_ if b_ is not None else p_.new_empty(0), w_], grad)
        return gp, gW, gb, gw, None, None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return silu_mul(gate, up, activation)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
            return (*torch.autograd.grad(ctx.activation(g, u), (g, u), grad), None)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weighted, dtype):
        ctx.in_dtype, ctx.top_k = weighted.dtype, weighted.shape[1]
        return combine(weighted, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.unsqueeze(1).expand(-1, ctx.top_k, -1).to(ctx.in_dtype), None


def routed_experts_triton(
    x, indices, weights, tensors: ExpertTensors | StoredExperts | StoredOperands, hooks: ExpertHooks, batch_pos,
    tile: Tile | None = None, activation: GatedActivation = SILU_GLU,
) -> torch.Tensor:
    """The experts of a spec the kernels compute (ExpertSpec.fused_by_triton: SiLU(gate) * up or ClampedSwiGLU,
    with or without biases; activation is the spec's). Experts kept stored as fp8 or MXFP4 are dequantized in the
    kernels' tiles (moelens.kernels.stored_operands), to the bits StoredExperts.dequantize(x.dtype) gives; a
    stored layout the tiles do not read is dequantized first, with that same function."""
    if isinstance(tensors, StoredExperts):  # dequantized first where the model's dtype moves rounded it
        stored = stored_operands(tensors, x.dtype) if tensors.dequantizes_directly(x.dtype) else None
        if stored is None:
            tensors = tensors.dequantize(x.dtype)
        else:
            tensors = stored
    b_gate_up = b_down = None
    if isinstance(tensors, StoredOperands):
        W_gate_up = W_down = tensors
        b_gate_up, b_down = tensors.gate_up_bias, tensors.down_bias
    if isinstance(tensors, ExpertTensors):
        W_gate_up, W_down, b_gate_up, b_down = tensors
    T, k = indices.shape
    if tile is None:
        tile = tile_for(T).for_dtype(x.dtype)
        if isinstance(W_gate_up, StoredOperands):
            tile = tile.for_storage(W_gate_up.gate.method, (W_gate_up.gate.block[1], W_gate_up.down.block[1]), x.dtype)
    layout = align_slots(indices, tensors.n_experts, tile.block_m)
    experts = indices.reshape(-1)
    x = x.contiguous()
    write_pre = hooks.hooked("pre") or hooks.hooked("pre_linear")
    if write_pre:  # the hooks may replace pre-activations: the activation then runs on what they return
        pre, pre_linear = _GateUp.apply(x, W_gate_up, b_gate_up, layout, tile, k, True, experts, activation).view(T, k, -1).chunk(2, dim=-1)
        pre = hooked_site(hooks, "pre", pre, batch_pos)[0]
        pre_linear = hooked_site(hooks, "pre_linear", pre_linear, batch_pos)[0]
        post = _SiluMul.apply(pre, pre_linear, activation)
    else:
        post = _GateUp.apply(x, W_gate_up, b_gate_up, layout, tile, k, False, experts, activation).view(T, k, -1)
    post = hooked_site(hooks, "post", post, batch_pos)[0]  # a replacement is what kernel 2 reads
    post = post.reshape(T * k, -1).contiguous()
    if hooks.hooked("out"):
        # kernel 2 with unit weights gives down (+ bias) rounded as the fused path rounds it, exactly (x * 1); the
        # weights then multiply what the hook returns, in the promoted dtype, as the kernel's epilogue does
        unit = torch.ones_like(weights, memory_format=torch.contiguous_format)
        out = _Down.apply(post, W_down, b_down, unit, layout, tile, experts).to(post.dtype).view(T, k, -1)
        out = hooked_site(hooks, "out", out, batch_pos)[0]
        weighted = out * weights.unsqueeze(-1)
    else:
        weighted = _Down.apply(post, W_down, b_down, weights.contiguous(), layout, tile, experts)
    weighted = hooked(hooks.outputs, weighted.view(T, k, -1), batch_pos)
    return _Combine.apply(weighted.contiguous(), x.dtype)
