"""plinth accelerator plugin for the host CPU."""
