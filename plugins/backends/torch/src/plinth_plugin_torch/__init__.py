"""plinth's reference backend: every op in plain PyTorch, on any torch device."""
