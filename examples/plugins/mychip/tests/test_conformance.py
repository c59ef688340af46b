"""mychip against the conformance kit: registration, a cheap entry point,
and (where mychip is available) the device checks."""

from plinth.testing import AcceleratorConformance


class TestConformance(AcceleratorConformance):
    name = "mychip"
    # set PLINTH_REQUIRE_ACCELERATORS=mychip on a machine with the device, so
    # that "unavailable" fails there instead of skipping
