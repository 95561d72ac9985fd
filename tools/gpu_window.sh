#!/usr/bin/env bash
# The GPU window in one command: what a short turn on a CUDA machine runs.
#
#   tools/gpu_window.sh prepare                # on a CPU machine with a package index, beforehand
#   tools/gpu_window.sh                        # on the CUDA machine (torch preinstalled, no index)
#   tools/gpu_window.sh --device cpu --small   # the same steps on CPU, end to end
#   ... --no-backend                           # without the torch.compile backend's step
#
# `prepare` fills .gpu_window/ (git-ignored; carry it with the working tree):
#   wheels/  msgspec (the runtime's one dependency besides torch), lark, and
#            pytest with its dependencies, for CPython 3.10-3.12 on x86-64
#            Linux, pinned to this checkout's environment
#   optimizer/  cvxpy, HiGHS and the solvers cvxpy imports at start, for the
#            torch.compile backend, which plans on the machine it compiles
#            on (the same pins; not SCS, whose 40 MB cvxpy loads only when
#            asked for SCS)
#   plans/   plans for CUDA, traced and optimized here on CPU
#            (tools/gpu_check.py --compile-only --device cuda): GPT-2 medium
#            4 x 512 at 0.7 / 0.5 / 0.3 and the floor, gpt2-tiny at 0.5 and
#            the floor (read by tests/test_cuda.py through REMAT_CUDA_PLANS);
#            and offload plans (--offload-budgets: offload=True, exact) below
#            the recompute-only floor, at 0.9x of it: traced for CUDA (no
#            chunked loss there, its ops being CPU-only) with `--budget floor`
#            and no offload, GPT-2 medium 4 x 512's floor is 0.174 of the
#            unoptimized activation peak (1361.9 MiB), so 0.157; gpt2-tiny's
#            0.425 (1.81 MiB), so 0.38.  Offload alone reaches both (its floor:
#            0.151 and 0.351); no graph rewrite.  No Llama-class model:
#            gpu_check takes built-in names and model files only.
#
# The run (the steps after the installs each under a time limit, 13 minutes
# in all; 162-228 s on an H200) installs from wheels/ whatever of msgspec,
# lark and pytest is not importable and, where cvxpy is not, the optimizer's
# wheels (pip --no-index; nothing is fetched; numpy and scipy must be there),
# then writes under $OUT (default out/gpu_window):
#   pytest.txt                      tests/test_cuda.py
#   probe.md, probe.json            tools/gpu_probe.py: eager reproducibility, dropout replay,
#                                   fused vs unfused cross-entropy bits, SDPA kernel
#   gpu_check.md, gpu_check.json    tools/gpu_check.py on GPT-2 medium 4 x 512 (--small: gpt2-tiny)
#   backend.md                      tools/backend_memory.py --device cuda: the torch.compile
#                                   backend (aot_eager, inductor) on gpt2-mid, predicted and
#                                   measured by the caching allocator, gradients against eager
#   summary.txt                     each step's exit code and seconds
#   gpu_check's offload rows: the plans above with a torch save_on_cpu row,
#                                   host peak measured and predicted, step time vs checkpointing
#                                   every block and vs the recompute-only floor plan ($OFFLOAD_BUDGETS
#                                   overrides the budgets; on CPU, --small: 0.27, as the CPU plans may
#                                   chunk the loss, whose floor is lower)
# Arguments other than --device, --small, --plans and --no-backend go to gpu_check.py.
# Exit code: 0 when every step exited 0, 1 when one did not, 2 without a Python that has torch.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# The interpreter with torch: $PYTHON, else the first python3 / python that imports it.
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for c in python3 python; do
        if command -v "$c" > /dev/null && "$c" -c "import torch" 2> /dev/null; then PY="$(command -v "$c")"; break; fi
    done
fi
if [ -z "$PY" ]; then
    echo "gpu_window: error: no python3 or python here imports torch; set PYTHON=/path/to/python" >&2
    exit 2
fi
WINDOW="$ROOT/.gpu_window"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ "${1:-}" = "prepare" ]; then
    set -e
    mkdir -p "$WINDOW/wheels" "$WINDOW/plans"
    pins=$("$PY" - <<'EOF'
from importlib.metadata import version
print(" ".join(f"{p}=={version(p)}" for p in ("msgspec", "lark", "pytest")))
EOF
)
    for v in 3.10 3.11 3.12; do
        "$PY" -m pip download -q --only-binary=:all: --python-version "$v" --implementation cp \
            --platform manylinux2014_x86_64 -d "$WINDOW/wheels" $pins
    done
    # pip reads dependency markers with this interpreter's version: add what 3.10 needs.
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.10 --implementation cp \
        --platform manylinux2014_x86_64 -d "$WINDOW/wheels" exceptiongroup tomli typing_extensions
    opt=$("$PY" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version
pins = []
for p in ("cvxpy", "highspy", "osqp", "clarabel", "qdldl", "cffi", "pycparser"):
    try:
        pins.append(f"{p}=={version(p)}")
    except PackageNotFoundError:  # not a dependency of this cvxpy
        pass
print(" ".join(pins))
EOF
)
    mkdir -p "$WINDOW/optimizer"
    for v in 3.10 3.11 3.12; do
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
            -d "$WINDOW/optimizer" $opt || echo "gpu_window: no optimizer wheels for CPython $v (the backend's step is skipped there)" >&2
    done
    "$PY" tools/gpu_check.py --compile-only --device cuda --offload-budgets 0.157 --plans "$WINDOW/plans"
    "$PY" tools/gpu_check.py --compile-only --device cuda --small --budgets 0.5,floor --offload-budgets 0.38 \
        --plans "$WINDOW/plans"
    ls -l "$WINDOW/wheels" "$WINDOW/plans"
    exit 0
