"""llama.cpp's /metrics series (its server README) and their types: what a
Roundhouse /metrics must export under the same names."""

LLAMACPP_TYPES = {
    "llamacpp:prompt_tokens_total": "counter",
    "llamacpp:prompt_seconds_total": "counter",
    "llamacpp:prompt_tokens_cached_total": "counter",
    "llamacpp:tokens_predicted_total": "counter",
    "llamacpp:tokens_predicted_seconds_total": "counter",
    "llamacpp:prompt_tokens_seconds": "gauge",
    "llamacpp:predicted_tokens_seconds": "gauge",
    "llamacpp:n_decode_total": "counter",
    "llamacpp:n_busy_slots_per_decode": "gauge",
    "llamacpp:kv_cache_usage_ratio": "gauge",
    "llamacpp:kv_cache_tokens": "gauge",
    "llamacpp:requests_processing": "gauge",
    "llamacpp:requests_deferred": "gauge",
}
