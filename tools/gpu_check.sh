#!/usr/bin/env bash
# Every CUDA path of unicoll in one call of at most 10 minutes on a lent GPU machine (issue 31).
#
# The GPU machine reaches no package index. array-api-compat (unicoll's one dependency it lacks)
# travels as a wheel, and so does setuptools, which builds unicoll there in an isolated build
# environment: unicoll's metadata (a license expression) needs setuptools 77 or later, whatever
# that machine has. Once, here, where pip reaches the index:
#
#     bash tools/gpu_check.sh --prepare
#
# downloads both into .gpu-wheels/ (ignored by git, so it travels only when carried). Then the one
# call, with the device tool's `run`:
#
#     run(command="bash tools/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=600)
#
# Without a GPU, `bash tools/gpu_check.sh` runs the same steps, and those that need a GPU skip
# with their reason. PYTHON picks the interpreter (default python3); the steps install unicoll
# into it.
#
# A lent session has 15 minutes of device time in all, a machine's start included, so the default
# run is short: the steps that prove what has never run on a GPU first, then the goals, then what
# ran before, and none starts or runs on past GPU_CHECK_SECONDS (default 280) from the start. The
# steps marked "later" below, and any the default run had no time for, are recorded as "not run"
# and named on the summary's last line, as the --only list of a second call:
#
#   --only NAME[,NAME...]  those steps alone (after the install, unless --no-install); default 540 s
#   --all                  every step in the order below; default 540 s
#
# The steps, each under its own time limit in seconds. A step that runs over is stopped (SIGINT,
# as Ctrl-C, so that pytest still writes its report; SIGKILL 10 s later) and recorded as a
# timeout, and the rest still run. Most steps end well within their limits (on an H100 the first
# full run took 320 s, a later one 497 s):
#
#   install-array-api-compat   15  pip install --no-index --no-deps .gpu-wheels/array_api_compat-*.whl
#   install-unicoll            30  pip install --no-index --no-deps --find-links .gpu-wheels -e .
#                                  (without .gpu-wheels: --no-build-isolation, with the setuptools installed)
#   versions                   20  python, torch, CUDA, cupy, NCCL, numpy, mpi4py; the GPU (nvidia-smi)
#   moe-device                 60  pytest -m gpu on the MoE step on the device: the dynamic step under
#                                  set_sync_debug_mode("error") but for its one declared read, the static
#                                  layer with none, and replayed in a CUDA graph with a new routing each time
#   compile-cuda               55  pytest -m gpu tests/compile/test_compile.py (the compiled MoE layer on CUDA)
#   jax-gpu                    60  pytest -m gpu tests/frameworks/test_jax_gpu.py: JAX arrays on the GPU through
#                                  both backends, their gradients, the static MoE operators inside jax.jit
#   overhead-<backend>         40  benchmarks/call_overhead.py on one rank: alltoall_single, global_scatter
#                                  and moe.dispatch+combine beside raw torch.distributed all-to-alls, with
#                                  the MoE step's goals (raw + 60 us at 1 MiB and below, 1.5x at 64 MiB)
#   front-end-cupy             30  benchmarks/cupy_front_end.py: where cupy-nccl's front end spends its time
#                                  with torch tensors (the crossings into cupy and back; cProfile)
#   reorder-torch, -cupy       20  benchmarks/gpu_reorder.py --library torch|cupy (goal: 0.80 of a copy), and
#                                  verification's checksum of the same rows (goal: 0.50 of a copy's bandwidth)
#   gpu-tests                 110  pytest -m gpu in the other files (autograd, streams, device counts,
#                                  cupy's row gather), the example tests left to the example steps
#   conformance-torch-nccl     80  the GPU conformance matrix, world size 1, every stream mode
#   conformance-cupy-nccl      80  the same on cupy-nccl
#   example-moe-<backend>      20  later: examples/moe_dispatch.py --backend <backend> on one rank (both backends)
#   example-train-<backend>    20  later: examples/train_moe.py --backend <backend> on one rank (both backends)
#   bench-<backend>            90  later: unicoll bench -n 1 --iters 10 --warmup 2 on torch-nccl, then
#                                  cupy-nccl (whose raw baseline is torch.distributed's NCCL, started beside it)
#
# GPU_CHECK_LIMIT_FACTOR (a whole number, default 1) multiplies every step's limit and the
# backends' probe limit of 30 s, for a machine slower or busier than the one they were set on.
#
# Goals print as "goal: WHAT: FIGURE (goal TARGET): pass|fail" lines, which the summary collects;
# with both overhead steps it adds one more: cupy-nccl's front end within 20 us of torch-nccl's
# (alltoall_single at 64 KiB, each backend's time over its raw all-to-all).
#
# A step whose backend cannot run here is skipped with the backend's reason (pytest's steps report
# their own skips). Everything lands in $OUT (default: gpu-check-out/, ignored by git), four files,
# since the device tool brings back at most eight:
#
#   summary.json   per step: command, exit code, status, pass/fail/skip counts with skip reasons and
#                  failed tests, seconds, figures (the reorder table, unicoll bench's rows and
#                  overheads, the examples' result lines); the GPU; the versions. Rewritten after
#                  every step, so a call cut short still leaves it.
#   summary.txt    the same as a table, also printed at the end
#   gpu_check.log  every step's output, written as it runs
#   logs.tar.gz    each step's log, pytest's JUnit XML and unicoll bench's JSON
#
# Exit code: 0 when no step failed or ran out of time, else 1.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-python3}
WHEELS=.gpu-wheels
ONLY=""
ALL=0
INSTALL=1
#: The steps a default run leaves for a second call (--only).
LATER=",example-moe-torch-nccl,example-train-torch-nccl,example-moe-cupy-nccl,example-train-cupy-nccl,bench-torch-nccl,bench-cupy-nccl,"