fi

DEVICE=cuda
NO_BACKEND=0
SMALL=()
PLANS="$WINDOW/plans"
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --small) SMALL=(--small); shift ;;
        --plans) PLANS="$2"; shift 2 ;;
        --no-backend) NO_BACKEND=1; shift ;;
        *) EXTRA+=("$1"); shift ;;
    esac
done
# Offload budgets (the header): the ones `prepare` planned for CUDA; CPU plans are made on the spot.
if [ -z "${OFFLOAD_BUDGETS:-}" ]; then
    if [ ${#SMALL[@]} -eq 0 ]; then OFFLOAD_BUDGETS=0.157
    elif [ "$DEVICE" = cuda ]; then OFFLOAD_BUDGETS=0.38
    else OFFLOAD_BUDGETS=0.27
    fi
fi
OUT="${OUT:-$ROOT/out/gpu_window}"
mkdir -p "$OUT" "$PLANS"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
status=0
T0=$SECONDS

step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, record exit code and seconds
    local name="$1" limit="$2" t=$SECONDS rc
    shift 2
    echo "== $name" >&2
    if declare -F "$1" > /dev/null; then
        "$@"  # a function of this script: quick, and timeout cannot run it
    else
        timeout --kill-after=10 "$limit" "$@"
    fi
    rc=$?
    echo "$name: exit $rc, $((SECONDS - t)) s" | tee -a "$SUMMARY" >&2
    [ "$rc" -eq 0 ] || status=1
}

install_missing() {
    local missing=()
    for m in msgspec lark pytest; do
        "$PY" -c "import $m" 2>/dev/null || missing+=("$m")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        echo "msgspec, lark, pytest: already installed"
        return 0
    fi
    "$PY" -m pip install --no-index --find-links "$WINDOW/wheels" "${missing[@]}"
}

install_optimizer() {  # the backend plans where it compiles: cvxpy without its dependency resolution
    "$PY" -c "import cvxpy" 2>/dev/null && { echo "cvxpy: already installed"; return 0; }
    local tag wheels
    tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    wheels=$(compgen -G "$WINDOW/optimizer/*-$tag-*.whl"; compgen -G "$WINDOW/optimizer/*-abi3-*.whl"; \
             compgen -G "$WINDOW/optimizer/*-py3-none-any.whl")
    if ! compgen -G "$WINDOW/optimizer/cvxpy-*-$tag-*.whl" > /dev/null; then
        echo "no optimizer wheels for $tag in $WINDOW/optimizer: the backend's step is skipped"
        return 0
    fi
    # shellcheck disable=SC2086  # one wheel a word
    "$PY" -m pip install --no-index --no-deps $wheels && "$PY" -c "import cvxpy"
}

{
    echo "python $("$PY" -c 'import sys; print(sys.version.split()[0])'), $(uname -m)"
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
} >> "$SUMMARY" 2>&1

step install 120 install_missing > "$OUT/install.log" 2>&1
step install_optimizer 120 install_optimizer >> "$OUT/install.log" 2>&1
REMAT_CUDA_PLANS="$PLANS" step pytest 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    > "$OUT/pytest.txt" 2>&1
step probe 90 "$PY" tools/gpu_probe.py --device "$DEVICE" ${SMALL[@]+"${SMALL[@]}"} --md "$OUT/probe.md" \
    --json "$OUT/probe.json" > /dev/null 2> "$OUT/probe.log"
step gpu_check 300 "$PY" tools/gpu_check.py --device "$DEVICE" ${SMALL[@]+"${SMALL[@]}"} --plans "$PLANS" \
    --md "$OUT/gpu_check.md" --json "$OUT/gpu_check.json" --offload-budgets "$OFFLOAD_BUDGETS" ${EXTRA[@]+"${EXTRA[@]}"} > /dev/null 2> "$OUT/gpu_check.log"
# $BACKEND_MODEL: another model for the backend's step (a family such as llama)
[ ${#SMALL[@]} -eq 0 ] && BACKEND_MODEL="${BACKEND_MODEL:-gpt2-mid}" || BACKEND_MODEL="${BACKEND_MODEL:-examples/gpt_narrow.py}"
if [ "$NO_BACKEND" = 1 ]; then
    echo "backend: skipped (--no-backend)" | tee -a "$SUMMARY" >&2
elif "$PY" -c "import cvxpy" 2> /dev/null; then
    step backend "${BACKEND_LIMIT_S:-240}" "$PY" tools/backend_memory.py --device "$DEVICE" --model "$BACKEND_MODEL" \
        --threads 8 --md "$OUT/backend.md" > /dev/null 2> "$OUT/backend.log"
else
    echo "backend: skipped (no cvxpy: the backend plans where it compiles)" | tee -a "$SUMMARY" >&2
fi
echo "total: $((SECONDS - T0)) s" | tee -a "$SUMMARY" >&2
exit $status
