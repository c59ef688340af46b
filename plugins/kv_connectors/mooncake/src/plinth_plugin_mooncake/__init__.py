"""plinth KV connector ``mooncake``: Mooncake Store."""
