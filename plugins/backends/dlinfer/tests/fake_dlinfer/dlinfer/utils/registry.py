"""Upstream dlinfer/utils/registry.py:1-8."""


def register_ops(registry):
    def wrapped_func(ops_func):
        registry[ops_func.__name__] = ops_func
        return ops_func

    return wrapped_func
