#!/usr/bin/env bash
# The GPU checks (issue 27, docs/GPU.md) in one run on a CUDA machine, each step under its own time
# limit so that one hang cannot eat the rest; logs go to $OUT (default out/gpu_checks).
#
#   scripts/gpu_checks.sh                       # suite, triton, flexgen (every case)
#   STEPS="suite" scripts/gpu_checks.sh         # some steps only
#   PYTEST_ARGS="tests/offload -k cuda" STEPS=suite scripts/gpu_checks.sh
#   FLEXGEN_CASES="opt-6.7b" STEPS=flexgen scripts/gpu_checks.sh
#   STEPS=profile scripts/gpu_checks.sh         # where an all-on-GPU pass's time goes
#   STEPS=stress scripts/gpu_checks.sh          # the stream-ordering tests under load
#   STEPS=launches scripts/gpu_checks.sh        # kernels and host time per decode layer-step
#
# suite:   the whole test suite on this machine: the engine's default device is CUDA here, so every
#          test that builds an engine without naming a device computes on the GPU; the `gpu`-marked
#          tests run too. pytest-xdist spreads it over the cores when installed.
# triton:  scripts/bench_triton_gpu.py (the kernel against dequantize + matmul, 70B / 30B shapes).
# flexgen: scripts/bench_flexgen_gpu.py (ours against FlexGen itself under T4 caps), with the planner's
#          predicted tok/s beside each of ours; FLEXGEN_PROFILE=1 plans with this GPU's profile (measured
#          first) instead of the t4 preset's rates; FLEXGEN_SCHEDULERS="decode-maximal" runs FlexGen's
#          policies with that scheduler only; FLEXGEN_SKIP="CASE ..." runs ours alone for those cases
#          (FlexGen's figure from an earlier lease on this GPU: docs/BENCHMARKS.md); no run starts after FLEXGEN_DEADLINE s (570), each
#          line (with its wall seconds) is in flexgen.log as it ends.
# stress:  the CUDA tests that a stream-ordering race fails (test_cuda.py: no_host_sync, held_back,
#          closed_or_dropped) in STRESS_PROCS (12) processes at once, twice: one GPU and the cores
#          shared, as a suite under xdist shares them (a race seen there once failed 9 of 25 such runs).
# launches: scripts/count_launches.py on CUDA: launches (dispatch count and the CUDA profiler's) and host
#          time per decode layer-step beside a plain PyTorch layer, eager and with CUDA graphs; a tiny
#          OPT and an OPT-6.7B-shaped one (hidden 4096, 32 heads, prompt 512).
# profile: scripts/profile_passes.py (host time per layer-step of an all-on-GPU batch, cProfile and
#          torch.profiler tables, kernels by GPU time), block then decode-maximal; PROFILE_ARGS adds its
#          flags (e.g. "--compress --batch 72 --prompt-len 512 --gen-len 8": FlexGen's 4-bit policy).
# scripts/gpu_prepare.sh lays .whl and .shared_copy for WHEELS and SHARED (run it here, before the lease).
# WHEELS=dir installs the wheels in dir first (a machine without a package index); SHARED=dir is
# copied to ../shared when that is absent (the stories260K checkpoint the suite reads).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_checks}
mkdir -p "$OUT"
STEPS=${STEPS:-"suite triton flexgen"}
PY=${PYTHON:-python3}

if [ -n "${WHEELS:-}" ]; then  # into the interpreter's own environment: the suite's subprocesses see them too
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$WHEELS"/*.whl \
        || { echo "installing $WHEELS failed"; exit 1; }
fi
if [ -n "${SHARED:-}" ] && [ ! -e ../shared ]; then cp -r "$SHARED" ../shared; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

{ date -u; nvidia-smi; $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(),
torch.cuda.get_device_capability())"; nproc; free -g; } > "$OUT/env.txt" 2>&1

