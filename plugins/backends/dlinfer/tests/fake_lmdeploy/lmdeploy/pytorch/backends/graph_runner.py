"""lmdeploy/pytorch/backends/graph_runner.py: GraphRunner."""


class GraphRunner:
    pass
