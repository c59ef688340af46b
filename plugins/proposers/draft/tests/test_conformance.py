"""The draft proposer against plinth's conformance kit: registration, a cheap
entry point, and proposals from a proposer built as the engine builds it."""

from plinth.testing import ProposerConformance


class TestConformance(ProposerConformance):
    name = "draft"
