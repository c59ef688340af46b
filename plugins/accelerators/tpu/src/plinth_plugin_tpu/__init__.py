"""plinth accelerator plugin for Google TPUs (torch_xla)."""
