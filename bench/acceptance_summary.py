"""One JSON summary of an acceptance run (bench/gpu/acceptance.sh,
bench/npu/acceptance.sh): every step's exit status and seconds
(``status.jsonl``, one line a step) and the JSON each step wrote
(``<step>.json``), into ``summary.json``; prints a one-line digest.

    python bench/acceptance_summary.py OUT_DIR MODE
"""

from __future__ import annotations

import json
import os
import sys


def main(out: str, mode: str) -> int:
    with open(os.path.join(out, "status.jsonl")) as f:
        status = [json.loads(line) for line in f if line.strip()]
    results = {}
    for s in status:
        path = os.path.join(out, f"{s['step']}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[s["step"]] = json.load(f)
    summary = {"mode": mode, "steps": status, "results": results, "ok": bool(status) and all(s["rc"] == 0 for s in status)}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    digest = {"ok": summary["ok"], "mode": mode, "steps": {s["step"]: s["rc"] for s in status}, "summary": os.path.join(out, "summary.json")}
    print(json.dumps(digest))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
