"""The OpenAI- and Anthropic-compatible HTTP server."""
