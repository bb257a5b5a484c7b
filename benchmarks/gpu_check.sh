#!/usr/bin/env bash
# GPU check of the SGMV kernels (kernels/sgmv/README.md): real Triton compilation and a sampled grid at
# Llama shapes (hidden 4096/11008/14336, ranks 8-128, up to 128 slots, T up to 256, fp16/bf16/fp32)
# against a float64 oracle, then benchmarks/sgmv.py. Needs one CUDA GPU; takes under 5 minutes.
# Usage: benchmarks/gpu_check.sh [extra pytest args]     (PYTHON=... picks the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."

pick_python() {
    for candidate in "${PYTHON:-}" .venv/bin/python python3; do
        if [ -n "$candidate" ] && "$candidate" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}
PY="$(pick_python)" || { echo "gpu_check: no Python with a CUDA-enabled torch found" >&2; exit 2; }
export TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, triton; print(f'gpu_check: {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}')"

echo "== kernel grid: tests/kernels/test_gpu.py (real compilation) =="
# --noconftest: the suite's conftest loads fixtures (Postgres, S3) these kernel tests do not need
timeout 180 "$PY" -m pytest -q -m gpu --noconftest -p no:cacheprovider tests/kernels/test_gpu.py "$@"
tests_rc=$?

echo "== benchmark: benchmarks/sgmv.py --json =="
bench_json="$(timeout 100 "$PY" benchmarks/sgmv.py --json --repeats 5)"
bench_rc=$?
echo "$bench_json"

echo "== summary =="
echo "kernel grid: $([ $tests_rc -eq 0 ] && echo PASS || echo "FAIL (pytest rc=$tests_rc)")"
if [ $bench_rc -eq 0 ]; then
    "$PY" - "$bench_json" <<'PYEOF'
import json, sys
report = json.loads(sys.argv[1])
for backend in ("torch", "triton"):
    r = report.get(backend)
    if r:
        print(f"{backend:6s} {r['device']} {r['dtype']}: copy {r['copy_GBps']} GB/s, T=32 distinct "
              f"{r['distinct_GBps_T32']} GB/s = {r['distinct_bw_fraction']:.2f} of copy; distinct/identical time "
              f"at T=32: qkv {r['distinct_over_identical_time']['qkv/T32']}, "
              f"gate_up {r['distinct_over_identical_time']['gate_up/T32']}, down {r['distinct_over_identical_time']['down/T32']}")
PYEOF
else
    echo "benchmark: FAIL (rc=$bench_rc)"
fi
[ $tests_rc -eq 0 ] && [ $bench_rc -eq 0 ]
