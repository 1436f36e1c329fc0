"""OpenAI-compatible endpoints: Chat Completions, Completions, Models."""
