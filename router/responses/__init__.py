"""OpenAI's Responses API (POST /v1/responses and friends), as Codex and the
openai SDK use it, on the shared assistant-turn layer (router/chat/).

request: schema.py (the body), items.py (input items), tools.py (function
tools and namespaces), history.py (items -> template messages),
request_map.py (the whole request -> ChatRequest)
answer:  output.py (parsed events -> output items and stream events),
response.py (the response object), generate.py (one response being made),
stream.py (server-sent events)
state:   store.py (bounded LRU of stored responses), pagination.py
HTTP:    handlers.py, routes.py (ROUTES)
"""
