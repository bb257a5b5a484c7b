#!/usr/bin/env bash
# The GPU check: one command on one CUDA GPU, under 8 minutes on an H200. Prints one JSON
# line per part, then a {"part": "summary", ...} line; exits 1 when a part that ran did not pass
# (2 without a CUDA-enabled Python). Parts, in order:
#   sgmv_grid        tests/kernels/test_gpu.py: SGMV compiled at Llama shapes vs the float64 oracle
#   attention_grid   tests/kernels/test_attention_gpu.py: paged attention compiled at model shapes,
#                    poisoned stale slots, no host sync, CUDA-graph replay vs eager
#   moe_grid         tests/kernels/test_moe_gpu.py: the grouped MoE GEMM at Qwen3-MoE / Mixtral shapes
#   engine_gpu       gpu-marked tests under tests/base_engine (the engine oracle vs transformers on CUDA,
#                    decode-graph replay with changing adapter sets vs eager): "no_tests" until they exist;
#                    loads the suite's conftest, so the test dependencies must be installed there
#   paged_attention  benchmarks/paged_attention.py: the Triton kernels vs the engine's torch path
#   sgmv_bandwidth   benchmarks/sgmv.py --backends triton: fraction of the copy bandwidth (target >= 0.5)
#   decode_throughput  benchmarks/gpu_decode.py when present (8B-like shapes, 1 / 32 adapters, roofline);
#                    "absent" until the engine's CUDA path lands
# Usage: benchmarks/gpu_check.sh [extra pytest args for the kernel grids]
#   PYTHON=...            the interpreter (default: .venv/bin/python, then python3)
#   GPU_CHECK_LOGS=dir    where each part's full output goes (default: a new temporary directory)
#   GPU_CHECK_BUDGET_S=n  whole-run budget in seconds (default 450): each part's timeout is cut to what
#                         is left, and a part that would start with under 30 s left is skipped
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
    local candidate
    for candidate in "${PYTHON:-}" .venv/bin/python python3; do
        if [ -n "$candidate" ] && "$candidate" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    return 1
}
PY="$(pick_python)" || { echo '{"part": "env", "status": "fail", "error": "no Python with a CUDA-enabled torch"}'; exit 2; }
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOGS="${GPU_CHECK_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}"
mkdir -p "$LOGS"
: >"$LOGS/parts.jsonl"
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"
START=$SECONDS

# report NAME KIND RC SECONDS LOG [STATUS]: one JSON line for a part, also appended to parts.jsonl.
# KIND pytest: counts from pytest's summary line; KIND json: the last JSON line of the output as "result".
report() {
    "$PY" - "$@" <<'PYEOF' | tee -a "$LOGS/parts.jsonl"
import json, re, sys
name, kind, rc, seconds, log = sys.argv[1:6]
status = sys.argv[6] if len(sys.argv) > 6 else None
rc = int(rc)
line = {"part": name, "rc": rc, "seconds": int(seconds), "log": log}
try:
    text = open(log, errors="replace").read()
except OSError:
    text = ""
if status is None:
    status = {0: "pass", 124: "timeout", 137: "timeout"}.get(rc, "fail")
    if kind == "pytest" and rc == 5:
        status = "no_tests"
line["status"] = status
if kind == "pytest":
    tail = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", l)]
    if tail:
        for count, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail[-1]):
            line[what.rstrip("s") if what.startswith("error") else what] = int(count)
elif kind == "json":
    for raw in reversed(text.splitlines()):
        if raw.startswith("{"):
            try:
                line["result"] = json.loads(raw)
                break
            except ValueError:
                continue
    if status == "pass" and "result" not in line:
        line["status"] = "fail"
        line["error"] = "no JSON line in the output"
print(json.dumps(line))
PYEOF
}

