#!/usr/bin/env bash
# GPU check: a mixed CUDA + CPU pipeline, in one process and over MPI, on a machine with one
# NVIDIA GPU. Writes everything it prints to $OUT/gpu_check.log (default out/gpu_check/).
#
#   bash benchmarks/gpu_check.sh
#
# 1. the GPU and JAX: nvidia-smi, jax.devices(), the platforms h2jax finds installed;
# 2. examples/mixed_gpu_cpu.py: one process, stage 0 on the GPU, stage 1 on the host CPU,
#    checked against the unpipelined f32 reference (PASSED/FAILED);
# 3. benchmarks/gpu_check_mpi.py under `mpiexec -n 2`: rank 0 on the GPU, rank 1 on the CPU,
#    through the MPI transport (path auto: direct with a CUDA-aware MPI, else staged), checked
#    against the same reference; then `h2jax run` on the same plan under mpiexec, if time allows.
#
# Runs from the repository root with PYTHONPATH=. (the package need not be installed). Where
# no mpiexec is on PATH, an MPICH wheel under .whl/ (git-ignored) is installed into a scratch
# prefix first; .whl/fallback/ may hold an mpi4py wheel, used only if the installed mpi4py
# cannot load MPI. An Open MPI mpiexec run as root (as on the lent H200 machines, whose image
# has Debian's Open MPI 4.1.6 and an mpi4py built on it) is allowed through
# OMPI_ALLOW_RUN_AS_ROOT; the launcher set-ups are tried in turn with a two-rank hello.
# Without a GPU the GPU parts print SKIPPED; GPU_CHECK_CPU_SMOKE=1 then runs the MPI part with
# both ranks on the CPU (stage 0 on chip cpu-bf16).
# Every part has its own time limit; the whole script stays under about 7 minutes.

set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SITE=${GPU_CHECK_SITE:-/tmp/h2jax-gpu-check-site}
STEPS=${GPU_CHECK_STEPS:-20}
PY=${PYTHON:-python3}

section() { echo; echo "=== [t+${SECONDS}s] $*"; }

