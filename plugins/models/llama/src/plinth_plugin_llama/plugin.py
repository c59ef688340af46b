"""Entry point: registers the loader and the tool-call / reasoning parsers of
the families it serves (DeepSeek's and Kimi's are the deepseek plugin's);
imports nothing heavy (no torch)."""

from plinth.api import ModelDescriptor, ReasoningParserDescriptor, ToolParserDescriptor, hookimpl

_PARSERS = "plinth_plugin_llama.parsers"


@hookimpl
def plinth_register_model_loaders():
    return [
        ModelDescriptor(
            name="llama",
            impl="plinth_plugin_llama.loader:LlamaLoader",
            architectures=(
                "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
            ),
            gguf_architectures=("llama", "qwen2", "qwen3"),
            description="Llama family: Llama 2/3, Qwen2/2.5, Qwen3, Mistral, SmolLM (safetensors or GGUF); MoE: Mixtral, Qwen2-MoE, Qwen3-MoE",
        )
    ]


@hookimpl
def plinth_register_tool_parsers():
    # template_markers: what the chat template of a model that writes calls
    # this way contains (`--tool-call-parser auto` matches them)
    return [
        ToolParserDescriptor(
            name="hermes",
            impl=f"{_PARSERS}:HermesToolParser",
            priority=10,
            template_markers=("<tool_call>",),
            description="<tool_call>{json}</tool_call> (Hermes, Qwen2.5, Qwen3)",
        ),
        ToolParserDescriptor(
            name="qwen",
            impl=f"{_PARSERS}:HermesToolParser",
            description="Qwen2.5 / Qwen3 tool calls (the hermes format)",
        ),
        ToolParserDescriptor(
            name="llama3_json",
            impl=f"{_PARSERS}:Llama3JsonToolParser",
            priority=5,
            template_markers=("<|python_tag|>", "respond with a JSON for a function call"),
            description='{"name", "parameters"} as the whole answer (Llama 3.1-3.3)',
        ),
        ToolParserDescriptor(
            name="mistral",
            impl=f"{_PARSERS}:MistralToolParser",
            priority=10,
            template_markers=("[TOOL_CALLS]",),
            description="[TOOL_CALLS][...] or [TOOL_CALLS]name[ARGS]{...} (Mistral)",
        ),
    ]


@hookimpl
def plinth_register_reasoning_parsers():
    return [
        ReasoningParserDescriptor(
            name="qwen3",
            impl=f"{_PARSERS}:ThinkReasoningParser",
            priority=10,
            template_markers=("<think>",),
            description="<think>...</think> when the output or the prompt opens it (Qwen3, QwQ, SmolLM3)",
        ),
    ]
