"""The engine process shell: what turns `python -m engine ...` into a serving engine.

`main` parses the arguments the router's supervisor passes, connects the two
ZMQ socket threads (`ipc`), ties the process's life to the router's
(`parent_watch`), has `bootstrap` build the engine (model, KV pool, runner,
scheduler, busy loop) and hands the busy loop its command queue. Nothing here
runs per step.
"""
