"""The expert kernels compiled for real NVIDIA targets (sm_90, sm_80) on this machine, no GPU needed.

The interpreter runs the kernels' arithmetic but not Triton's compiler: these tests take every kernel of
every tile-table bucket through TTIR -> PTX -> cubin (moelens.kernels.aot, in a subprocess without
TRITON_INTERPRET) and check what a GPU launch would run into: shared memory over the GPU's limit
(OutOfResources), register spills on the H100/H200 target, and which instructions tl.dot became.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton.backends.nvidia.compiler")

from moelens.kernels.tiles import DEFAULT_TABLE, Tile  # noqa: E402

pytestmark = pytest.mark.slow

RUNS = {
    # every bucket of the default table, 16- and 32-bit, on both targets (Hunyuan-A13B's expert shape)
    "table": ["--gpu", "sm_90", "sm_80", "--dtype", "bfloat16", "float32"],
    # float32 when torch allows tf32 matmuls: tensor cores, as torch's own matmul would use
    "tf32": ["--gpu", "sm_90", "sm_80", "--dtype", "float32", "--tokens", "16,8192", "--tf32"],
    # widths that are not multiples of 16 (no divisibility hints) and a token count in no bucket's top
    "unaligned": ["--gpu", "sm_90", "--dtype", "bfloat16", "--tokens", "7", "--shape", "8,2,40,24"],
    # experts kept stored as fp8, dequantized in the tiles: every bucket with 128 x 128 blocks; 32 x 32 blocks
    # with partial last blocks (widths multiples of 16, as real models' are, not of 32; block_k cut to 32: one
    # scale per row of a tile); 32 x 24 blocks on unaligned widths, which no power-of-two block_k divides (a
    # scale per element)
    "fp8": ["--gpu", "sm_90", "--dtype", "bfloat16", "--storage", "fp8"],
    "fp8_small_blocks": ["--gpu", "sm_90", "--dtype", "bfloat16", "--storage", "fp8", "--fp8-block", "32,32",
                         "--tokens", "7,300", "--shape", "8,2,272,208"],
    "fp8_odd_blocks": ["--gpu", "sm_90", "--dtype", "bfloat16", "--storage", "fp8", "--fp8-block", "32,24",
                       "--tokens", "7", "--shape", "8,2,72,40"],
    # fp8 with float32 activations: the tiles Tile.for_storage narrows for float32
    "fp8_float32": ["--gpu", "sm_90", "--dtype", "float32", "--storage", "fp8"],
    # gpt-oss-20b's experts (32 experts, top 4, 2880 x 2880): biases and ClampedSwiGLU, dense and kept MXFP4
    "biased": ["--gpu", "sm_90", "--dtype", "bfloat16", "--bias", "--clamped-swiglu", "--shape", "32,4,2880,2880"],
    "mxfp4": ["--gpu", "sm_90", "--dtype", "bfloat16", "float32", "--storage", "mxfp4", "--bias", "--clamped-swiglu",
              "--shape", "32,4,2880,2880"],
}


@pytest.fixture(scope="module")
def surveys():
    """The surveys, run side by side (each is one `python -m moelens.kernels.aot --json`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    running = {
        name: subprocess.Popen([sys.executable, "-m", "moelens.kernels.aot", "--json", *argv], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, argv in RUNS.items()
    }
    found = {}
    for name, proc in running.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"aot survey {name!r} failed:\n{err[-3000:]}"
        found[name] = json.loads(out)
    return found


def gemms(rows):
    return [r for r in rows if "BLOCK_K" in r["constexprs"]]


def test_every_bucket_compiles_with_its_tile_on_both_targets(surveys):
    rows = surveys["table"]
    for gpu in ("sm_90", "sm_80"):
        for dtype in (torch.bfloat16, torch.float32):
            name = str(dtype).removeprefix("torch.")
            labels = {r["label"] for r in rows if r["gpu"] == gpu and r["dtype"] == name}
            for _, tile in DEFAULT_TABLE:
                t = tile.for_dtype(dtype)
                size = f"{t.block_m}x{t.block_n}x{t.block_k}"
                assert {f"gate_up {size}", f"gate_up pre {size}", f"down {size}"} <= labels, (gpu, name, size)
            assert {"combine", "silu_mul"} <= labels


def test_shared_memory_fits_the_gpu(surveys):
    for rows in surveys.values():
        for r in rows:
            assert r["shared"] <= r["shared_limit"], f"{r['gpu']} {r['dtype']} {r['label']}: {r['shared']} bytes"


def test_16_bit_tiles_run_on_tensor_cores_without_spills_on_hopper(surveys):
    for r in gemms(surveys["table"] + surveys["unaligned"]):
        if r["dtype"] != "bfloat16":
            continue
        hopper_wide = r["gpu"] == "sm_90" and r["constexprs"]["BLOCK_M"] >= 64 and r["num_warps"] % 4 == 0
        assert r["dot"] == ("wgmma.bf16" if hopper_wide else "mma.bf16"), r["label"]
        if r["gpu"] == "sm_90":
            assert r["spill_bytes"] == 0, f"{r['label']} spills {r['spill_bytes']} bytes on sm_90"


def test_fp8_tiles_compile_for_every_bucket_on_tensor_cores_without_spills_on_hopper(surveys):
    """The fp8 weight tiles are decoded and scaled in registers before tl.dot: still bf16 tensor-core dots
    (wgmma where the dense tiles use it) and, with one scale per tile row, no register spills on sm_90, for
    every bucket's tile (Tile.for_storage). The per-element scale lookup (blocks no power-of-two block_k
    divides) compiles and fits in shared memory, and spills (see Tile.for_storage)."""
    labels = {r["label"] for r in surveys["fp8"]}
    for _, tile in DEFAULT_TABLE:
        t = tile.for_dtype(torch.bfloat16).for_storage("fp8", (128,))
        size = f"{t.block_m}x{t.block_n}x{t.block_k}"
        assert {f"gate_up fp8 {size}", f"gate_up fp8 pre {size}", f"down fp8 {size}"} <= labels, size
    per_row = gemms(surveys["fp8"] + surveys["fp8_small_blocks"])
    per_element = gemms(surveys["fp8_odd_blocks"])
    assert {r["constexprs"]["SCALE_PER_ROW"] for r in per_row} == {True}
    assert {r["constexprs"]["SCALE_PER_ROW"] for r in per_element} == {False} and per_element
    for r in per_row + per_element:
        assert r["constexprs"]["W_FP8"] and " fp8" in r["label"]
        hopper_wide = r["constexprs"]["BLOCK_M"] >= 64 and r["num_warps"] % 4 == 0
        assert r["dot"] == ("wgmma.bf16" if hopper_wide else "mma.bf16"), r["label"]
    for r in per_row:
        assert r["spill_bytes"] == 0, f"{r['label']} spills {r['spill_bytes']} bytes on sm_90"


def test_biased_and_mxfp4_tiles_compile_for_every_bucket_without_spills_on_hopper(surveys):
    """Biases and ClampedSwiGLU in the epilogues, dense and with MXFP4 decoded in the weight tiles (one exponent
    per tile row): every bucket's tile (Tile.for_storage) compiles for sm_90 on bf16 tensor cores (IEEE fma for
    float32), fits in shared memory, and spills no register."""
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        labels = {r["label"] for r in surveys["mxfp4"] if r["dtype"] == name}
        for _, tile in DEFAULT_TABLE:
            t = tile.for_dtype(dtype).for_storage("mxfp4", (32,), dtype)
            size = f"{t.block_m}x{t.block_n}x{t.block_k}"
            expected = {f"gate_up mxfp4 bias clamped {size}", f"gate_up mxfp4 bias clamped pre {size}", f"down mxfp4 bias {size}"}
            assert expected <= labels, (name, size)
        assert "silu_mul clamped" in labels
    dense = {r["label"] for r in surveys["biased"]}
    for _, tile in DEFAULT_TABLE:
        size = f"{tile.block_m}x{tile.block_n}x{tile.block_k}"
        assert {f"gate_up bias clamped {size}", f"gate_up bias clamped pre {size}", f"down bias {size}"} <= dense, size
    mxfp4 = gemms(surveys["mxfp4"])
    assert {r["constexprs"]["SCALE_PER_ROW"] for r in mxfp4} == {True}
    for r in mxfp4 + gemms(surveys["biased"]):
        hopper_wide = r["constexprs"]["BLOCK_M"] >= 64 and r["num_warps"] % 4 == 0
        assert r["dot"] == ("fma" if r["dtype"] == "float32" else "wgmma.bf16" if hopper_wide else "mma.bf16"), r["label"]
    for r in surveys["mxfp4"] + surveys["biased"]:
        assert r["spill_bytes"] == 0, f"{r['dtype']} {r['label']} spills {r['spill_bytes']} bytes on sm_90"


def test_fp8_float32_tiles_do_not_spill_on_hopper(surveys):
    rows = gemms(surveys["fp8_float32"])
    assert rows and {r["dot"] for r in rows} == {"fma"}
    for r in rows:
        assert r["spill_bytes"] == 0, f"float32 {r['label']} spills {r['spill_bytes']} bytes on sm_90"


def test_fp8_tiles_keep_one_scale_per_row_and_halve_k_where_four_warps_spilled():
    assert Tile(32, 128, 64).for_storage("fp8", (128,)) == Tile(32, 128, 32)
    assert Tile(16, 128, 64).for_storage("fp8", (128, 128)) == Tile(16, 128, 64)
    assert Tile(64, 128, 64, num_warps=8).for_storage("fp8", (128,)) == Tile(64, 128, 64, num_warps=8)
    assert Tile(16, 64, 64).for_storage("fp8", (32, 128)) == Tile(16, 64, 32)  # 32-column blocks
    assert Tile(16, 64, 64).for_storage("fp8", (24,)) == Tile(16, 64, 16)  # none divides: per element
    assert Tile(32, 128, 64).for_storage(None) == Tile(32, 128, 64)
    # mxfp4: 4-warp tiles of >= 32 rows quarter block_k; float32 8-warp tiles: <= 64 rows, block_k 16
    assert Tile(32, 128, 64).for_storage("mxfp4", (32,)) == Tile(32, 128, 16)
    assert Tile(16, 128, 64).for_storage("mxfp4", (32,)) == Tile(16, 128, 32)
    assert Tile(128, 128, 64, num_warps=8).for_storage("mxfp4", (32,)) == Tile(128, 128, 32, num_warps=8)
    f32 = torch.float32
    assert Tile(128, 64, 32, num_warps=8).for_storage("fp8", (128,), f32) == Tile(64, 64, 16, num_warps=8)
    assert Tile(128, 64, 32, num_warps=8).for_storage("fp8", (128,), torch.bfloat16) == Tile(128, 64, 32, num_warps=8)
    assert Tile(16, 64, 32).for_storage("mxfp4", (32,), f32) == Tile(16, 64, 32)


def test_float32_dots_are_ieee_unless_torch_allows_tf32(surveys):
    """Triton's default for float32 tl.dot is tf32; torch's float32 matmul is IEEE unless tf32 is allowed."""
    ieee = [r for r in gemms(surveys["table"]) if r["dtype"] == "float32"]
    tf32 = gemms(surveys["tf32"])
    assert ieee and tf32
    assert {r["dot"] for r in ieee} == {"fma"}
    assert {r["dot"] for r in tf32 if r["gpu"] == "sm_80"} == {"mma.tf32"}
    assert "wgmma.tf32" in {r["dot"] for r in tf32 if r["gpu"] == "sm_90"}


def test_float32_tiles_halve_n_and_k():
    assert Tile(128, 128, 64).for_dtype(torch.float32) == Tile(128, 64, 32)
    assert Tile(16, 32, 16).for_dtype(torch.float32) == Tile(16, 16, 16)
    assert Tile(128, 128, 64).for_dtype(torch.bfloat16) == Tile(128, 128, 64)


def test_argument_specialisation_matches_triton_launcher():
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    from moelens.kernels.aot import _specialise

    base = torch.zeros(64, dtype=torch.bfloat16)
    for value in (1, 2, 16, 40, 4096, 2**31, -(2**31) - 1, base, base[1:], base.float(), base.int()):
        kind, key = native(CUDABackend, value, False, True, True)[:2]
        assert _specialise(value) == (kind, key == "D"), value
