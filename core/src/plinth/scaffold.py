"""``platform plugins new CATEGORY NAME``: a plugin distribution to fill in.

It writes a complete, installable distribution ``plinth-plugin-NAME``: a
pyproject (the entry point, the plugin API range, a ``runtime`` extra for
the vendor's libraries), a README, the entry-point module registering the
descriptor, an implementation whose every method the contract requires is
there and raises ``NotImplementedError`` naming what it must do, and the
conformance test, wired. Until each such method is written the core lists
the plugin as unavailable, naming them (``plinth.plugins.stub_methods``),
and the kit fails naming them. The files pass the project's ruff and
pyright settings as they are generated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from plinth.errors import ConfigError

#: what a name may be: it becomes a distribution, a package and an entry point
NAME_RE = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")


@dataclass(frozen=True)
class Registration:
    """One descriptor a scaffold's entry point registers."""

    hook: str  # plinth_register_accelerators
    descriptor: str  # AcceleratorDescriptor
    impl: str  # the class in the implementation module (templated)
    description: str
    #: the descriptor's priority line, with why (``auto``'s order)
    priority: str = "priority=0,"
    #: the category's own fields, one per line
    fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class Kind:
    """One category ``platform plugins new`` knows."""

    category: str
    summary: str  # "an accelerator plugin"
    module: str  # the implementation module's name
    torch: bool  # the implementation computes with torch (a dependency)
    #: the methods a new plugin must write, for the README
    todo: tuple[str, ...]
    registrations: tuple[Registration, ...]
    files: dict[str, str]  # path (templated) -> template, besides plugin.py


def entry_point(kind: Kind) -> str:
    """plugin.py's template: the registration hooks and their descriptors."""
    out = [
        '"""Entry point: registers what the plugin provides. Every `platform` command imports this on\n'
        "every machine, so it imports nothing but plinth.api (no torch, no vendor library); the\n"
        'implementation is named lazily in `impl`."""\n',
        f"from plinth.api import {', '.join(sorted({r.descriptor for r in kind.registrations}))}, hookimpl\n",
    ]
    for r in kind.registrations:
        lines = ['name="$name",', f'impl="$pkg.{kind.module}:{r.impl}",', *r.priority.splitlines(), 'api="$api",',
                 f'description="{r.description}",', *r.fields]  # fmt: skip
        body = "\n".join(" " * 12 + line for line in lines)
        out.append(f"\n@hookimpl\ndef {r.hook}() -> list[{r.descriptor}]:\n    return [\n        {r.descriptor}(\n{body}\n        )\n    ]\n")
    return "\n".join(out)


