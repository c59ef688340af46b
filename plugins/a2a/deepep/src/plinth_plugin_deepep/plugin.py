"""Entry point: registers the `deepep` all-to-all; imports neither torch nor deep_ep."""

from plinth.api import A2ADescriptor, hookimpl


@hookimpl
def plinth_register_a2a():
    return [
        A2ADescriptor(
            name="deepep",
            impl="plinth_plugin_deepep.a2a:DeepEPAllToAll",
            priority=20,
            description="DeepEP: legacy Buffer (normal kernels for prefill, low-latency for decode) or V2 ElasticBuffer; CUDA SM90+",
        )
    ]
