#!/usr/bin/env bash
# One round of the GPU benchmarks (issue 41 item 5), for one short run on a one-GPU machine, from the
# repository root:
#
#   bash benchmarks/gpu_round.sh
#
# In order, each under `timeout` (a hang cannot eat the rest), the cheap and certain ones first:
#   1. gpu_step_syncs.py --nonfinite clip   host syncs per steady-state step (expected 0)       ~30 s
#   2. bench_local_norm.py                  the local norm against the bandwidth floor           ~40 s
#   3. bench_runs.py --device cuda          run finding, its speed-only parts on and off         ~60 s
#   4. bench_gpu_step.py                    1B Llama, compiled: Lightning + NDParallelStrategy
#                                           against a plain loop, tokens/s and MFU                ~150 s
#   5. gpu_step_syncs.py --nonfinite skip   if time is left (expected 1 per step)                ~30 s
# Results go to benchmarks/results/ (RESULTS_DIR); when $OUT is set, also to $OUT: the log
# (gpu_round.log), every new .md result in one file (summary.md), every new .json in one
# (results.json: {file name: content}), and all new result files, .png included, in results.tar.gz
# (unpack at the repository root: `tar xzf results.tar.gz`).
#
# Environment: PYTHON (default python3), GPU_ROUND_BUDGET (seconds for the whole round, default 400),
# GPU_ROUND_TINY=1 (a dry run on the CPU at tiny sizes, results in /tmp/gpu_round_tiny unless
# RESULTS_DIR is set). The package is used from the source tree (PYTHONPATH); wheels in .whl/, if
# any, are installed first into /tmp/site (see the device README).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET=${GPU_ROUND_BUDGET:-400}
TINY=${GPU_ROUND_TINY:-0}
if [ "$TINY" = 1 ]; then
    RESULTS=${RESULTS_DIR:-/tmp/gpu_round_tiny/results}
else
    RESULTS=${RESULTS_DIR:-benchmarks/results}
fi
mkdir -p "$RESULTS"
LOG=$(mktemp /tmp/gpu_round_log.XXXXXX)
STAMP=$(mktemp /tmp/gpu_round_start.XXXXXX)
exec > >(tee "$LOG") 2>&1

if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

echo "=== gpu_round: $(date -u +%FT%TZ), budget ${BUDGET} s, tiny=${TINY}, results in ${RESULTS}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv 2>/dev/null \
    || echo "(no nvidia-smi)"
$PY - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for name in ("lightning", "transformers", "matplotlib", "numpy"):
    try:
        print(name, __import__(name).__version__)
    except Exception as error:
        print(name, "MISSING:", error)
import lightning_ndclip
print("lightning_ndclip from", lightning_ndclip.__file__)
EOF

left() { echo $((BUDGET - SECONDS)); }
# run NAME CAP_SECONDS COMMAND...: under timeout min(CAP, what is left of the budget less RESERVE)
run() {
    local name=$1 cap=$2 limit
    shift 2
    limit=$(($(left) - ${RESERVE:-0}))
    [ "$limit" -gt "$cap" ] && limit=$cap
    if [ "$limit" -lt 20 ]; then
        echo "=== $name: skipped (${limit} s left of the budget)"
        return
    fi
    echo "=== $name: start at ${SECONDS} s, limit ${limit} s: $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@"
    echo "=== $name: rc=$? after $((SECONDS - t0)) s (at ${SECONDS} s)"
}

# the run finder of 534bb63 to compare with: from git, or a copy carried as an ignored file
RUNS_OLD=()
if ! git rev-parse -q --verify 534bb63 > /dev/null 2>&1; then
    if [ -f benchmarks/results/_runs_at_534bb63.py.tmp ]; then
        RUNS_OLD=(--against-file benchmarks/results/_runs_at_534bb63.py.tmp)
    fi
fi

if [ "$TINY" = 1 ]; then
    RESERVE=0 run syncs_clip 120 $PY benchmarks/gpu_step_syncs.py --nonfinite clip --steps 4 --out "$RESULTS"
    RESERVE=0 run local_norm 120 $PY benchmarks/bench_local_norm.py --params 1e6 --reps 3 --out "$RESULTS"
    RESERVE=0 run runs 120 $PY benchmarks/bench_runs.py --device cpu --sizes 1000 --tensors-per-unit 8 --reps 2 \
        ${RUNS_OLD[@]+"${RUNS_OLD[@]}"} --out "$RESULTS"
    RESERVE=0 run step 300 $PY benchmarks/bench_gpu_step.py --device cpu --layers 2 --hidden 64 --intermediate 128 \
        --heads 4 --kv-heads 2 --vocab 256 --seq 32 --batch 2 --steps 3 --warmup 2 --out "$RESULTS"
    RESERVE=0 run syncs_skip 120 $PY benchmarks/gpu_step_syncs.py --nonfinite skip --steps 4 --out "$RESULTS"
else
    # RESERVE: what later parts need at least, so an early part that hangs cannot starve the 1B step
    RESERVE=250 run syncs_clip 75 $PY benchmarks/gpu_step_syncs.py --nonfinite clip --out "$RESULTS"
    RESERVE=220 run local_norm 90 $PY benchmarks/bench_local_norm.py --params 1e8 1e9 4e9 --reps 20 --out "$RESULTS"
    RESERVE=200 run runs 110 $PY benchmarks/bench_runs.py --device cuda --sizes 1000 10000 30000 --reps 8 \
        ${RUNS_OLD[@]+"${RUNS_OLD[@]}"} --out "$RESULTS"
    RESERVE=0 run step 330 $PY benchmarks/bench_gpu_step.py --steps 30 --warmup 5 --out "$RESULTS"
    RESERVE=0 run syncs_skip 60 $PY benchmarks/gpu_step_syncs.py --nonfinite skip --out "$RESULTS"
fi

echo "=== gpu_round: done at ${SECONDS} s"
NEW=$(find "$RESULTS" -maxdepth 1 -type f -newer "$STAMP" \( -name '*.md' -o -name '*.json' -o -name '*.png' \) | sort)
echo "new result files:"
echo "$NEW"
SUMMARY=$(mktemp /tmp/gpu_round_summary.XXXXXX)
for f in $(echo "$NEW" | grep '\.md$'); do
    printf '\n<!-- %s -->\n' "$(basename "$f")"
    cat "$f"
done > "$SUMMARY"
echo "=== summary"
cat "$SUMMARY"
if [ -n "${OUT:-}" ]; then
    cp "$SUMMARY" "$OUT/summary.md"
    $PY - "$OUT/results.json" $(echo "$NEW" | grep '\.json$') <<'EOF'
import json, os, sys
out = {}
for path in sys.argv[2:]:
    with open(path) as f:
        out[os.path.basename(path)] = json.load(f)
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
EOF
    [ -n "$NEW" ] && tar czf "$OUT/results.tar.gz" $NEW
    sleep 1  # let tee write the last lines
    cp "$LOG" "$OUT/gpu_round.log"
    chmod 644 "$OUT"/* 2> /dev/null
    ls -la "$OUT"
fi
