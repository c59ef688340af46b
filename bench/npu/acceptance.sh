#!/usr/bin/env bash
# Acceptance of the dlinfer backend on an Ascend machine, in one command:
#
#   bench/npu/acceptance.sh            # run it (an Ascend NPU, CANN, torch_npu, dlinfer-ascend)
#   bench/npu/acceptance.sh --dry-run  # print the steps and the commands, run nothing
#
# 1. the ascend accelerator and the dlinfer backend are available (`platform plugins`)
# 2. the backend conformance kit against the real dlinfer on the NPU (float16, bfloat16;
#    page sizes 16 and 128): every op against the torch reference on the same device
# 3. SmolLM2 (the bundled default model) served twice on the NPU, --backend dlinfer and
#    --backend torch: the same prompts at temperature 0 must give the same tokens
# 4. decode throughput of the engine on the NPU with dlinfer, then with torch
#
# Environment: PLATFORM (default: .venv/bin/platform), PYTHON (default: .venv/bin/python),
# PORT (default 18431), OUT (results folder, default bench/results/npu-<date>).
set -euo pipefail

DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (use --dry-run)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/../.."
PLATFORM=${PLATFORM:-.venv/bin/platform}
PYTHON=${PYTHON:-.venv/bin/python}
PORT=${PORT:-18431}
OUT=${OUT:-bench/results/npu-$(date -u +%Y%m%dT%H%M%SZ)}
DTYPE=bfloat16
PAGE=128  # what LMDeploy runs on Ascend; the kernels take powers of two >= 16

step() { echo; echo "== $*"; }
run() {
  echo "+ $*"
  if [ "$DRY" = 0 ]; then "$@"; fi
}
# run, keeping stdout in $OUT/<file> too
run_to() {
  local file=$1
  shift
  echo "+ $* > $OUT/$file"
  if [ "$DRY" = 0 ]; then "$@" | tee "$OUT/$file"; fi
}

step "0. results go to $OUT"
run mkdir -p "$OUT"

step "1. the ascend accelerator and the dlinfer backend are available"
run_to plugins.json "$PLATFORM" plugins --json
run "$PYTHON" - "$OUT/plugins.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["plugins"]
def status(category, name):
    row = next((r for r in rows if r.get("category") == category and r.get("name") == name), None)
    return row and (row.get("status"), row.get("reasons"))
for category, name in (("accelerator", "ascend"), ("backend", "dlinfer")):
    st = status(category, name)
    print(category, name, st)
    if not st or st[0] != "ok":
        sys.exit(f"{category} {name} cannot run here: {st}")
PY

step "2. the conformance kit: dlinfer's ops against the torch reference on the NPU"
run_to conformance.txt "$PYTHON" -c "
from plinth.testing import check_backend
print(check_backend('dlinfer', dtypes=('float16', 'bfloat16'), accelerator='ascend', page_sizes=(16, 128),
                    sliding_window=False, require_available=True))
"

step "3. SmolLM2 served with --backend dlinfer and --backend torch: the same greedy tokens"
for backend in dlinfer torch; do
  run "$PYTHON" - "$PLATFORM" "$PORT" "$backend" "$DTYPE" "$PAGE" "$OUT/greedy-$backend.json" <<'PY'
import json, subprocess, sys, time, urllib.request
platform, port, backend, dtype, page, out = sys.argv[1:]
server = subprocess.Popen([platform, "serve", "--host", "127.0.0.1", "--port", port, "--device", "ascend",
                           "--backend", backend, "--dtype", dtype, "--page-size", page])
try:
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            break
        except Exception:
            if server.poll() is not None:
                sys.exit(f"the {backend} server exited with {server.returncode}")
            time.sleep(1)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
               "The three laws of thermodynamics are"]
    texts = []
    for p in prompts:
        body = json.dumps({"prompt": p, "max_tokens": 64, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        texts.append(json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["text"])
    json.dump({"backend": backend, "prompts": prompts, "texts": texts}, open(out, "w"), indent=1)
    print(backend, "ok:", [t[:40] for t in texts])
finally:
    server.terminate()
    server.wait(timeout=60)
PY
done
run "$PYTHON" - "$OUT/greedy-dlinfer.json" "$OUT/greedy-torch.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
bad = [p for p, x, y in zip(a["prompts"], a["texts"], b["texts"]) if x != y]
if bad:
    sys.exit(f"greedy outputs differ between dlinfer and torch for: {bad}")
print(f"greedy tokens equal for all {len(a['prompts'])} prompts")
PY

step "4. decode throughput on the NPU: dlinfer, then torch"
for backend in dlinfer torch; do
  run "$PLATFORM" bench offline --device ascend --backend "$backend" --dtype "$DTYPE" --peers none \
      --save-result "$OUT/offline-$backend.json"
done

step "done: results in $OUT"
