"""plinth a2a plugin `deepep` (DeepEP); deep_ep is imported only when chosen."""
