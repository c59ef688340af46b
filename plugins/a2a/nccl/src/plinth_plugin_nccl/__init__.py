"""plinth a2a plugin `nccl`: torch.distributed all_to_all_single."""
