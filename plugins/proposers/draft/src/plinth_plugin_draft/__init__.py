"""plinth proposer plugin: a draft model."""