def api_range(version: str) -> str:
    """The range a new plugin supports: the core's plugin API major version,
    from its current minor on (what it was written against)."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return f">={major}.{minor},<{major + 1}"


def core_requirement(version: str) -> str:
    """plinth-core as a dependency: its 0.x minor (0.x minors may break) or major."""
    parts = [int(x) for x in re.findall(r"\d+", version)[:2]] + [0, 0]
    major, minor = parts[0], parts[1]
    return f"plinth-core>={major}.{minor},<{major}.{minor + 1}" if major == 0 else f"plinth-core>={major}.{minor},<{major + 1}"


def class_prefix(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[-_]", name))


def generate(category: str, name: str, dest: str | Path | None = None) -> list[Path]:
    """Write the distribution for ``category`` / ``name`` into ``dest``
    (default ``./plinth-plugin-NAME``); returns the files written.
    Refuses an unknown category, a bad name, or a folder that has files."""
    from plinth import __version__
    from plinth.contract import PLUGIN_API_VERSION

    kind = KINDS.get(category)
    if kind is None:
        raise ConfigError(f"unknown category {category!r}; `platform plugins new` takes one of: {', '.join(KINDS)}")
    if not NAME_RE.match(name):
        raise ConfigError(
            f"plugin name {name!r}: use lower-case letters and digits, words joined by '-' or '_', starting with a "
            "letter (it becomes the distribution plinth-plugin-NAME, the package plinth_plugin_NAME and the entry point)"
        )
    dist = f"plinth-plugin-{name}"
    root = Path(dest) if dest else Path.cwd() / dist
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"{root} already exists and is not an empty folder: choose another with --dir")
    values = {
        "name": name,
        "ident": name.replace("-", "_"),
        "dist": dist,
        "pkg": "plinth_plugin_" + name.replace("-", "_"),
        "Cls": class_prefix(name),
        "api": api_range(PLUGIN_API_VERSION),
        "api_version": PLUGIN_API_VERSION,
        "core": core_requirement(__version__),
        "summary": kind.summary,
        "category": kind.category,
        "module": kind.module,
        "deps": ", ".join(f'"{d}"' for d in [core_requirement(__version__), *(["torch>=2.4"] if kind.torch else [])]),
    }
    values["todo"] = "\n".join(f"* {Template(t).substitute(values)}" for t in kind.todo)
    files = {**COMMON, "src/$pkg/plugin.py": entry_point(kind), **kind.files}
    written = []
    for path, text in files.items():
        target = root / Template(path).substitute(values)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(Template(text).substitute(values))
        written.append(target)
    return written


# ---------------------------------------------------------------------------
# files every category has
# ---------------------------------------------------------------------------

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "plinth $category plugin: $name"
readme = "README.md"
requires-python = ">=3.10"
license = "Apache-2.0"
# the plugin API range it was written against is the descriptor's `api` ($api, in plugin.py)
dependencies = [$deps]

[project.optional-dependencies]
# the vendor's own libraries (a torch extension, an SDK): `pip install "$dist[runtime]"`
# where the hardware is; without them the plugin still installs and says what is missing
runtime = []
test = ["pytest>=8"]

[project.entry-points."plinth.plugins"]
$name = "$pkg.plugin"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
'''

README = '''\
# $dist

A plinth $category plugin, `$name` (made by `platform plugins new $category $name`;
plinth plugin API $api).

    pip install -e ".[test]"          # add runtime where the vendor libraries are: ".[test,runtime]"
    platform plugins                  # lists $name, and why it is unavailable
    platform plugins check .          # the conformance kit on this machine: a report to publish
    pytest                            # the same kit as tests

## To do

The methods below raise `NotImplementedError`; their docstrings are the
contract. While one is left, `platform plugins` shows the plugin as
unavailable ("not implemented yet: ...") and the checks fail naming it.

$todo

docs/plugins.md in the plinth repository has the contract of each category
and a walk-through.
'''

INIT = '''\
"""$dist: a plinth $category plugin."""
'''

COMMON = {
    "pyproject.toml": PYPROJECT,
    "README.md": README,
    "src/$pkg/__init__.py": INIT,
}


# ---------------------------------------------------------------------------
# accelerator
# ---------------------------------------------------------------------------

ACCELERATOR_IMPL = '''\
"""The $name accelerator: a device platform for plinth (`--device $name`).

