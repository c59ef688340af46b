"""Upstream dlinfer/vendor/ascend/utils.py:10-43. The device name comes from
``torch.npu.get_device_name()`` upstream; the fake stands for an Atlas A2
(Ascend910B) so the Ascend910 branches run."""
from functools import lru_cache

FAKE_DEVICE_NAME = "Ascend910B1"
FAKE_SOC_VERSION = 220


class SocVersion:
    Ascend310P: str = "Ascend310P"
    Ascend910: str = "Ascend910"

    @classmethod
    def device_name(cls) -> str:
        return FAKE_DEVICE_NAME

    @classmethod
    def is_Ascend310P(cls) -> bool:
        return cls.device_name().startswith(cls.Ascend310P)

    @classmethod
    def is_Ascend910(cls) -> bool:
        return cls.device_name().startswith(cls.Ascend910)

    @classmethod
    def soc_version(cls) -> int:
        return FAKE_SOC_VERSION

    @classmethod
    def is_A2(cls) -> bool:
        return 220 <= cls.soc_version() <= 225

    @classmethod
    def is_A3(cls) -> bool:
        return 250 <= cls.soc_version() <= 255


@lru_cache(maxsize=1)
def get_cpu_seq_len(seq_len):
    return seq_len.cpu()
