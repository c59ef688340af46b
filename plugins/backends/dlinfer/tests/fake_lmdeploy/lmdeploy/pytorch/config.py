"""lmdeploy/pytorch/config.py: BackendConfig, CacheConfig, ModelConfig."""


class BackendConfig:
    pass


class CacheConfig:
    pass


class ModelConfig:
    pass