`check` must stay cheap and import no vendor runtime; the other methods run
after the plugin was chosen and may import it.
"""

from __future__ import annotations

from typing import Any, Mapping

from plinth.api import Accelerator, AcceleratorInfo, SelectionContext


class ${Cls}Accelerator(Accelerator):
    #: the torch device type your runtime registers (PyTorch's PrivateUse1 name, or "cuda", "xpu", "cpu", ...)
    device_type = "$ident"
    #: the torch.distributed backend its collectives register as ("nccl", "hccl", "gloo", ...)
    dist_backend = "gloo"

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        """Why $name cannot run here, one sentence a user can act on each
        ("torch_$ident is not installed (pip install '$dist[runtime]')", "no
        $name device is visible"); empty means it can. Probe without importing
        the runtime: importlib.util.find_spec, device nodes, environment."""
        return []

    def info(self) -> AcceleratorInfo:
        """What `platform plugins` and the engine learn of the device: an
        AcceleratorInfo(device_type=..., dist_backend=... (as above),
        device_count, device_name, capability, fp8 ("native", "weight_only" or
        "none"), memory_total of device 0, dtypes (torch names) with
        default_dtype among them, isa, preferred_backends)."""
        raise NotImplementedError("${Cls}Accelerator.info(): not implemented yet (return an AcceleratorInfo)")

    def memory(self, index: int = 0) -> tuple[int, int]:
        """(free, total) bytes of device `index`, 0 < free <= total: it sizes the KV page pool."""
        raise NotImplementedError("${Cls}Accelerator.memory(): not implemented yet (return (free, total) bytes)")

    def init_process(self, *, local_rank: int, options: Mapping[str, Any]) -> None:
        """Once in each process before the model loads: bind device `local_rank`,
        set threads. `options` holds the parsed CLI options (your own too)."""

    def synchronize(self) -> None:
        """Wait for the device's queued work (benchmarks and timing use it)."""
'''

ACCELERATOR_TEST = '''\
"""$name against the conformance kit: registration, a cheap entry point,
and (where $name is available) the device checks."""

from plinth.testing import AcceleratorConformance


class TestConformance(AcceleratorConformance):
    name = "$name"
    # set PLINTH_REQUIRE_ACCELERATORS=$name on a machine with the device, so
    # that "unavailable" fails there instead of skipping
'''


# ---------------------------------------------------------------------------
# a2a
# ---------------------------------------------------------------------------

A2A_IMPL = '''\
"""The $name MoE all-to-all (`--a2a $name`): dispatch tokens to the ranks
that own their experts, combine the experts' outputs back.

Rank r of the group owns the global experts `expert_ranges(E, size)[r]`.
Every rank calls dispatch and combine the same number of times in the same
order (a rank without tokens passes empty tensors), and chooses kernels only
from `decode` and sizes fixed at construction, never from local data alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plinth.api import AllToAll, DispatchedTokens, SelectionContext

if TYPE_CHECKING:
    import torch


class ${Cls}AllToAll(AllToAll):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        """Every reason it cannot run the planned layout (`ctx.layout`, a
        PlannedLayout: world, ep, device type, hidden size, experts, top-k;
        None in `platform plugins`). Imports no vendor library."""
        return []

    def __init__(self, ctx: SelectionContext, *, group: Any, num_experts: int, hidden_size: int) -> None:
        super().__init__(ctx, group=group, num_experts=num_experts, hidden_size=hidden_size)
        # import the vendor library here; refuse (raise) what it cannot split

    def reserve_buffers(self) -> int:
        """Allocate the communication buffers (every rank together, before
        the weights load) and return their device bytes."""
        return 0

    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, decode: bool
    ) -> tuple[DispatchedTokens, Any]:
        """hidden [T, H], topk_ids [T, K] global expert ids, topk_weights [T, K]
        -> (DispatchedTokens("flat", x [N, H], counts [E_local], local topk_ids
        with -1 for other ranks' experts, topk_weights), a handle for combine)
        or the "padded" layout [E_local, M, H] (docs/plugins.md, "Writing an
        a2a plugin")."""
        raise NotImplementedError("${Cls}AllToAll.dispatch(): not implemented yet (send tokens to their experts' ranks)")

    def combine(self, expert_out: torch.Tensor, handle: Any) -> torch.Tensor:
        """The experts' output in dispatch's layout -> [T, H] for this rank's
        tokens: the sum over top-k of weight x expert output, in expert_out's dtype."""
        raise NotImplementedError("${Cls}AllToAll.combine(): not implemented yet (bring the outputs back and sum them)")
'''

A2A_TEST = '''\
"""$name against the conformance kit: registration, a cheap entry point, and
dispatch/combine round trips on real processes (gloo on CPU)."""

from plinth.testing import A2AConformance


class TestConformance(A2AConformance):
    name = "$name"
    worlds = (2,)  # group sizes to run; add 4 where the machine has the ranks
'''


# ---------------------------------------------------------------------------
# kv_connector
# ---------------------------------------------------------------------------

KV_IMPL = '''\
"""The $name KV connector (`--kv-connector $name`): plain blocking calls on
bytes. The core runs them on its own threads under a deadline, builds the
keys, writes and checks a header on every value and keeps the counters: a
connector never returns bytes it is not sure of (a miss is always safe)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from plinth.api import KVConnector, KVLayout, SelectionContext

if TYPE_CHECKING:
    import torch


class ${Cls}Connector(KVConnector):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        """Why it cannot run here (a missing client library), without importing it."""
        return []

    def __init__(self, ctx: SelectionContext, *, config: Mapping[str, Any], layout: KVLayout) -> None:
        super().__init__(ctx, config=config, layout=layout)
        # read your options from self.config (--kv-connector-config); connect lazily if connecting can block

    def lookup(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, the store holds."""
        raise NotImplementedError("${Cls}Connector.lookup(): not implemented yet (count the leading keys stored)")

    def load(self, keys: Sequence[str], buffers: Sequence[torch.Tensor]) -> Sequence[int]:
        """Read keys[i]'s value into buffers[i] (a uint8 CPU tensor of
        layout.value_bytes); per key the bytes read, <= 0 for a miss."""
        raise NotImplementedError("${Cls}Connector.load(): not implemented yet (read each value into its buffer)")

    def save(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> None:
        """Store each value (a uint8 CPU tensor the core reuses: copy it) under its key; raise on failure."""
        raise NotImplementedError("${Cls}Connector.save(): not implemented yet (store each value under its key)")

    def health(self) -> tuple[bool, str]:
        """(reachable, why not): the circuit breaker's probe; may try to reconnect."""
        return True, "ok"
'''

KV_TEST = '''\
"""$name against the conformance kit: save, lookup and load round trips
through the core's KVTransfer; corrupt, truncated and foreign values missed;
a store that raises or stalls never stalls the caller."""

from typing import Any

from plinth.testing import KVConnectorConformance


class TestConformance(KVConnectorConformance):
    name = "$name"

    def connector_config(self) -> dict[str, Any]:
        return {}  # what --kv-connector-config would hold to reach a test store
'''


# ---------------------------------------------------------------------------
# proposer
# ---------------------------------------------------------------------------

PROPOSER_IMPL = '''\
"""The $name proposer (`--speculative-method $name`): up to k tokens per
sequence and step, which the target model verifies in one forward. It
changes speed, never output: propose greedy picks, never samples."""

from __future__ import annotations

from typing import Sequence

from plinth.api import ProposeItem, Proposer, SelectionContext


class ${Cls}Proposer(Proposer):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        """What is missing ("--speculative-model is required"); ctx.speculative
        (a ProposerContext) is None in `platform plugins`."""
        return []

    # built once at start-up; self.spec is the ProposerContext: k, the target's
    # config and tokenizer, build_draft_runner(path) for a draft model

    def propose(self, items: Sequence[ProposeItem]) -> list[list[int]]:
        """Per item, at most item.k token ids (in the vocabulary) to follow
        item.token_ids; called once per step on the engine thread."""
        raise NotImplementedError("${Cls}Proposer.propose(): not implemented yet (up to item.k greedy ids per item)")

    def free(self, key: int) -> None:
        """Sequence `key` ended: drop what you keep for it."""
'''

PROPOSER_TEST = '''\
"""$name against the conformance kit: proposals over growing, rolled-back and
repeated sequences from a proposer built as the engine builds it."""

from plinth.testing import ProposerConformance


class TestConformance(ProposerConformance):
    name = "$name"
'''


# ---------------------------------------------------------------------------
# parser (a tool-call parser and a reasoning parser: a model family's formats)
# ---------------------------------------------------------------------------

PARSER_IMPL = '''\
"""The $name parsers (`--tool-call-parser $name`, `--reasoning-parser $name`):
structured tool calls and reasoning out of the model's raw text. Each is a
pure function of the text so far; the server streams by diffing successive
views. plinth.api has partial-JSON helpers (read_json_call, held_back, ...)."""

from __future__ import annotations

from typing import ClassVar

from plinth.api import ReasoningParse, ReasoningParser, ToolParse, ToolParser


class ${Cls}ToolParser(ToolParser):
    #: outputs in this format, each with a well-formed call: the conformance kit parses them
    #: (put your model's real format here)
    examples: ClassVar[tuple[str, ...]] = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    )

    def parse(self, text: str, *, final: bool) -> ToolParse:
        """final=True: every call complete, named, with JSON-object arguments;
        a malformed call stays in content as written; never raises.
        final=False: content only what is certainly answer text (hold back a
        possible start of a marker); a call appears once its name is complete
        and its arguments only grow."""
        raise NotImplementedError("${Cls}ToolParser.parse(): not implemented yet (read the calls out of text)")


class ${Cls}ReasoningParser(ReasoningParser):
    #: (prompt, output) pairs with reasoning in this format, for the conformance kit
    examples: ClassVar[tuple[tuple[str, str], ...]] = (("", "<think>the user wants a greeting</think>Hello!"),)

    def parse(self, text: str, *, final: bool) -> ReasoningParse:
        """Split reasoning from the answer (self.prompt: the rendered prompt,
        for templates that open the block there); streaming: hold back a
        possible start of a tag, both parts only grow."""
        raise NotImplementedError("${Cls}ReasoningParser.parse(): not implemented yet (split reasoning from answer)")
'''

PARSER_TEST = '''\
"""$name against the conformance kit, on the parsers' own examples: whole
and streamed one character at a time, plus noise that must never raise."""

from plinth.testing import ReasoningParserConformance, ToolParserConformance


class TestToolParser(ToolParserConformance):
    name = "$name"


class TestReasoningParser(ReasoningParserConformance):
    name = "$name"
'''


# ---------------------------------------------------------------------------
# backend (its compute ops and its paged attention)
# ---------------------------------------------------------------------------

BACKEND_IMPL = """\
\"\"\"The $name backend (`--backend $name`): compute ops and paged attention.

An op it does not bring is the reference backend's (torch): bring only the
ops your kernels make faster, and delete the others from `ops()` and this
file. An op it has but cannot run in a context (a dtype, an instruction set)
is declined in `unsupported_ops` with why. Each op must give the reference's
numbers (the conformance kit compares them); its signature is the one in
plinth.api.OP_SIGNATURES (checked at start-up).
\"\"\"

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from plinth.api import AttentionBackend, Backend, QuantizedWeight, SelectionContext

if TYPE_CHECKING:
    import torch


class ${Cls}Backend(Backend):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        \"\"\"Why the whole backend cannot run in `ctx` (its library missing, the
        accelerator's device type `ctx.accelerator.device_type`, the dtype), a
        sentence a user can act on each. Cheap: no vendor library imported.\"\"\"
        return []

    @classmethod
    def unsupported_ops(cls, ctx: SelectionContext) -> Mapping[str, str]:
        \"\"\"Ops it has but cannot run for `ctx`, each with why; `ops()` leaves them out.\"\"\"
        return {}

    @classmethod
    def attention_backend(cls, ctx: SelectionContext) -> type[AttentionBackend[Any]] | None:
        \"\"\"Its paged attention (attention.py); return None to run the reference's.\"\"\"
        from $pkg.attention import ${Cls}Attention

        return ${Cls}Attention

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        \"\"\"The ops it brings for `self.ctx` (less those `unsupported_ops` declines).\"\"\"
        ops: dict[str, Callable[..., Any]] = {
            "rms_norm": self.rms_norm,
            "pack_linear": self.pack_linear,
            "linear": self.linear,
            "silu_and_mul": self.silu_and_mul,
            "rotary": self.rotary,
            "fused_moe": self.fused_moe,
        }
        declined = self.unsupported_ops(self.ctx)
        return {name: op for name, op in ops.items() if name not in declined}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None) -> Any:
        \"\"\"x * rsqrt(mean(x^2) + eps) * weight, in float32 inside; with
        `residual`: (norm(x + residual), x + residual).\"\"\"
        raise NotImplementedError("${Cls}Backend.rms_norm(): not implemented yet (or delete it: the reference's runs)")

    def pack_linear(self, weight: torch.Tensor | QuantizedWeight) -> Any:
        \"\"\"A weight [out, in] (or a QuantizedWeight in a format `capabilities`
        declares) once at load, into whatever `linear` takes.\"\"\"
        raise NotImplementedError("${Cls}Backend.pack_linear(): not implemented yet (or delete it with linear)")

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        \"\"\"x [T, in] @ W^T (+ bias) -> [T, out], W as `pack_linear` made it.\"\"\"
        raise NotImplementedError("${Cls}Backend.linear(): not implemented yet (or delete it with pack_linear)")

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        \"\"\"x [T, 2N] -> silu(x[:, :N]) * x[:, N:].\"\"\"
        raise NotImplementedError("${Cls}Backend.silu_and_mul(): not implemented yet (or delete it)")

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        \"\"\"q [T, Hq, D], k [T, Hk, D] rotated at `positions` by the table
        cos_sin [max_pos, rotary_dim] (cos halves then sin halves); neox: halves, else pairs.\"\"\"
        raise NotImplementedError("${Cls}Backend.rotary(): not implemented yet (or delete it)")

    def fused_moe(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        \"\"\"Per token, sum over its top-k of weight x w2[e] @ silu_and_mul(w13[e] @ x);
        ids outside 0..E-1 (other ranks' experts) add nothing.\"\"\"
        raise NotImplementedError("${Cls}Backend.fused_moe(): not implemented yet (or delete it)")
"""

BACKEND_ATTENTION = """\
\"\"\"The $name paged attention: the KV page layout it reads, the plan it
builds once per step from the engine's metadata, and the attention itself.
Imported when the backend is chosen (or asked for its attention backend):
import your kernels inside the methods, not at the top.\"\"\"

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plinth.api import HEADS_FIRST, AttentionBackend, AttentionMetadata, AttentionPlan, PageSizes, SelectionContext

if TYPE_CHECKING:
    import torch


@dataclass
class ${Cls}Plan(AttentionPlan):
    \"\"\"What `build_plan` makes of one step's metadata for your kernels
    (int32 block tables, cumulative query lengths, ...): built once per step,
    read by every layer as `meta.plan`.\"\"\"

    num_tokens: int


class ${Cls}Attention(AttentionBackend[${Cls}Plan]):
    #: the order of a page tensor's dimensions (HEADS_FIRST: [heads, pages, page_size, dim]; or PAGES_FIRST)
    layout = HEADS_FIRST
    #: the page sizes your kernels take (PageSizes(minimum=16, power_of_two=True), ...)
    page_sizes = PageSizes()
    #: the page (compute) dtypes they take
    dtypes = ("float32", "bfloat16")
    plan_type = ${Cls}Plan

    @classmethod
    def problems(cls, ctx: SelectionContext) -> list[str]:
        \"\"\"Why it declines `ctx`: the page size and dtype (the base checks
        those), plus what your kernels lack (ctx.model.sliding_window,
        attn_logit_softcap, deterministic mode ...).\"\"\"
        return super().problems(ctx)

    def build_plan(self, meta: AttentionMetadata) -> ${Cls}Plan:
        \"\"\"This step's plan, from the host-side lengths (meta.query_lens_cpu,
        meta.seq_lens_cpu) and the device tensors (block_tables, slot_mapping,
        query_start_loc, seq_lens, positions); no device sync.\"\"\"
        raise NotImplementedError("${Cls}Attention.build_plan(): not implemented yet (a ${Cls}Plan from meta)")

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, meta: AttentionMetadata, *,
        scale: float, sliding_window: int | None = None, logit_cap: float | None = None,
    ) -> torch.Tensor:
        \"\"\"out [T, Hq, Dv]: write k, v [T, Hkv, D] into kv_cache (this layer's
        (k_pages, v_pages), laid out as `layout`) at meta.slot_mapping, then
        attend causally over each sequence's pages (self.plan(meta) is the step's plan).\"\"\"
        raise NotImplementedError("${Cls}Attention.forward(): not implemented yet (write k and v, attend over the pages)")
"""

BACKEND_TEST = """\
\"\"\"$name against the conformance kit: every op it brings and its attention
against the reference backend's, on random inputs, on the chosen
accelerator's device (`auto`: the best available).\"\"\"

from plinth.testing import BackendConformance


class TestConformance(BackendConformance):
    name = "$name"
    dtypes = ("float32", "bfloat16")  # the dtypes to compare in
    page_sizes = (16, 7)  # the page sizes attention is checked at (those your kernels take)
"""

# ---------------------------------------------------------------------------
# model (a model loader: the architectures it builds)
# ---------------------------------------------------------------------------

MODEL_LOADER = """\
\"\"\"The $name model loader: the config, tokenizer and weights of a
checkpoint into a model whose layers call the backend's ops.

plinth.api.CheckpointLoader reads config.json (or GGUF metadata through
`gguf_config`), the tokenizer and the special tokens; the modelling kit in
plinth.api has rope tables (rope_from_hf, rope_tables), checkpoint name maps
(NameMap, HF_DECODER_TOP, HF_DECODER_LAYER, sort_tensors), FP8 blocks and
decoder scaffolding (decoder_shape_from_hf, LayerWeights, output_head).
\"\"\"

from __future__ import annotations

from typing import Any

from plinth.api import CheckpointLoader, LoadContext, ModelConfig, ModelSource


class ${Cls}Loader(CheckpointLoader):
    def load_config(self, source: ModelSource) -> ModelConfig:
        \"\"\"The model's sizes: `self.model_config(source, cfg, architecture=...,
        vocab_size=..., hidden_size=..., num_layers=..., num_heads=...,
        num_kv_heads=..., head_dim=..., max_model_len=...)` with
        `cfg = self.hf_config(source)` (decoder_shape_from_hf(cfg) reads a
        Llama-like config).\"\"\"
        raise NotImplementedError("${Cls}Loader.load_config(): not implemented yet (a ModelConfig from self.hf_config(source))")

    def load_model(self, source: ModelSource, config: ModelConfig, ctx: LoadContext) -> Any:
        \"\"\"A torch.nn.Module with forward, compute_logits, weight_bytes and
        kv_cache_specs (model.py), its weights read (plinth.api.iter_safetensors
        or GGUFFile) onto ctx.device in ctx.dtype, each linear weight packed
        once with ctx.ops.pack_linear.\"\"\"
        raise NotImplementedError("${Cls}Loader.load_model(): not implemented yet (build ${Cls}Model, load its weights)")
"""

MODEL_MODULE = """\
\"\"\"The $name model: what `${Cls}Loader.load_model` builds. Layers call only
the backend's ops (ctx.ops: rms_norm, linear, silu_and_mul, rotary) and its
attention (ctx.attention.forward) over their pages.\"\"\"

from __future__ import annotations

from typing import Any

import torch
from plinth.api import AttentionMetadata, KVCacheSpec, LoadContext, ModelConfig


class ${Cls}Model(torch.nn.Module):
    def __init__(self, config: ModelConfig, ctx: LoadContext) -> None:
        super().__init__()
        self.config, self.ctx = config, ctx

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Any], meta: AttentionMetadata) -> torch.Tensor:
        \"\"\"input_ids [T], positions [T] -> hidden [T, hidden_size]; layer i
        attends with self.ctx.attention over kv_caches[i] and meta.for_layer(i).\"\"\"
        raise NotImplementedError("${Cls}Model.forward(): not implemented yet")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        \"\"\"hidden [N, hidden_size] -> logits [N, vocab] in float32.\"\"\"
        raise NotImplementedError("${Cls}Model.compute_logits(): not implemented yet")

    def weight_bytes(self, *, per_token: bool = False) -> int:
        \"\"\"Bytes its weights take on the device (each shared tensor once); per_token: what one decode step reads.\"\"\"
        raise NotImplementedError("${Cls}Model.weight_bytes(): not implemented yet")

    def kv_cache_specs(self) -> list[KVCacheSpec | None]:
        \"\"\"Per layer, what it caches on this rank (FullAttentionSpec(...),
        SlidingWindowSpec(...)) or None: the core sizes and groups the pages from these.\"\"\"
        raise NotImplementedError("${Cls}Model.kv_cache_specs(): not implemented yet")
"""

MODEL_TEST = """\
\"\"\"$name against the conformance kit: a model built from a small
checkpoint computes through the paged KV cache (chunked prefill and decode
give the logits of one whole prefill).\"\"\"

from plinth.testing import ModelLoaderConformance


class TestConformance(ModelLoaderConformance):
    name = "$name"
    tokenizer = False  # True once model_path() has tokenizer files

    def model_path(self) -> str:
        \"\"\"A small checkpoint (a folder with config.json and safetensors) of an
        architecture the descriptor names: for one transformers knows,
        plinth.testing.save_random_model(config, folder, seed=0) writes one.\"\"\"
        raise NotImplementedError("model_path(): not implemented yet (return a small ${Cls}ForCausalLM checkpoint)")
"""

KINDS: dict[str, Kind] = {
    "accelerator": Kind(
        "accelerator", "an accelerator plugin (a device platform, `--device`)", "accelerator", True,
        ("`${Cls}Accelerator.info()` in src/$pkg/accelerator.py", "`${Cls}Accelerator.memory()`",
         "`check()`: the reasons it cannot run here (it says none yet)", "`device_type` and `dist_backend`"),
        (Registration(
            "plinth_register_accelerators", "AcceleratorDescriptor", "${Cls}Accelerator", "$name devices",
            "# `--device auto` takes the highest priority that can run: cuda 100, ascend 90, tpu 80, xpu 70, cpu 0\n"
            "priority=50,",
        ),),
        {"src/$pkg/accelerator.py": ACCELERATOR_IMPL, "tests/test_conformance.py": ACCELERATOR_TEST},
    ),
    "backend": Kind(
        "backend", "a backend plugin (compute ops and paged attention, `--backend`)", "backend", True,
        ("the ops in src/$pkg/backend.py you bring, e.g. `${Cls}Backend.rms_norm()`; delete the others (the reference's run)",
         "`${Cls}Attention.build_plan()` in src/$pkg/attention.py", "`${Cls}Attention.forward()`, or return None from "
         "`attention_backend()` to run the reference's attention"),
        (Registration(
            "plinth_register_backends", "BackendDescriptor", "${Cls}Backend", "$name kernels",
            "# `--backend auto` tries the accelerator's preferred_backends first, then priority\npriority=0,",
        ),),
        {"src/$pkg/backend.py": BACKEND_IMPL, "src/$pkg/attention.py": BACKEND_ATTENTION, "tests/test_conformance.py": BACKEND_TEST},
    ),
    "model": Kind(
        "model", "a model plugin (a loader for the architectures it names)", "loader", True,
        ("`${Cls}Loader.load_config()` in src/$pkg/loader.py", "`${Cls}Loader.load_model()`",
         "`${Cls}Model`'s methods in src/$pkg/model.py", "`model_path()` in tests/test_conformance.py"),
        (Registration(
            "plinth_register_model_loaders", "ModelDescriptor", "${Cls}Loader", "$name models",
            fields=("# config.json's \"architectures\" and GGUF's general.architecture it builds",
                    'architectures=("${Cls}ForCausalLM",),', "gguf_architectures=(),"),
        ),),
        {"src/$pkg/loader.py": MODEL_LOADER, "src/$pkg/model.py": MODEL_MODULE, "tests/test_conformance.py": MODEL_TEST},
    ),
    "a2a": Kind(
        "a2a", "an MoE all-to-all plugin (`--a2a`)", "a2a", True,
        ("`${Cls}AllToAll.dispatch()` in src/$pkg/a2a.py", "`${Cls}AllToAll.combine()`"),
        (Registration("plinth_register_a2a", "A2ADescriptor", "${Cls}AllToAll", "$name MoE all-to-all"),),
        {"src/$pkg/a2a.py": A2A_IMPL, "tests/test_conformance.py": A2A_TEST},
    ),
    "kv_connector": Kind(
        "kv_connector", "a KV connector plugin (`--kv-connector`)", "connector", True,
        ("`${Cls}Connector.lookup()` in src/$pkg/connector.py", "`${Cls}Connector.load()`", "`${Cls}Connector.save()`"),
        (Registration("plinth_register_kv_connectors", "KVConnectorDescriptor", "${Cls}Connector", "KV pages in the $name store"),),
        {"src/$pkg/connector.py": KV_IMPL, "tests/test_conformance.py": KV_TEST},
    ),
    "proposer": Kind(
        "proposer", "a speculative-decoding proposer plugin (`--speculative-method`)", "proposer", False,
        ("`${Cls}Proposer.propose()` in src/$pkg/proposer.py",),
        (Registration("plinth_register_proposers", "ProposerDescriptor", "${Cls}Proposer", "$name speculative proposals"),),
        {"src/$pkg/proposer.py": PROPOSER_IMPL, "tests/test_conformance.py": PROPOSER_TEST},
    ),
    "parser": Kind(
        "parser", "tool-call and reasoning parsers (`--tool-call-parser`, `--reasoning-parser`)", "parsers", False,
        ("`${Cls}ToolParser.parse()` in src/$pkg/parsers.py, and its `examples`",
         "`${Cls}ReasoningParser.parse()`, and its `examples`"),
        (
            Registration(
                "plinth_register_tool_parsers", "ToolParserDescriptor", "${Cls}ToolParser", "$name tool calls",
                fields=("# strings whose presence in a chat template picks this parser under `auto`", "template_markers=(),"),
            ),
            Registration(
                "plinth_register_reasoning_parsers", "ReasoningParserDescriptor", "${Cls}ReasoningParser", "$name reasoning",
                fields=("template_markers=(),",),
            ),
        ),
        {"src/$pkg/parsers.py": PARSER_IMPL, "tests/test_conformance.py": PARSER_TEST},
    ),
}  # fmt: skip
