#!/usr/bin/env bash
# On the GPU machine (no package registry there): install what bench/gpu/prepare.sh put in
# bench/gpu/dist/ without an index, then run one thing and write its results.
#
#   bench/gpu/run.sh env                  # install, then print the machine and package versions
#   bench/gpu/run.sh tests [PYTEST ARGS]  # the CUDA cases of the device-parametrized tests
#   bench/gpu/run.sh suite [PYTEST ARGS]  # the whole test suite (CPU cases; long)
#   bench/gpu/run.sh smoke                # the benchmark end to end on a tiny model, every system
#   bench/gpu/run.sh bench GROUP [ARGS]   # one benchmark group of bench/gpu/compare.py (--list)
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
    env | tests | suite | smoke | bench) ;;
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

case $mode in
    env) ;;
    tests)
        # a GPU machine whose torch sees no GPU would skip every case: that is a failure there
        if command -v nvidia-smi >/dev/null && ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
            echo "run.sh tests: nvidia-smi is here but torch.cuda.is_available() is False; the CUDA cases would all skip" >&2
            exit 1
        fi
        run_pytest cuda-tests -m cuda tests/cuda tests/nvme/test_device_memory.py "$@" ;;
    suite) run_pytest suite tests "$@" ;;
    smoke) "$PYTHON" bench/gpu/compare.py --group smoke --smoke --budget-s 500 "$@" ;;
    bench)
        [ $# -ge 1 ] || { echo "run.sh bench GROUP: see python bench/gpu/compare.py --list" >&2; exit 2; }
        group=$1
        shift
        "$PYTHON" bench/gpu/compare.py --group "$group" "$@"
        ;;
esac
