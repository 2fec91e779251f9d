#!/usr/bin/env bash
# The project's offline GPU check: run it once on a GPU machine and paste its last line into docs/runs.md.
#
#   benchmarks/gpu_check.sh            # a GPU machine with CUDA torch; no registry, no internet, vLLM optional
#   benchmarks/gpu_check.sh --smoke    # the same steps on the CPU, small shapes (tests/test_launch.py runs it)
#
# Steps, each under its own timeout and all within BUDGET_S (8 minutes): the environment (python, torch, CUDA, GPU,
# vLLM and the pinned libraries it finds: the project must run on the torch it finds, e.g. 2.11); the project's
# imports; the tiny main job on CUDA (configs/tiny/format_copy_grpo.yaml: eval exact match 0.375 -> 1.0 on the
# CPU), then with vLLM when it imports; then benchmarks/gpu_iteration.py at the math_hard GRPO shapes on a random
# Qwen2.5-1.5B-shaped model (config only, no download) with HF and, when it imports, vLLM. A failed or timed-out
# step is reported and the next one runs. The last line is JSON: each step's status and seconds, the tiny jobs'
# eval exact match, and per engine the seconds per phase, decode ms per token, tokens/s, peak GPU memory and the
# projected hours of the four course runs. Logs of every step: $OUT (default: a new temporary directory).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
PY=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d)}
BUDGET_S=${BUDGET_S:-480}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the project from this checkout, installed or not
mkdir -p "$OUT"
START=$(date +%s)
STATUS="$OUT/steps.jsonl"
: > "$STATUS"

# step NAME LIMIT_S COMMAND...: run with the smaller of LIMIT_S and the budget left; log to $OUT/NAME.log.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - ($(date +%s) - START)))
    ((limit > left)) && limit=$left
    if ((limit < 5)); then
        echo "{\"step\": \"$name\", \"status\": \"skipped: budget spent\", \"seconds\": 0}" >> "$STATUS"
        echo "== $name: skipped (the ${BUDGET_S} s budget is spent)"
        return 1
    fi
    local t0=$SECONDS rc
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    local status=ok
    ((rc == 124 || rc == 137)) && status="timeout after ${limit} s"
    ((rc != 0 && rc != 124 && rc != 137)) && status="failed (exit $rc)"
    echo "{\"step\": \"$name\", \"status\": \"$status\", \"seconds\": $((SECONDS - t0))}" >> "$STATUS"
    echo "== $name: $status in $((SECONDS - t0)) s (log: $OUT/$name.log)"
    tail -n 3 "$OUT/$name.log" | sed 's/^/   /'
    return $rc
}

step environment 60 "$PY" - <<'EOF'
import importlib, json, platform, sys
import torch
info = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, gpu_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count(),
                bf16=torch.cuda.is_bf16_supported())
for name in ("vllm", "transformers", "lightning", "peft", "triton"):
    try:
        info[name] = importlib.import_module(name).__version__
    except Exception as error:  # absent, or present but broken: both are worth knowing
        info[name] = f"unavailable ({type(error).__name__}: {str(error)[:120]})"
print(json.dumps(info))
EOF
step imports 90 "$PY" -c "import llm_pg.cli.fit, llm_pg.engines, llm_pg.modules; print('llm_pg imports')"
HAS_VLLM=0
"$PY" -c "import vllm" > /dev/null 2>&1 && HAS_VLLM=1

TINY=(-m llm_pg.cli.fit fit --config configs/tiny/format_copy_grpo.yaml --wandb_project null
    --trainer.enable_progress_bar false --overwrite true)
if ((SMOKE)); then
    ACCEL=(--trainer.accelerator cpu --model.init_args.iterations 6 --model.init_args.evaluation.every 3)
    VLLM_CPU=(--model.init_args.vllm.kv_cache_memory_bytes 67108864)
    BENCH=(--smoke --iterations 2 --eval-size 2)
else
    ACCEL=(--trainer.accelerator gpu)
    VLLM_CPU=()
    BENCH=(--iterations 3 --eval-size 8)
fi
step tiny_hf 120 "$PY" "${TINY[@]}" "${ACCEL[@]}" --runs_root "$OUT/runs" --run_name tiny_hf
if ((HAS_VLLM)); then
    step tiny_vllm 150 "$PY" "${TINY[@]}" "${ACCEL[@]}" "${VLLM_CPU[@]}" --runs_root "$OUT/runs" \
        --run_name tiny_vllm --model.init_args.rollout_engine vllm --model.init_args.iterations 10
fi
# One random model for both engines: building and saving 1.5B parameters takes a while.
step iteration_hf 150 "$PY" benchmarks/gpu_iteration.py --engine hf "${BENCH[@]}" --model-dir "$OUT/model" \
    --json "$OUT/iteration_hf.json"
if ((HAS_VLLM)); then
    step iteration_vllm 210 "$PY" benchmarks/gpu_iteration.py --engine vllm "${BENCH[@]}" --model-dir "$OUT/model" \
        --json "$OUT/iteration_vllm.json"
fi

"$PY" - "$OUT" "$(($(date +%s) - START))" <<'EOF'
import csv, json, sys
from pathlib import Path
out, total = Path(sys.argv[1]), int(sys.argv[2])
result = {"total_s": total, "steps": [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]}
env = out / "environment.log"
if env.exists() and env.read_text().strip():
    try:
        result["environment"] = json.loads(env.read_text().strip().splitlines()[-1])
    except json.JSONDecodeError:
        pass
for name in ("tiny_hf", "tiny_vllm"):
    metrics = out / "runs" / name / "metrics.csv"
    if metrics.exists():
        em = [float(r["eval/exact_match"]) for r in csv.DictReader(metrics.open()) if r.get("eval/exact_match")]
        if em:
            result[f"{name}_exact_match"] = [em[0], em[-1]]
for engine in ("hf", "vllm"):
    path = out / f"iteration_{engine}.json"
    if path.exists():
        result[f"iteration_{engine}"] = json.loads(path.read_text())
print(json.dumps(result))
EOF
