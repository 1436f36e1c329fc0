"""The Roundhouse router: HTTP, auth, the model catalog and engine lifecycles.

It never imports torch, cupy, engine/ or kernels/ (tests/test_layering.py).
"""
