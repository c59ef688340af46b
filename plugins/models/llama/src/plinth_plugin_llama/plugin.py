"""Entry point: registers the loader; imports nothing heavy (no torch)."""

from plinth.api import ModelDescriptor, hookimpl


@hookimpl
def plinth_register_model_loaders():
    return [
        ModelDescriptor(
            name="llama",
            impl="plinth_plugin_llama.loader:LlamaLoader",
            architectures=("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"),
            gguf_architectures=("llama", "qwen2", "qwen3"),
            description="dense Llama family: Llama 2/3, Qwen2/2.5, Qwen3, Mistral, SmolLM (safetensors or GGUF)",
        )
    ]