usage() {
    sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
}

prepare() {
    rm -rf "$WHEELS"
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d "$WHEELS" \
        array-api-compat setuptools || exit 1
    echo "tools/gpu_check.sh --prepare: $(ls "$WHEELS" | paste -sd ' ') in $WHEELS/; the device call:"
    echo "    run(command=\"bash tools/gpu_check.sh\", carry=[\"$WHEELS\"], timeout_s=600)"
}

while (($#)); do
    case $1 in
        --prepare) prepare; exit 0 ;;
        --only) ONLY=${2:?--only needs step names}; shift ;;
        --all) ALL=1 ;;
        --no-install) INSTALL=0 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "tools/gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

if [[ -n $ONLY ]] || ((ALL)); then
    TOTAL=${GPU_CHECK_SECONDS:-540}
else
    TOTAL=${GPU_CHECK_SECONDS:-280}
fi
FACTOR=${GPU_CHECK_LIMIT_FACTOR:-1}
if [[ ! $FACTOR =~ ^[1-9][0-9]*$ ]]; then
    echo "tools/gpu_check.sh: GPU_CHECK_LIMIT_FACTOR must be a whole number of 1 or more, got '$FACTOR'" >&2
    exit 2
fi
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT" || exit 1
rm -f "$OUT/summary.json" "$OUT/summary.txt" "$OUT/gpu_check.log" "$OUT/logs.tar.gz"
COMBINED=$OUT/gpu_check.log
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX") || exit 1
DEADLINE=$((SECONDS + TOTAL))
declare -A PROBED=()
WHY_NOT=""
export PYTHONUNBUFFERED=1 LC_ALL=C  # C: EPOCHREALTIME with a decimal point

helper() {
    "$PY" tools/gpu_check.py "$@"
}

declare -A SEEN=()
# Whether step NAME (run under LIMIT_S, as COMMAND) is to run: all of them with --all, those named
# with --only, else all but the LATER ones, which are recorded as not run. Remembers NAME, so that
# the end can name the steps in --only that do not exist.
selected() {
    SEEN[$1]=1
    if [[ -n $ONLY ]]; then
        [[ ",$ONLY," == *",$1,"* ]]
    elif ((ALL)) || [[ $LATER != *",$1,"* ]]; then
        return 0
    else
        helper record "$WORK" "$1" $(($2 * FACTOR)) not-run 0 "" "$3" "not run: left for a second call (--only)"
        helper summary "$WORK" "$OUT" >/dev/null
        return 1
    fi
}

# Sets WHY_NOT to why BACKEND cannot run here, as its probe says (exit code 3); empty where it
# can run, or where the probe itself failed or hung, so that the step runs and shows the error.
# Asked once per backend and logged: PROBED keeps the answers (called as $(...), a subshell,
# it would forget them and probe again for every step, a torch import each time).
probe_backend() {
    local backend=$1 reason
    if [[ ! -v PROBED[$backend] ]]; then
        reason=$(timeout -k 5 $((30 * FACTOR)) "$PY" tools/gpu_check.py probe "$backend" 2>&1)
        (($? == 3)) || reason=""
        PROBED[$backend]=$reason
        echo "=== probe $backend: ${reason:-usable}" | tee -a "$COMBINED"
    fi
    WHY_NOT=${PROBED[$backend]}
}

