"""plinth model plugin: Gemma 3."""
