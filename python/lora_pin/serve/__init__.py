"""``lora-pin serve``: many adapters over HTTP on transformers' continuous-batching engine.

Needs the ``serve`` extra (transformers' pinned minor version, fastapi, uvicorn). The pieces:
:mod:`~lora_pin.serve.engine` (lora_pin inside the engine's scheduler), :mod:`~lora_pin.serve.naming`
(which adapter a request names), :mod:`~lora_pin.serve.adapters` (loads, unloads, pins at run time),
:mod:`~lora_pin.serve.metrics` and :mod:`~lora_pin.serve.app` (the HTTP endpoints); with the ``ray``
extra, :mod:`~lora_pin.serve.ray` runs N replicas of it on Ray Serve.
"""