for step in $STEPS; do
    start=$(date +%s)
    case $step in
    suite)
        # -rfE: failures and errors summarised at the end; a hung test fails after TEST_TIMEOUT s
        extra=""
        $PY -c "import xdist" 2>/dev/null && extra="-n ${WORKERS:-$(nproc)}"
        $PY -c "import pytest_timeout" 2>/dev/null && extra="$extra --timeout ${TEST_TIMEOUT:-150}"
        # shellcheck disable=SC2086
        OMP_NUM_THREADS=2 timeout "${SUITE_TIMEOUT:-300}" $PY -m pytest -q -rfE $extra -p no:cacheprovider \
            --durations=20 --junitxml="$OUT/junit.xml" ${PYTEST_ARGS:-} > "$OUT/suite.log" 2>&1
        ;;
    triton)
        timeout "${TRITON_TIMEOUT:-90}" $PY scripts/bench_triton_gpu.py > "$OUT/triton.log" 2>&1 ;;
    flexgen)
        : > "$OUT/flexgen.log"
        if [ -n "${FLEXGEN_PROFILE:-}" ]; then  # this GPU's profile first, its rates at the benchmark's shapes
            timeout 150 $PY -m flexsarathi profile -o "$OUT/profile.json" --model opt-6.7b --disk-mib 64 \
                --offload-dir /tmp/gpu_checks_profile >> "$OUT/flexgen.log" 2>&1
        fi
        # shellcheck disable=SC2086
        timeout "${FLEXGEN_TIMEOUT:-600}" $PY scripts/bench_flexgen_gpu.py ${FLEXGEN_CASES:+--cases $FLEXGEN_CASES} \
            ${FLEXGEN_PROFILE:+--profile "$OUT/profile.json"} --timeout "${FLEXGEN_RUN_TIMEOUT:-300}" \
            ${FLEXGEN_SCHEDULERS:+--schedulers $FLEXGEN_SCHEDULERS} --deadline "${FLEXGEN_DEADLINE:-570}" \
            ${FLEXGEN_SKIP:+--skip-flexgen $FLEXGEN_SKIP} \
            --json "$OUT/flexgen.json" >> "$OUT/flexgen.log" 2>&1 ;;
    stress)
        : > "$OUT/stress.log"
        for round in 1 2; do
            for _ in $(seq "${STRESS_PROCS:-12}"); do
                (OMP_NUM_THREADS=2 timeout 120 $PY -m pytest -q -p no:cacheprovider tests/offload/test_cuda.py \
                    -k "no_host_sync or held_back or closed_or_dropped" -rf 2>&1 | grep -E "passed|failed|FAILED" \
                    >> "$OUT/stress.log") &
            done
            wait
        done
        sort "$OUT/stress.log" | uniq -c > "$OUT/stress.summary"; mv "$OUT/stress.summary" "$OUT/stress.log" ;;
    launches)
        for shape in "--hidden 64 --heads 4 --layers 4 --prompt-len 32" \
                     "--hidden 4096 --heads 32 --layers 2 --prompt-len 512"; do
            for graphs in "" "--graphs"; do
                # shellcheck disable=SC2086
                timeout "${LAUNCH_TIMEOUT:-120}" $PY scripts/count_launches.py --device cuda $shape $graphs
            done
            # a 4-bit KV cache: the Triton decode route, then the gather route it replaces
            for route in "" "--gather-kv"; do
                # shellcheck disable=SC2086
                timeout "${LAUNCH_TIMEOUT:-120}" $PY scripts/count_launches.py --device cuda $shape --compress-kv \
                    --batch 8 $route
            done
        done > "$OUT/launches.log" 2>&1 ;;
    profile)
        for scheduler in block decode-maximal; do
            # shellcheck disable=SC2086
            timeout "${PROFILE_TIMEOUT:-120}" $PY scripts/profile_passes.py --model "${PROFILE_MODEL:-dummy:opt-1.3b}" \
                --scheduler $scheduler ${PROFILE_ARGS:-}
        done > "$OUT/profile.log" 2>&1 ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
    echo "step $step: exit $? in $(( $(date +%s) - start )) s"
    tail -n 5 "$OUT/$step.log" 2>/dev/null
done
