#!/usr/bin/env bash
# On the GPU machine (no package registry there): install what bench/gpu/prepare.sh put in
# bench/gpu/dist/ without an index, then run one thing and write its results.
#
#   bench/gpu/run.sh env                  # install, then print the machine and package versions
#   bench/gpu/run.sh tests [PYTEST ARGS]  # the CUDA cases of the device-parametrized tests
#   bench/gpu/run.sh suite [PYTEST ARGS]  # the whole test suite (CPU cases; long)
#   bench/gpu/run.sh smoke                # the benchmark end to end on a tiny model, every system
#   bench/gpu/run.sh bench GROUP [ARGS]   # one benchmark group of bench/gpu/compare.py (--list)
#   bench/gpu/run.sh campaign [--dry-run] # everything below in one call of at most 8 minutes
#
# [Note: the one-call campaign] A lent GPU gives 15 minutes of device time in all (start-up, idle
# time and every call counted), so one call (the device tool's timeout_s 540) does the whole
# campaign and a second call can only confirm fixes. `campaign` runs, in this order, each step
# boxed by `timeout` to what it may take and to what is left of CAMPAIGN_BUDGET_S (480 s from the
# start of this script, install included), so a hang costs its own box and not the steps after:
#   1. cuda-tests: the CUDA tests and the CUDA cases of the device-parametrized tests (JUnit);
#   2. train: `tierwise train` under torchrun --nproc-per-node 1 (NCCL), 30 steps, clipping,
#      parameters in host memory, optimizer states on NVMe;
#   3. 4b: GPT2-4B at seq 1024, checkpointing, bf16, 40 GiB: tierwise (auto plan), DeepSpeed
#      ZeRO-3 offload, FSDP2 CPUOffloadPolicy;
#   4. 1.3b (as time allows): plain PyTorch against tierwise on the device, and tierwise with
#      host-resident optimizer states (its stats carry the exposed optimizer time).
# Every step writes one line to campaign.jsonl (rc, seconds, its box). --dry-run rehearses every
# step's CPU path on a machine without a GPU: the CUDA cases skip, train runs on cpu with gloo,
# and the comparisons run their tiny smoke model.
#
# Results (JSON lines, logs, JUnit XML) go to $OUT/results when OUT is set (the device tool's
# folder that comes back), else bench/results/gpu/. Code runs from this checkout's sources
# (packages/*/src first on PYTHONPATH, so a fix made there needs no new prepare.sh); the installed
# wheels supply the entry points that discover the plugins, and everything else missing here.
# TIERWISE_FROM=wheels runs the installed tierwise wheels instead.
# Knobs: PYTHON (python3), GPU_DIST (bench/gpu/dist), GPU_SITE (/tmp/tierwise-gpu-site),
# TIERWISE_SCRATCH (/var/tmp: pytest's temporary files and the NVMe tier need a real disk).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
DIST=${GPU_DIST:-$ROOT/bench/gpu/dist}
SITE=${GPU_SITE:-/tmp/tierwise-gpu-site}
SCRATCH=${TIERWISE_SCRATCH:-/var/tmp}
RESULTS=${OUT:+$OUT/results}
RESULTS=${RESULTS:-$ROOT/bench/results/gpu}
mode=${1:-}
[ $# -gt 0 ] && shift
case $mode in
    env | tests | suite | smoke | bench | campaign) ;;
    *) sed -n '2,18p' "$0" >&2; exit 2 ;;
esac
if [ ! -d "$DIST/wheels" ]; then
    echo "run.sh: $DIST/wheels is missing: run bench/gpu/prepare.sh on the CPU machine and carry bench/gpu/dist" >&2
    exit 2
fi
DIST=$(cd "$DIST" && pwd)
mkdir -p "$RESULTS"

