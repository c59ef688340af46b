"""mychip against the conformance kit: registration, a cheap entry point,
and (where mychip is available) the device checks."""

from plinth.testing import AcceleratorConformance


class TestConformance(AcceleratorConformance):
    name = "mychip"
    require_available = True  # the host CPU: every Linux machine has one, so the device checks never skip
