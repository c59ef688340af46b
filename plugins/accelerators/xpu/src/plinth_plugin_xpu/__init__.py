"""plinth accelerator plugin for Intel GPUs (torch.xpu, XCCL)."""
