"""Entry point: registers the backend; imports nothing but plinth.api."""

from plinth.api import BackendDescriptor, hookimpl


@hookimpl
def plinth_register_backends() -> list[BackendDescriptor]:
    return [
        BackendDescriptor(
            name="numpyops",
            impl="plinth_plugin_numpyops.backend:NumpyopsBackend",
            # `--backend auto` tries the accelerator's preferred_backends first, then priority
            priority=0,
            api=">=2.1,<3",
            description="numpyops: rms_norm, silu_and_mul and linear in numpy, float32 (an example)",
        )
    ]