# -- install, without an index ------------------------------------------------------------
started=$(date +%s)
# the same dist already installed (an earlier call on this machine): keep it, so the files keep
# their times and DeepSpeed's JIT-built ops are not rebuilt
if ! cmp -s "$DIST/MANIFEST.txt" "$SITE/.dist-manifest" 2>/dev/null; then
    rm -rf "$SITE" "$SITE.libaio"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --target "$SITE" "$DIST"/wheels/*.whl
    mkdir -p "$SITE.libaio"
    for deb in "$DIST"/debs/*.deb; do
        if command -v dpkg >/dev/null; then
            dpkg -x "$deb" "$SITE.libaio"
        else  # a .deb is an ar archive holding data.tar.*
            unpack=$(mktemp -d)
            (cd "$unpack" && ar x "$deb") && tar -xf "$unpack"/data.tar.* -C "$SITE.libaio"
            rm -rf "$unpack"
        fi
    done
    cp "$DIST/MANIFEST.txt" "$SITE/.dist-manifest"
fi
aio_lib=$SITE.libaio/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$aio_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LIBRARY_PATH=$aio_lib${LIBRARY_PATH:+:$LIBRARY_PATH}   # DeepSpeed's AIO op links -laio
export CPATH=$SITE.libaio/usr/include${CPATH:+:$CPATH}       # and includes libaio.h
sources=""
if [ "${TIERWISE_FROM:-src}" != wheels ]; then
    for package in core profiler search offload-nvme moe-parallel; do
        sources+="$ROOT/packages/$package/src:"
    done
fi
export PYTHONPATH=$sources$SITE${PYTHONPATH:+:$PYTHONPATH}
PATH=$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH  # ninja, pip
export PATH PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$SCRATCH/tierwise-torch-extensions}
export TIERWISE_BENCH_NVME=${TIERWISE_BENCH_NVME:-$SCRATCH/tierwise-bench-nvme}
export TIERWISE_BENCH_OUT=$RESULTS
echo "run.sh: $(ls "$DIST"/wheels | wc -l) wheels and $(ls "$DIST"/debs | wc -l) debs installed in $SITE ($(( $(date +%s) - started )) s; kept when MANIFEST.txt is unchanged)"

# -- what this machine is -----------------------------------------------------------------
"$PYTHON" - <<'PY'
import importlib, os, subprocess
import torch
print(f"python {os.sys.version.split()[0]}; torch {torch.__version__} (cuda {torch.version.cuda}); "
      f"cuda available: {torch.cuda.is_available()}"
      + (f"; {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""))
for name in ("tierwise", "tierwise_nvme", "tierwise_search", "tierwise_profiler", "tierwise_moe",
             "libaio", "deepspeed", "pydantic", "transformers"):
    try:
        module = importlib.import_module(name)
        print(f"  {name:18} {getattr(module, '__version__', '?'):10} {module.__file__}")
    except Exception as err:  # report, do not stop: the mode decides what it needs
        print(f"  {name:18} NOT IMPORTABLE: {type(err).__name__}: {err}")
try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    print("  nvidia-smi:", out.stdout.strip() or out.stderr.strip())
except OSError as err:
    print("  nvidia-smi:", err)
PY
mkdir -p "$SCRATCH/tierwise-pytest"
echo "scratch: $(df -hT "$SCRATCH" | tail -1)"

run_pytest() {  # name, pytest args...
    local name=$1
    shift
    set +e
    timeout "${TIERWISE_TEST_TIMEOUT:-540}" "$PYTHON" -m pytest -q -rs -o faulthandler_timeout=240 \
        --basetemp "$SCRATCH/tierwise-pytest/$name" --junitxml "$RESULTS/$name-junit.xml" "$@" \
        2>&1 | tee "$RESULTS/$name.log"
    local rc=${PIPESTATUS[0]}
    set -e
    "$PYTHON" "$ROOT/bench/gpu/junit_summary.py" "$RESULTS/$name-junit.xml" --name "$name" --rc "$rc" \
        | tee -a "$RESULTS/$name.jsonl"
    return "$rc"
}

# the CUDA tests: tests/cuda and every file with device-parametrized (cuda-marked) cases
cuda_test_files="tests/cuda tests/nvme/test_device_memory.py tests/nvme/test_activation_swap.py"

campaign_step() {  # name, seconds it may take, command...: one line in campaign.jsonl
    local name=$1 want=$2
    shift 2
    local left=$((campaign_end - $(date +%s) - 5))
    local box=$((want < left ? want : left))
    if [ "$box" -lt 15 ]; then
        echo "{\"campaign_step\": \"$name\", \"status\": \"no-time\", \"left_s\": $left, \"dry_run\": $dry_json}" \
            | tee -a "$RESULTS/campaign.jsonl"
        return 0
    fi
    local t0 rc
    t0=$(date +%s)
    set +e
    # bash -c: timeout runs programs, and the steps are exported functions; it signals the whole
    # process group, so a hung pytest or torchrun child goes with it
    timeout -k 10 "$box" bash -c '"$@"' campaign "$@" >"$RESULTS/campaign-$name.log" 2>&1
    rc=$?
    set -e
    tail -n 5 "$RESULTS/campaign-$name.log"
    echo "{\"campaign_step\": \"$name\", \"rc\": $rc, \"timed_out\": $([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo true || echo false), \"seconds\": $(($(date +%s) - t0)), \"box_s\": $box, \"dry_run\": $dry_json}" \
        | tee -a "$RESULTS/campaign.jsonl"
}

campaign_tests() {
    "$PYTHON" -m pytest -q -rs -o faulthandler_timeout=120 --basetemp "$SCRATCH/tierwise-pytest/campaign" \
        --junitxml "$RESULTS/cuda-tests-junit.xml" -m cuda $cuda_test_files
    local rc=$?
    "$PYTHON" "$ROOT/bench/gpu/junit_summary.py" "$RESULTS/cuda-tests-junit.xml" --name cuda-tests --rc "$rc" \
        >>"$RESULTS/cuda-tests.jsonl"
    return "$rc"
}

campaign_train() {  # device: cuda, or cpu for the rehearsal (gloo)
    rm -rf "$SCRATCH/tierwise-campaign-nvme" "$RESULTS/campaign-train"
    mkdir -p "$SCRATCH/tierwise-campaign-nvme"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 -m tierwise.cli train \
        --device "$1" --steps 30 --clip 1.0 --param-placement host --optimizer-placement nvme \
        --nvme-path "$SCRATCH/tierwise-campaign-nvme" --sample-tokens 0 --json --out "$RESULTS/campaign-train"
}

export -f campaign_tests campaign_train
export PYTHON ROOT RESULTS SCRATCH cuda_test_files

case $mode in
    env) ;;
    campaign)
        dry=0
        if [ "${1:-}" = --dry-run ]; then
            dry=1
            shift
        fi
        dry_json=$([ $dry = 1 ] && echo true || echo false)
        campaign_end=$((started + ${CAMPAIGN_BUDGET_S:-480}))
        if [ $dry = 0 ] && ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
            echo "run.sh campaign: torch.cuda.is_available() is False; rehearse with --dry-run" >&2
            exit 1
        fi
        smoke=$([ $dry = 1 ] && echo --smoke || true)
        device=$([ $dry = 1 ] && echo cpu || echo cuda)
        campaign_step cuda-tests 150 campaign_tests
        campaign_step train 120 campaign_train "$device"
        left=$((campaign_end - $(date +%s) - 10))
        campaign_step 4b $((left * 2 / 3)) "$PYTHON" bench/gpu/compare.py --group 4b $smoke --budget-s $((left * 2 / 3 - 15))
        left=$((campaign_end - $(date +%s) - 10))
        campaign_step 1.3b "$left" "$PYTHON" bench/gpu/compare.py --group 1.3b $smoke --budget-s $((left - 15))
        echo "run.sh campaign: $(($(date +%s) - started)) s in all; results in $RESULTS"
        ;;
    tests)
        # a GPU machine whose torch sees no GPU would skip every case: that is a failure there
        if command -v nvidia-smi >/dev/null && ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
            echo "run.sh tests: nvidia-smi is here but torch.cuda.is_available() is False; the CUDA cases would all skip" >&2
            exit 1
        fi
        run_pytest cuda-tests -m cuda $cuda_test_files "$@" ;;
    suite) run_pytest suite tests "$@" ;;
    smoke) "$PYTHON" bench/gpu/compare.py --group smoke --smoke --budget-s 500 "$@" ;;
    bench)
        [ $# -ge 1 ] || { echo "run.sh bench GROUP: see python bench/gpu/compare.py --list" >&2; exit 2; }
        group=$1
        shift
        "$PYTHON" bench/gpu/compare.py --group "$group" "$@"
        ;;
esac
