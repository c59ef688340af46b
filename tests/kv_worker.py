"""One engine process for the KV-connector tests: generate greedily for the
prompts given as JSON, print one JSON line with the outputs and counters.

    python kv_worker.py MODEL_DIR CONNECTOR CONFIG_JSON PROMPTS_JSON [--reference]
"""

import json
import sys

from plinth import LLM, SamplingParams


def main() -> None:
    model, connector, config, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = LLM(model, dtype="float32", backend="torch", load_progress=False, num_pages=256, page_size=16,
              kv_connector=connector or None, kv_connector_config=config)
    result = {"outputs": [], "cached": [], "external": []}
    for p in prompts:
        (out,) = llm.generate([p], params, use_tqdm=False)
        result["outputs"].append(out.outputs[0].token_ids)
        result["cached"].append(out.num_cached_tokens)
        result["external"].append(out.num_external_cached_tokens)
    if connector:
        result["flushed"] = llm.engine.kv.connector.flush(10)
        s = llm.engine.stats()
        result["stats"] = {k: v for k, v in s.items() if k.startswith(("kv_connector", "prefix_cache"))}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
