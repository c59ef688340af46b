"""plinth proposer plugin: n-gram prompt lookup."""
