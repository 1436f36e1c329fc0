"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on
the shared chat-turn layer (router/chat/), so the Anthropic SDK, Claude Code
and Qwen Code work with the server root as their base URL."""