body() {
    local status=0 have_gpu=0 gpu_chip=nvidia-h100
    section "machine"
    date -u; uname -m; "$PY" --version
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi -L
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    else
        echo "nvidia-smi: not found"
    fi

    section "jax"
    timeout -k 5 30 "$PY" -c 'from h2jax.backends import installed_platforms, plugin_modules
print("plugin modules:", plugin_modules()); print("h2jax platforms:", installed_platforms())'
    # jax.devices() as asked; then whether the "cuda" platform has devices (exit code 0)
    timeout -k 5 90 "$PY" -c 'import jax, sys; print(jax.__version__, jax.devices())
try:
    sys.exit(0 if jax.devices("cuda") else 1)
except RuntimeError as e:
    print("jax.devices(\"cuda\"):", e); sys.exit(1)' && have_gpu=1
    echo "CUDA GPU usable by JAX: $([ $have_gpu = 1 ] && echo yes || echo no)"

    section "one process: examples/mixed_gpu_cpu.py --steps $STEPS (stage 0 cuda, stage 1 cpu)"
    local t0=$SECONDS
    timeout -k 5 150 "$PY" examples/mixed_gpu_cpu.py --steps "$STEPS"
    local rc=$?
    echo "exit code $rc after $((SECONDS - t0)) s"
    [ $rc = 0 ] || status=1

    section "MPI: launcher and mpi4py"
    if [ $have_gpu = 0 ]; then
        if [ "${GPU_CHECK_CPU_SMOKE:-0}" = 1 ]; then
            gpu_chip=cpu-bf16
            echo "no GPU: GPU_CHECK_CPU_SMOKE=1, so the MPI part runs with stage 0 on chip $gpu_chip (CPU)"
        else
            echo "SKIPPED: no CUDA GPU (set GPU_CHECK_CPU_SMOKE=1 to run the MPI flow on the CPU)"
            return $status
        fi
    fi
    if ! command -v mpiexec >/dev/null; then
        if ls .whl/mpich-*.whl >/dev/null 2>&1; then
            echo "no mpiexec on PATH: installing $(ls .whl/mpich-*.whl) into $SITE"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$SITE" .whl/mpich-*.whl || { echo "FAILED: pip install of the MPICH wheel"; return 1; }
            export PATH=$SITE/bin:$PATH LD_LIBRARY_PATH=$SITE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        else
            echo "SKIPPED: no mpiexec on PATH and no MPICH wheel under .whl/"
            return $status
        fi
    fi
    echo "mpiexec: $(command -v mpiexec)"
    echo "other MPI installs: $(ls -d /opt/hpcx* /usr/local/mpi* /opt/*mpi* /usr/lib/x86_64-linux-gnu/openmpi 2>/dev/null | tr '\n' ' ')"
    local mpi_probe='import mpi4py; from mpi4py import MPI; print("mpi4py", mpi4py.__version__, "|", MPI.Get_library_version().splitlines()[0])'
    if ! timeout -k 5 30 "$PY" -c "$mpi_probe"; then
        if ls .whl/fallback/mpi4py-*.whl >/dev/null 2>&1; then
            echo "the installed mpi4py cannot load MPI: installing $(ls .whl/fallback/mpi4py-*.whl) into $SITE"
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$SITE" .whl/fallback/mpi4py-*.whl || { echo "FAILED: pip install of mpi4py"; return 1; }
            export PYTHONPATH=$PYTHONPATH:$SITE
            timeout -k 5 30 "$PY" -c "$mpi_probe" || { echo "FAILED: mpi4py still cannot load MPI"; return 1; }
        else
            echo "FAILED: mpi4py cannot load MPI and no fallback wheel under .whl/fallback/"
            return 1
        fi
    fi

    # The first launcher set-up under which two ranks meet.
    local hello='from mpi4py import MPI; c = MPI.COMM_WORLD; v = c.allreduce(c.rank + 1); print(f"rank {c.rank}/{c.size} ok, sum {v}")'
    local -a launch=()
    local found=0
    local try
    local root_ok="OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"  # Open MPI refuses root otherwise
    for try in "" "|$root_ok" "|$root_ok OMPI_MCA_btl_vader_single_copy_mechanism=none" "-launcher fork" "-launcher fork|FI_PROVIDER=tcp MPIR_CVAR_CH4_NETMOD=ofi" "-launcher fork|MPIR_CVAR_CH4_NETMOD=ucx UCX_TLS=self,sm,tcp"; do
        local opts=${try%%|*} envs=""
        [ "$try" != "${try#*|}" ] && envs=${try#*|}
        echo "trying: ${envs:+env $envs }mpiexec ${opts:+$opts }-n 2"
        # shellcheck disable=SC2086
        if timeout -k 5 20 env $envs mpiexec $opts -n 2 "$PY" -c "$hello"; then
            launch=(env $envs mpiexec $opts -n 2)
            found=1
            break
        fi
    done
    if [ $found = 0 ]; then
        echo "FAILED: no launcher set-up let two MPI ranks meet"
        return 1
    fi
    echo "launch with: ${launch[*]}"

    section "MPI: benchmarks/gpu_check_mpi.py --steps $STEPS --gpu-chip $gpu_chip (rank 0 stage 0, rank 1 stage 1 on cpu)"
    t0=$SECONDS
    local limit=$((430 - SECONDS))  # the whole script stays near 7 minutes
    [ $limit -gt 170 ] && limit=170
    [ $limit -lt 30 ] && limit=30
    timeout -k 5 $limit "${launch[@]}" "$PY" benchmarks/gpu_check_mpi.py --steps "$STEPS" --gpu-chip "$gpu_chip" --path "${H2JAX_MPI_PATH:-auto}"
    rc=$?
    echo "exit code $rc after $((SECONDS - t0)) s (limit $limit s)"
    [ $rc = 0 ] || status=1

    if [ $SECONDS -lt 300 ]; then
        section "MPI: h2jax run (the CLI) on the same plan, 5 steps"
        local plan=/tmp/h2jax-gpu-check-plan.json
        "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from gpu_check_mpi import mixed_plan
from h2jax.plan import save_plan; save_plan(mixed_plan('$gpu_chip'), '$plan')"
        cat "$plan"; echo
        t0=$SECONDS
        timeout -k 5 100 "${launch[@]}" "$PY" -m h2jax run --plan "$plan" --steps 5 --json
        rc=$?
        echo "exit code $rc after $((SECONDS - t0)) s"
        [ $rc = 0 ] || status=1
    else
        section "MPI: h2jax run skipped (${SECONDS} s used; keeping under the time limit)"
    fi

    if [ $SECONDS -lt 340 ] && "$PY" -c 'import pytest' 2>/dev/null; then
        section "pytest tests/test_backends.py (platform resolution where a CUDA plugin is installed)"
        timeout -k 5 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_backends.py || status=1
    fi
    return $status
}

set -o pipefail
body 2>&1 | tee -a "$LOG"
status=$?
echo "=== gpu_check.sh done in ${SECONDS} s, status $status" | tee -a "$LOG"
exit $status
