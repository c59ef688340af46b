"""plinth model plugin for DeepSeek-V3 (DeepseekV3ForCausalLM)."""
