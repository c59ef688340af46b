"""Entry point: registers the DeepSeek-V3 loader; imports nothing heavy (no torch)."""

from plinth.api import ModelDescriptor, hookimpl


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
