from plinth.testing import BackendConformance


class TestConformance(BackendConformance):
    name = "cpukernels"
