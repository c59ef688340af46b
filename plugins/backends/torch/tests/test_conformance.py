from plinth.testing import BackendConformance


class TestConformance(BackendConformance):
    """The reference against itself: the kit's own plumbing, and registration."""

    name = "torch"
