"""The a2a conformance kit on 2 and 4 real processes over gloo."""

from plinth.testing import A2AConformance


class TestConformance(A2AConformance):
    name = "nccl"
    worlds = (2, 4)
