"""``lora-pin serve``: many adapters over HTTP on transformers' continuous-batching engine.

Needs the ``serve`` extra (transformers' pinned minor version, fastapi, uvicorn). The pieces:
:mod:`~lora_pin.serve.engine` (lora_pin inside the engine's scheduler), :mod:`~lora_pin.serve.naming`
(which adapter a request names), :mod:`~lora_pin.serve.adapters` (loads, unloads, pins at run time),
:mod:`~lora_pin.serve.metrics` and :mod:`~lora_pin.serve.app` (the HTTP endpoints); with the ``ray``
extra, :mod:`~lora_pin.serve.ray` runs N replicas of it on Ray Serve.
"""

__all__ = ["DEFAULT_MAX_QUEUED_REQUESTS"]

# The default bound on requests waiting for the engine (``--max-queued-requests``). A queued request holds
# its prompt's ids (at most the model's length) and a few small records: 1,024 of them stay within tens of
# MB, and are minutes of work for a model on one device. Here, apart from the server's modules, so the CLI
# shows it without importing the serve extra.
DEFAULT_MAX_QUEUED_REQUESTS = 1024
