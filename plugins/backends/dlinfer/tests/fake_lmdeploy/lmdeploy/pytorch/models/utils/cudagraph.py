"""lmdeploy/pytorch/models/utils/cudagraph.py: CudaGraphMeta, CudaGraphMixin."""


class CudaGraphMeta:
    pass


class CudaGraphMixin:
    pass