# step NAME LIMIT_S BACKEND COMMAND: run COMMAND (a bash command line) under LIMIT_S times
# GPU_CHECK_LIMIT_FACTOR, unless BACKEND (empty: none needed) cannot run here or no time is left;
# record and summarize it.
step() {
    local name=$1 limit=$(($2 * FACTOR)) backend=$3 command=$4 left=$((DEADLINE - SECONDS)) reason started elapsed rc
    if ((left < 5)); then
        helper record "$WORK" "$name" "$limit" not-run 0 "" "$command" "not run: the run's ${TOTAL} s were spent"
    elif [[ -n $backend ]] && probe_backend "$backend" && [[ -n $WHY_NOT ]]; then
        reason=$WHY_NOT
        echo "=== $name: skipped: $reason" | tee -a "$COMBINED"
        helper record "$WORK" "$name" "$limit" skip 0 "" "$command" "$reason"
    else
        ((limit > left)) && limit=$left
        echo "=== $name (limit ${limit} s): $command" | tee -a "$COMBINED"
        started=${EPOCHREALTIME/./}
        timeout -s INT -k 10 "$limit" bash -c "$command" 2>&1 | tee "$WORK/$name.log" >>"$COMBINED"
        rc=${PIPESTATUS[0]}
        elapsed=$((${EPOCHREALTIME/./} - started))
        elapsed=$((elapsed / 1000000)).$(printf %06d $((elapsed % 1000000)))
        helper record "$WORK" "$name" "$limit" "$rc" "$elapsed" "$name.log" "$command"
        echo "=== $name: exit code $rc" | tee -a "$COMBINED"
    fi
    helper summary "$WORK" "$OUT" >/dev/null
    return 0
}

# pytest_step NAME LIMIT_S ARGS...: pytest ARGS with its JUnit XML where the summary reads it.
pytest_step() {
    local name=$1 limit=$2
    shift 2
    local command="$PY -m pytest -p no:cacheprovider $* --junitxml=$WORK/$name.xml"
    selected "$name" "$limit" "$command" && step "$name" "$limit" "" "$command"
}

if ((INSTALL)); then
    if compgen -G "$WHEELS/array_api_compat-*.whl" >/dev/null; then
        step install-array-api-compat 15 "" "$PY -m pip install --no-index --no-deps $WHEELS/array_api_compat-*.whl"
    else
        echo "no wheels in $WHEELS/ (tools/gpu_check.sh --prepare makes them): array-api-compat must be installed"
        step install-array-api-compat 15 "" "$PY -c 'import array_api_compat as m; print(m.__version__)'"
    fi
    if compgen -G "$WHEELS/setuptools-*.whl" >/dev/null; then
        build="--find-links $WHEELS"  # an isolated build with the carried setuptools
    else
        build="--no-build-isolation"  # with the setuptools installed
    fi
    step install-unicoll 30 "" "$PY -m pip install --no-index --no-deps $build -e ."
fi
command="$PY tools/gpu_check.py versions $WORK/versions.json"
selected versions 20 "$command" && step versions 20 "" "$command"

# backend_step NAME LIMIT_S BACKEND COMMAND: COMMAND as step NAME, skipped where BACKEND cannot run.
backend_step() {
    selected "$1" "$2" "$4" && step "$@"
}

pytest_step moe-device 60 -m gpu tests/frontend/test_moe_device.py tests/compile/test_static_moe.py
pytest_step compile-cuda 55 -m gpu tests/compile/test_compile.py
pytest_step jax-gpu 60 -m gpu tests/frameworks/test_jax_gpu.py
for backend in torch-nccl cupy-nccl; do
    backend_step "overhead-$backend" 40 "$backend" "$PY -m unicoll run -n 1 benchmarks/call_overhead.py --backend $backend"
done
backend_step front-end-cupy 30 cupy-nccl "$PY -m unicoll run -n 1 benchmarks/cupy_front_end.py"
for library in torch cupy; do
    backend_step "reorder-$library" 20 "$library-nccl" "$PY benchmarks/gpu_reorder.py --library $library"
done
pytest_step gpu-tests 110 -m gpu tests --ignore=tests/system/test_conformance_gpu.py --ignore=tests/compile/test_compile.py \
    --ignore=tests/frameworks/test_jax_gpu.py --ignore=tests/frontend/test_moe_device.py \
    --ignore=tests/compile/test_static_moe.py --continue-on-collection-errors \
    -k "'not test_moe_example_on_the_gpu and not test_training_example_on_the_gpu'"
for backend in torch-nccl cupy-nccl; do
    pytest_step "conformance-$backend" 80 -m gpu tests/system/test_conformance_gpu.py -k "$backend"
done
for backend in torch-nccl cupy-nccl; do
    for example in moe:moe_dispatch train:train_moe; do
        backend_step "example-${example%%:*}-$backend" 20 "$backend" \
            "$PY -m unicoll run -n 1 examples/${example#*:}.py --backend $backend"
    done
done
for backend in torch-nccl cupy-nccl; do
    backend_step "bench-$backend" 90 "$backend" \
        "$PY -m unicoll bench -n 1 --backend $backend --iters 10 --warmup 2 --json $WORK/bench-$backend.json"
done

echo
helper summary "$WORK" "$OUT"
verdict=$?
for name in ${ONLY//,/ }; do
    [[ -v SEEN[$name] ]] || { echo "tools/gpu_check.sh: --only names no step $name (see --help)" >&2; verdict=2; }
done
tar -czf "$OUT/logs.tar.gz" -C "$WORK" . && rm -rf "$WORK"
echo "tools/gpu_check.sh: summary.json, summary.txt, gpu_check.log and logs.tar.gz in $OUT"
exit "$verdict"
