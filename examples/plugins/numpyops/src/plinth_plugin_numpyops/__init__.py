"""plinth-plugin-numpyops: a plinth backend plugin."""
