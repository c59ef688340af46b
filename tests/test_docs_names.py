"""Every module, function, class, hook and path that docs/architecture.md and
docs/plugins.md name in backticks exists.

The names are read from the inline `code` spans (fenced blocks are examples,
left out), and resolved against an index of the source built from its syntax
trees (nothing is imported, so plugins whose SDKs are absent count too):

* a path (`engine/startup.py`, `plugins/backends/triton/`): a tracked file or
  folder whose path ends with it;
* a dotted name whose head is a module (`plinth.api.Accelerator`,
  `startup.check_a2a`) or a class (`EngineConfig.dequantize`): every part
  after the head is defined there (a module-level name, a class member or
  field, a base class's member);
* a call (`kv_pool_pages(...)`, `check()`): a function or method of that name
  is defined somewhere;
* a hook (`plinth_register_*`, `plinth_add_cli_arguments`): a hook spec in
  plinth/hookspecs.py.

A dotted name whose head is neither (`ctx.ops`, `torch.distributed`) is
someone else's or an instance's, and is not checked.
"""

from __future__ import annotations

import ast
import builtins
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("docs/architecture.md", "docs/plugins.md")
# the walk-through's example distributions (docs/plugins.md), which do not exist
# upstream projects' paths the pages cite (LMDeploy's, dlinfer's), not ours
UPSTREAM = ("lmdeploy/", "dlinfer/", "ascend/")
EXAMPLES = ("acme", "dictkv", "bcast", "plinth_plugin_my", "plinth-plugin-my", "plinth_plugin_mine", "my_plugin")


@dataclass
class Scope:
    """A module or a class: the names defined in it, its bases (classes)."""

    names: dict[str, "Scope | None"] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)
    functions: set[str] = field(default_factory=set)


def _class_scope(node: ast.ClassDef) -> Scope:
    scope = Scope(
        bases=[
            b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, (ast.Name, ast.Attribute))
        ]
    )
    _fill(scope, node.body)
    for inner in ast.walk(node):  # attributes its methods set: self.events = ...
        if isinstance(inner, (ast.Assign, ast.AnnAssign)):
            for target in inner.targets if isinstance(inner, ast.Assign) else [inner.target]:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    scope.names.setdefault(target.attr, None)
    return scope


