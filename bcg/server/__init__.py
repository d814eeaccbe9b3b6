"""OpenAI-compatible HTTP server over one `LLMEngine` (`bcg serve`)."""
