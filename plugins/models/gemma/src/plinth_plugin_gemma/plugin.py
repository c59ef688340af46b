"""Entry point: registers the Gemma 3 loader and the named models it can
serve; imports nothing heavy (no torch)."""

from plinth.api import ModelDescriptor, hookimpl


@hookimpl
def plinth_register_model_loaders():
    return [
        ModelDescriptor(
            name="gemma",
            impl="plinth_plugin_gemma.loader:GemmaLoader",
            architectures=("Gemma3ForCausalLM",),
            gguf_architectures=("gemma3",),
            named_models=(("gemma3-270m", "plinth_plugin_gemma.files:gemma3_270m"),),
            description="Gemma 3 text (interleaved sliding-window and global attention; safetensors or GGUF)",
        )
    ]
