"""The engine's modules import each other without a circle, counting the
imports inside functions too (a function-level import hides a circle; it
does not remove it). The layers, lowest first: interfaces and config; the
executor seam and the engine that steps over it (which knows no rank);
start-up; the multi-process parts (launch, the wire protocol, the watchdog,
the multi-process executor, the dp front end); the worker and the factory;
the clients (AsyncLLM, LLM)."""

from __future__ import annotations

import ast
from pathlib import Path

import plinth.engine

ENGINE = Path(plinth.engine.__file__).parent
PACKAGE = "plinth.engine"


def import_graph() -> dict[str, set[str]]:
    """module -> the plinth.engine modules it imports, anywhere in its code."""
    graph: dict[str, set[str]] = {}
    names = {p.stem for p in ENGINE.glob("*.py") if p.stem != "__init__"}
    for name in names:
        tree = ast.parse((ENGINE / f"{name}.py").read_text())
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == PACKAGE:  # from plinth.engine import x
                    deps.update(a.name for a in node.names if a.name in names)
                elif node.module.startswith(PACKAGE + "."):
                    deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[2] for a in node.names if a.name.startswith(PACKAGE + "."))
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_the_engine() -> None:
    graph = import_graph()
    assert {"engine", "executor", "startup", "launch", "wire", "watchdog", "multiproc", "data_parallel", "worker", "factory", "interfaces"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle among engine modules: " + " -> ".join(cycle)


#: the modules of more than one rank
RANKS = {"launch", "wire", "watchdog", "multiproc", "data_parallel", "worker", "parallel"}


def test_layers() -> None:
    graph = import_graph()
    # every engine module may import it: it names (for types) only data modules, which import only each other
    data = {"outputs", "sampling_params", "grammar"}
    assert graph["interfaces"] <= data
    assert all(graph[m] <= data for m in data), {m: graph[m] for m in data}
    assert graph["config"] <= {"kv_events"}  # the settings: read by the command line, cheap to import
    # the engine steps over an executor and knows no rank
    assert not {"startup", "factory"} & graph["engine"] and not RANKS & graph["engine"]
    assert not RANKS & graph["executor"] and "engine" not in graph["executor"]
    assert not {"distributed", "worker", "factory", "engine", "executor", "multiproc", "data_parallel"} & graph["startup"]
    assert not {"multiproc", "data_parallel", "worker", "factory", "engine"} & (graph["launch"] | graph["wire"] | graph["watchdog"])
    assert not {"worker", "factory", "data_parallel"} & graph["multiproc"]
    assert "worker" not in graph["factory"] and "factory" not in graph["worker"]  # ranks start as `python -m plinth.engine.worker`, by name