def _fill(scope: Scope, body: list[ast.stmt]) -> None:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope.names[node.name] = None
            scope.functions.add(node.name)
        elif isinstance(node, ast.ClassDef):
            scope.names[node.name] = _class_scope(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            scope.names[node.target.id] = None
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        scope.names[name.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                scope.names[(alias.asname or alias.name).split(".")[0]] = None
        elif isinstance(node, (ast.If, ast.Try)):
            _fill(
                scope,
                node.body + getattr(node, "orelse", []) + [s for h in getattr(node, "handlers", []) for s in h.body],
            )


@dataclass
class Index:
    files: set[str]  # tracked paths, and every folder above them (with a trailing /)
    modules: dict[str, Scope]  # dotted module name -> scope
    by_basename: dict[str, list[str]]  # last part of a module name -> module names
    classes: dict[str, list[Scope]]  # class name -> its scopes, wherever defined
    functions: set[str]  # every function and method name
    hooks: set[str]

    def lookup(self, scope: Scope, name: str, seen: frozenset[int] = frozenset()) -> tuple[bool, Scope | None]:
        if name in scope.names:
            return True, scope.names[name]
        for base in scope.bases:  # a member a base class defines
            for base_scope in self.classes.get(base, []):
                if id(base_scope) not in seen:
                    found, inner = self.lookup(base_scope, name, seen | {id(scope)})
                    if found:
                        return True, inner
        return False, None


def _module_name(path: str) -> str | None:
    parts = Path(path).with_suffix("").parts
    if "src" not in parts:
        return None
    parts = parts[parts.index("src") + 1 :]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@pytest.fixture(scope="module")
def index() -> Index:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = set(tracked)
    for path in tracked:
        for parent in Path(path).parents:
            if str(parent) != ".":
                files.add(f"{parent}/")
    modules: dict[str, Scope] = {}
    classes: dict[str, list[Scope]] = {}
    functions: set[str] = set()
    for path in tracked:
        name = _module_name(path) if path.endswith(".py") else None
        if name is None:
            continue
        tree = ast.parse((ROOT / path).read_text(), path)
        scope = Scope()
        _fill(scope, tree.body)
        modules[name] = scope
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.add(node.name)
            elif isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(_class_scope(node))
    for name in list(modules):  # a package holds its submodules
        if "." in name:
            parent, _, leaf = name.rpartition(".")
            if parent in modules:
                modules[parent].names.setdefault(leaf, modules[name])
    by_basename: dict[str, list[str]] = {}
    for name in modules:  # core's modules by their last part (startup, factory); plugins' by full name
        if name.startswith("plinth."):
            by_basename.setdefault(name.rpartition(".")[2], []).append(name)
    spec_class = modules["plinth.hookspecs"].names["PlinthHookSpec"]
    assert spec_class is not None
    hooks = spec_class.functions
    return Index(files, modules, by_basename, classes, functions, hooks)


def _spans(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # fenced examples
    return [s.strip() for s in re.findall(r"`([^`\n]+)`", text.replace("\n", " ").replace("  ", " "))]


IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
DOTTED = re.compile(rf"^({IDENT}(?:\.{IDENT})+)(\(.*\))?$")
CALL = re.compile(rf"^({IDENT})\(.*\)$")
PATH = re.compile(r"^[\w./-]+/[\w.-]*$")


def _resolve_dotted(index: Index, parts: list[str]) -> str | None:
    """None when resolved or not ours to check, else what is missing."""
    heads: list[tuple[str, Scope]] = []
    # the longest module prefix: plinth.contract.backend.OpTable, startup.check_a2a, plinth_plugin_llama.plugin
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        candidates = [name] if name in index.modules else []
        if n == 1 or not candidates:
            candidates += [m for m in index.by_basename.get(parts[n - 1], []) if m.endswith("." + name) or m == name]
        if candidates:
            heads = [(m, index.modules[m]) for m in candidates]
            rest = parts[n:]
            break
    else:
        if parts[0] not in index.classes:
            return None  # an instance's attribute, or another library's name
        heads = [(parts[0], s) for s in index.classes[parts[0]]]
        rest = parts[1:]
    for _head, scope in heads:
        current: Scope | None = scope
        for part in rest:
            if current is None:
                break  # a function or variable: what lies below it is not indexed
            found, current = index.lookup(current, part)
            if not found:
                break
        else:
            return None
    return f"{'.'.join(parts)} (not in {', '.join(h for h, _ in heads)})"


def _problems(index: Index, doc: str) -> tuple[list[str], int]:
    problems, checked = [], 0
    for span in _spans((ROOT / doc).read_text()):
        if any(e in span for e in EXAMPLES) or span.startswith(("-", "$", "<", "http")) or " " in span.split("(")[0]:
            continue
        span = re.sub(r"^plinth\.api\.(\w+)$", r"plinth.api.\1", span.rstrip(",;:"))
        if PATH.match(span) and "<" not in span:
            if span.startswith(UPSTREAM) or not span.endswith(
                ("/", ".py", ".cpp", ".md", ".txt", ".toml", ".yaml", ".sh")
            ):
                continue
            checked += 1
            if not (span in index.files or any(f.endswith("/" + span) for f in index.files)):
                problems.append(f"{doc}: path `{span}` is not in the tree")
        elif m := DOTTED.match(span):
            parts = m.group(1).split(".")
            if parts[-1] in ("py", "json", "md", "toml", "gguf", "so", "model"):
                continue  # a file name (config.json, tiktoken.model)
            missing = _resolve_dotted(index, parts)
            if missing is not None:
                problems.append(f"{doc}: `{span}`: {missing}")
            checked += (missing is not None) or parts[0] in index.by_basename or parts[0] in index.classes
        elif m := CALL.match(span):
            checked += 1
            if (
                m.group(1) not in index.functions
                and m.group(1) not in dir(builtins)
                and m.group(1) not in index.classes
            ):
                problems.append(f"{doc}: `{span}`: no function {m.group(1)} is defined")
        elif re.fullmatch(r"plinth_(register_\w+|add_cli_arguments)", span):
            checked += 1
            if span not in index.hooks:
                problems.append(f"{doc}: hook `{span}` is not in plinth/hookspecs.py")
    return problems, checked


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_thing_exists(index, doc):
    problems, checked = _problems(index, doc)
    assert checked > 40, f"only {checked} names checked in {doc}: the parser lost them"
    assert not problems, "\n".join(problems)


def test_a_wrong_name_is_found(index, tmp_path):
    """The check fails on the errors issue 46 found in these pages."""
    doc = tmp_path / "wrong.md"
    doc.write_text(
        "`startup.choose_a2a`, `distributed.build_a2a`, `plinth.api.NoSuchThing`, "
        "`engine/nosuch.py`, `plugins/models/nosuch/`, `no_such_function(x)`, `plinth_register_nothing`, "
        "`EngineConfig.no_such_field`; fine: `startup.check_a2a`, `ctx.ops`, `torch.distributed`\n"
    )
    problems, _ = _problems(index, str(doc))
    assert len(problems) == 8, "\n".join(problems)
