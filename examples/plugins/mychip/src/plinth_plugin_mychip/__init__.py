"""plinth-plugin-mychip: a plinth accelerator plugin."""
