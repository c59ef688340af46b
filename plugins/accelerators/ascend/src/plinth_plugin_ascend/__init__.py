"""plinth accelerator plugin for Huawei Ascend NPUs (torch_npu + dlinfer, HCCL)."""
