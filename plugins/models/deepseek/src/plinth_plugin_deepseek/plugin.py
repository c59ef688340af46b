"""Entry point: registers the DeepSeek-V3 loader and the tool-call and
reasoning parsers of the models it serves (DeepSeek-V3/R1, Kimi K2); imports
nothing heavy (no torch)."""

from plinth.api import ModelDescriptor, ReasoningParserDescriptor, ToolParserDescriptor, hookimpl

_PARSERS = "plinth_plugin_deepseek.parsers"


@hookimpl
def plinth_register_model_loaders():
    return [
        ModelDescriptor(
            name="deepseek",
            impl="plinth_plugin_deepseek.loader:DeepseekLoader",
            architectures=("DeepseekV3ForCausalLM",),
            description="DeepSeek-V3 / R1, Kimi K2: MLA over a paged latent KV cache, grouped top-k MoE with shared experts (safetensors)",
        )
    ]


@hookimpl
def plinth_register_tool_parsers():
    # template_markers: what the chat template of a model that writes calls
    # this way contains (`--tool-call-parser auto` matches them)
    return [
        ToolParserDescriptor(
            name="deepseek_v3",
            impl=f"{_PARSERS}:DeepSeekV3ToolParser",
            priority=10,
            template_markers=("<｜tool▁calls▁begin｜>",),
            description="<｜tool▁call▁begin｜>...<｜tool▁call▁end｜> (DeepSeek-V3, V3.1, R1)",
        ),
        ToolParserDescriptor(
            name="kimi_k2",
            impl=f"{_PARSERS}:KimiK2ToolParser",
            priority=10,
            template_markers=("<|tool_calls_section_begin|>",),
            description="<|tool_call_begin|>functions.name:i<|tool_call_argument_begin|>{...} (Kimi K2)",
        ),
    ]


@hookimpl
def plinth_register_reasoning_parsers():
    return [
        ReasoningParserDescriptor(
            name="deepseek_r1",
            impl=f"{_PARSERS}:DeepSeekR1ReasoningParser",
            description="reasoning until </think>, <think> optional (DeepSeek-R1)",
        ),
    ]
