"""plinth KV connector ``local``: CPU memory, then disk."""
