#!/usr/bin/env bash
# The GPU checks, on a machine with an NVIDIA GPU (about 10 minutes), from the repository root:
#   bash benchmarks/gpu_check.sh            # logs and tables in $OUT, else /tmp/gpu_check
# 1. the Triton kernel tests compiled for the GPU (not the interpreter), against the float64 loop on the CPU;
# 2. the routed-expert benchmark at the four flagship shapes (README table);
# 3. expert offload: copy bandwidth, prefill/decode resident vs offloaded, logits bit for bit.
# If step 1 passes, add the GPU's compute capability to VERIFIED_TRITON_ARCHS in moelens/kernels/experts.py.
# It uses the torch, triton and transformers installed on the machine; moelens runs from this checkout (PYTHONPATH).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$out/env.txt"
# end-to-end tests need transformers' newest families; the kernel tests do not
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py -k "not end_to_end and not triton_backend" 2>&1 | tee "$out/kernel_tests.log"
timeout 240 python3 benchmarks/bench_triton_experts.py --repeat 10 2>&1 | tee "$out/bench_triton.md"
timeout 130 python3 benchmarks/bench_offload_gpu.py 2>&1 | tee "$out/bench_offload.md"
