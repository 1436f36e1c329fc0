"""One assistant turn, shared by every chat-shaped API (OpenAI Chat
Completions, Anthropic Messages, OpenAI Responses): prompt rendering with
tools and thinking, generation, and the typed events its output is split into
(reasoning, content, tool calls)."""
