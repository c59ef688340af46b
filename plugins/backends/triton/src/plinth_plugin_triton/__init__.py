"""plinth backend plugin: Triton kernels."""
