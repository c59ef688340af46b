"""What a model's layers cache (vLLM's ``KVCacheSpec``s): the model loader
describes each layer's cache and the KV-cache manager groups layers with equal
specs. The spec types land here (issue 18, item 3)."""
