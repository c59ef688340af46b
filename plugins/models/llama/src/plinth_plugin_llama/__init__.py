"""plinth model plugin: dense Llama-family decoders."""
