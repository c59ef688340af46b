"""plinth backend plugin: oneDNN pre-packed linear layers for CPUs."""
