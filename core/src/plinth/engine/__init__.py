"""The engine: scheduler, paged KV block manager, prefix cache, sequences,
sampling and the model runner. Device-agnostic: it reaches devices and
kernels only through the plugins resolved at startup."""
