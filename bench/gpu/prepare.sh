#!/usr/bin/env bash
# Build everything the GPU machine lacks into bench/gpu/dist/ (git-ignored; it travels to the
# GPU machine as a `carry` path of the device tool, see bench/gpu/README.md). Runs here, on the
# CPU machine, which reaches the package registries; the GPU machine reaches none.
#
#   bench/gpu/prepare.sh                     # for the GPU machine: CPython 3.12, x86_64 manylinux
#   PY_VERSION=3.11 DIST=/tmp/dist311 bench/gpu/prepare.sh   # a local copy for this machine's Python
#
# dist/wheels/  the five tierwise packages; python-libaio; DeepSpeed built as a pure wheel
#               (DS_BUILD_OPS=0: its ops JIT-build on the GPU machine with ninja) and its
#               dependencies that machine lacks (hjson, pydantic, pydantic-core,
#               annotated-types, typing-inspection, and the typing-extensions pydantic needs)
# dist/debs/    Debian's libaio1 and libaio-dev (unpacked there with dpkg -x: libaio.so.1 for
#               tierwise-nvme, the header and link name for DeepSpeed's AIO op)
# dist/MANIFEST.txt  what is in it, with sizes and sha256 sums
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIST=${DIST:-$ROOT/bench/gpu/dist}
PY_VERSION=${PY_VERSION:-3.12}
PYTHON=${PYTHON:-python3}
# Versions pinned so a later prepare.sh ships the same bits; keep one version of each.
DEEPSPEED=deepspeed==0.19.8
LIBAIO_PY=libaio==0.9.5
PURE_DEPS=(hjson==3.1.0 pydantic==2.14.3 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)
BINARY_DEPS=(pydantic-core==2.50.4)
DEBS=(libaio1 libaio-dev)
PACKAGES=(core profiler search offload-nvme moe-parallel)

# the wheels build without isolation (DeepSpeed's setup imports torch): say what is missing, once
if ! "$PYTHON" -c "import hatchling, setuptools, wheel, torch" 2>/dev/null; then
    echo "prepare.sh builds with $PYTHON, which needs hatchling, setuptools, wheel and torch:" \
        "$PYTHON -m pip install hatchling setuptools wheel (torch: --constraint constraints/ci.txt torch)" >&2
    exit 1
fi

tag=${PY_VERSION/./}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$DIST"
mkdir -p "$DIST/wheels" "$DIST/debs"
pip=("$PYTHON" -m pip)

echo "== tierwise packages"
for package in "${PACKAGES[@]}"; do
    "${pip[@]}" wheel -q --no-deps --no-build-isolation -w "$DIST/wheels" "$ROOT/packages/$package"
done

echo "== dependencies for CPython $PY_VERSION (manylinux x86_64)"
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp --abi "cp$tag" --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIST/wheels" "${PURE_DEPS[@]}" "${BINARY_DEPS[@]}"

echo "== python-libaio (published as an sdist: built into a pure wheel)"
"${pip[@]}" wheel -q --no-deps --no-binary :all: -w "$DIST/wheels" "$LIBAIO_PY"

echo "== DeepSpeed: pure wheel from its sdist, no ops compiled (they JIT-build on the GPU)"
"${pip[@]}" download -q --no-deps --no-binary :all: --no-build-isolation -d "$work" "$DEEPSPEED"
# DS_ACCELERATOR=cuda: the wheel lists the CUDA op builders (a CPU-only build machine would
# otherwise record the cpu accelerator's op set); the build needs torch importable here
DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "${pip[@]}" wheel -q --no-deps --no-build-isolation \
    -w "$DIST/wheels" "$work"/deepspeed-*.tar.gz

echo "== Debian packages: ${DEBS[*]}"
(cd "$DIST/debs" && apt-get download "${DEBS[@]}")

for wheel in "$DIST"/wheels/*.whl; do
    case $(basename "$wheel") in
        *-none-any.whl | *-cp$tag-*.whl) ;;
        *) echo "prepare.sh: $(basename "$wheel") is neither pure nor for cp$tag" >&2; exit 1 ;;
    esac
done
# every requirement of a shipped wheel is shipped too or already on the GPU machine (its package
# list: /work/.library/device/KINDS.md, "Python packages already there")
GPU_HAS="torch numpy packaging psutil py-cpuinfo einops msgpack ninja tqdm nvidia-ml-py pluggy
transformers matplotlib typing-extensions" "$PYTHON" - "$DIST/wheels" <<'PY'
import os, re, sys, zipfile
from pathlib import Path

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
wheels = sorted(Path(sys.argv[1]).glob("*.whl"))
shipped, needs = set(), {}
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    shipped.add(norm(re.search(r"^Name: (.+)$", meta, re.M).group(1).strip()))
    for req in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        if "extra ==" not in req:
            needs.setdefault(norm(re.match(r"[A-Za-z0-9_.-]+", req).group(0)), []).append(wheel.name)
missing = {n: w for n, w in needs.items() if n not in shipped and n not in set(os.environ["GPU_HAS"].split())}
if missing:
    sys.exit(f"prepare.sh: neither shipped nor on the GPU machine: {missing}")
print(f"requirements: all {len(needs)} met by the {len(wheels)} wheels or the GPU machine's packages")
PY
(cd "$DIST" && {
    echo "# built $(date -u +%FT%TZ) for CPython $PY_VERSION by bench/gpu/prepare.sh at $(git -C "$ROOT" rev-parse --short HEAD)"
    find wheels debs -type f | sort | while read -r f; do
        printf '%s  %s  %s\n' "$(sha256sum "$f" | cut -c1-16)" "$(du -k "$f" | cut -f1)K" "$f"
    done
} > MANIFEST.txt)
cat "$DIST/MANIFEST.txt"
echo "== $(du -sh "$DIST" | cut -f1) in $DIST (the device tool carries at most 64 MiB with the working tree)"
