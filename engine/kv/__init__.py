"""KV cache bookkeeping: pages, reference counts and the prefix cache.

Pure Python (no torch): the tensors live in the model runner; this package
decides which page holds which tokens (`block_pool`, `block_hash`,
`kv_manager`) and how many pages the pool gets (`kv_sizing`).
"""
