"""plinth backend plugin for CPUs: pre-packed GEMMs, GGUF kernels on the quantized blocks and a paged attention kernel."""
