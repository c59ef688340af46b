"""deploy/: every manifest validates. Core kinds against Kubernetes' own schemas
(kubernetes-validate, strict: an unknown field fails); InferencePool and
LeaderWorkerSet against their published CRDs kept in deploy/crds; llm-d's
EndpointPickerConfig against deploy/schemas; and the pieces that must agree
across files do (ports, labels, the KV-event endpoint and topic, block size)."""

import copy
import functools
import gzip
import json
import re
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S_VERSION = "1.33"


def manifests():
    out = []
    for path in sorted((DEPLOY / "kubernetes").rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.relative_to(DEPLOY).as_posix(), doc))
    return out


def crd_schema(filename, version):
    path = DEPLOY / "crds" / filename
    text = gzip.decompress(path.read_bytes()).decode() if filename.endswith(".gz") else path.read_text()
    crd = yaml.safe_load(text)
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return crd["spec"]["names"]["kind"], v["schema"]["openAPIV3Schema"]


CRDS = dict(
    [crd_schema("inference.networking.k8s.io_inferencepools.yaml", "v1"),
     crd_schema("leaderworkerset.x-k8s.io_leaderworkersets.yaml.gz", "v1")]
)  # fmt: skip


@functools.cache
def structural_of(kind):
    return structural(CRDS[kind])


def structural(schema):
    """A CRD's structural schema as JSON Schema: unknown fields are pruned by
    the API server, so here they fail (additionalProperties false where the
    CRD lists properties and does not say x-kubernetes-preserve-unknown-fields)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if not isinstance(node, dict):
            return
        if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
        if node.get("x-kubernetes-int-or-string"):
            node.pop("type", None)
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        for v in node.values():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, list):
                for x in v:
                    walk(x)

    walk(s)
    s["properties"]["metadata"] = {"type": "object"}
    return s


ALL = manifests()


@pytest.mark.parametrize("where,doc", ALL, ids=[f"{w}:{d['kind']}/{d['metadata']['name']}" for w, d in ALL])
def test_manifest_validates(where, doc):
    if doc["kind"] in CRDS:
        jsonschema.validate(doc, structural_of(doc["kind"]))
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_an_unknown_field_fails():
    """The checks above can fail: a misspelt field is caught in both kinds of schema."""
    dep = next(d for _, d in ALL if d["kind"] == "Deployment")
    bad = copy.deepcopy(dep)
    bad["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    pool = copy.deepcopy(next(d for _, d in ALL if d["kind"] == "InferencePool"))
    pool["spec"]["targetPort"] = [{"number": 8000}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, structural_of("InferencePool"))
    lws = copy.deepcopy(next(d for _, d in ALL if d["kind"] == "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["size"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(lws, structural_of("LeaderWorkerSet"))


def by_kind(kind, name=None):
    return next(d for _, d in ALL if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def test_scheduler_config_and_the_pool_agree_with_the_servers():
    cm = by_kind("ConfigMap", "plinth-epp-config")
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    jsonschema.validate(cfg, json.loads((DEPLOY / "schemas" / "endpointpickerconfig.schema.json").read_text()))
    names = {p.get("name", p["type"]) for p in cfg["plugins"]}
    (profile,) = cfg["schedulingProfiles"]
    assert {r["pluginRef"] for r in profile["plugins"]} <= names
    weights = {r["pluginRef"]: r.get("weight") for r in profile["plugins"]}
    assert (weights["precise-prefix-cache-scorer"], weights["kv-cache-utilization-scorer"], weights["queue-scorer"]) == (2, 1, 1)
    prefix = next(p for p in cfg["plugins"] if p["type"] == "precise-prefix-cache-scorer")["parameters"]

    dep = by_kind("Deployment", "plinth")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    argv = shlex.split(c["args"][0].replace("$", ""))
    assert argv[:3] == ["exec", "platform", "serve"]
    page = int(argv[argv.index("--page-size") + 1])
    assert prefix["tokenProcessorConfig"]["blockSize"] == page
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    from plinth.engine.kv_events import KVEventsConfig

    kv = KVEventsConfig.from_mapping(events)
    assert kv.enabled and kv.endpoint == f"tcp://*:{prefix['kvEventsConfig']['podDiscoveryConfig']['socketPort']}"
    assert kv.topic.startswith(prefix["kvEventsConfig"]["topicFilter"]) and kv.topic.count("@") == 2  # kv@<pod>@<model>
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["kv-events"] == prefix["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"]

    pool = by_kind("InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    svc = by_kind("Service", pool["spec"]["endpointPickerRef"]["name"])
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        assert c[probe]["httpGet"]["path"] == path


def test_leaderworkerset_runs_one_group_over_its_nodes():
    from plinth.cli import build_parser
    from plinth.plugins import PluginRegistry

    lws = by_kind("LeaderWorkerSet")
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    parser = build_parser(PluginRegistry.discover())
    env = {"LWS_GROUP_SIZE": str(tmpl["size"]), "LWS_LEADER_ADDRESS": "10.0.0.1", "LWS_WORKER_INDEX": "1"}
    ranks = []
    for role in ("leaderTemplate", "workerTemplate"):
        (c,) = tmpl[role]["spec"]["containers"]
        line = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], c["args"][0])
        argv = shlex.split(line)
        assert argv[:2] == ["exec", "platform"]
        args = parser.parse_args(argv[2:])  # the flags `platform serve` takes
        assert args.nnodes == tmpl["size"] and args.master_addr == "10.0.0.1"
        ranks.append(args.node_rank)
    assert ranks == [0, 1]