# part NAME KIND CAP_S CMD...: CMD under a timeout of min(CAP_S, budget left), output to $LOGS/NAME.log
part() {
    local name=$1 kind=$2 cap=$3
    shift 3
    local log="$LOGS/$name.log" left=$((BUDGET_S - (SECONDS - START))) rc=0 t0=$SECONDS
    if [ "$left" -lt 30 ]; then
        echo "skipped: ${left}s of the ${BUDGET_S}s budget left" >"$log"
        report "$name" "$kind" 0 0 "$log" skipped
        return 0
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    timeout --kill-after=10 "$cap" "$@" >"$log" 2>&1 || rc=$?
    report "$name" "$kind" "$rc" $((SECONDS - t0)) "$log"
    if [ "$rc" -ne 0 ] && ! { [ "$kind" = pytest ] && [ "$rc" -eq 5 ]; }; then
        { echo "---- $name: last lines of $log ----"; tail -n 40 "$log"; } >&2
    fi
}

"$PY" - "$LOGS" <<'PYEOF' | tee -a "$LOGS/parts.jsonl"
import json, subprocess, sys
line = {"part": "env", "status": "pass", "logs": sys.argv[1]}
try:
    import torch, triton
    p = torch.cuda.get_device_properties(0)
    line |= {"device": p.name, "sms": p.multi_processor_count, "memory_GiB": round(p.total_memory / 2**30, 1),
             "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
except Exception as exc:  # the parts below still run and say what works
    line |= {"status": "fail", "error": repr(exc)[:300]}
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30)
    line["driver"] = smi.stdout.strip() or None
except (OSError, subprocess.SubprocessError):
    line["driver"] = None
print(json.dumps(line))
PYEOF

# --noconftest: the suite's conftest loads fixtures (Postgres, S3) the kernel tests do not need
PYTEST=("$PY" -m pytest -q -m gpu -p no:cacheprovider)
part sgmv_grid pytest 150 "${PYTEST[@]}" --noconftest tests/kernels/test_gpu.py "$@"
part attention_grid pytest 150 "${PYTEST[@]}" --noconftest tests/kernels/test_attention_gpu.py "$@"
part moe_grid pytest 90 "${PYTEST[@]}" --noconftest tests/kernels/test_moe_gpu.py "$@"
part engine_gpu pytest 90 "${PYTEST[@]}" tests/base_engine
part paged_attention json 90 "$PY" benchmarks/paged_attention.py --json --repeats 20
part sgmv_bandwidth json 90 "$PY" benchmarks/sgmv.py --json --backends triton --repeats 5
if [ -f benchmarks/gpu_decode.py ]; then
    part decode_throughput json 120 "$PY" benchmarks/gpu_decode.py --json
else
    echo "benchmarks/gpu_decode.py does not exist yet" >"$LOGS/decode_throughput.log"
    report decode_throughput json 0 0 "$LOGS/decode_throughput.log" absent
fi

"$PY" - "$LOGS/parts.jsonl" $((SECONDS - START)) <<'PYEOF'
import json, sys
parts = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
summary = {"part": "summary", "seconds": int(sys.argv[2]), "parts": {p["part"]: p["status"] for p in parts}}
by_name = {p["part"]: p for p in parts}
sgmv = by_name.get("sgmv_bandwidth", {}).get("result", {}).get("triton", {})
if sgmv:
    summary["sgmv_distinct_bw_fraction_T32"] = sgmv.get("distinct_bw_fraction")
    summary["sgmv_target"] = 0.5
attn = by_name.get("paged_attention", {}).get("result", {})
if attn:
    summary["attention_decode_bw_fraction"] = attn.get("decode_bw_fraction")
    summary["attention_speedup_vs_torch"] = {
        r["case"]: r.get("speedup") for r in attn.get("decode", []) + attn.get("prefill", [])
    }
bad = [n for n, s in summary["parts"].items() if s not in ("pass", "no_tests", "absent")]
summary["status"] = "fail" if bad else "pass"
if bad:
    summary["not_passing"] = bad
print(json.dumps(summary))
sys.exit(1 if bad else 0)
PYEOF
