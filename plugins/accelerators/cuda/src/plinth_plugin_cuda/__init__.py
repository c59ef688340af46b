"""plinth accelerator plugin for NVIDIA GPUs (torch.cuda, NCCL)."""
