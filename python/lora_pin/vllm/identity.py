"""Adapter identity in vLLM's prefix cache: every LoRA request carries lora_pin's adapter digest in its
``cache_salt``.

vLLM keys a LoRA request's KV blocks by ``("lora", name, path)``, so an adapter reloaded in place under the
same path (``load_inplace``) keeps hitting the blocks its previous weights computed (vLLM #30931). vLLM
mixes a request's ``cache_salt`` into its first block's hash, and every later block chains from it: a
salt naming the weights served keys every block by them, and vLLM's name-and-path keys are then left
out of the hashes of the requests it salted. The digest (:mod:`lora_pin.weights.digest`) covers
everything that decides an adapter's outputs, so two names with the same weights share blocks and a
replacement gets fresh ones. A user's own ``cache_salt`` is kept beside it.

The digest is computed in vLLM's API-server process when an adapter is loaded (at start-up, over HTTP,
in place) and kept per ``LoRARequest`` object: vLLM makes a new one per load, and a request admitted
under the previous one keeps its salt.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from lora_pin.weights import open_adapter

__all__ = [
    "SALT_PREFIX",
    "digest_of",
    "digesting_load",
    "lora_keys_unless_salted",
    "salted",
    "salting_process_inputs",
]

#: What a salt made here starts with (then the digest, then ``|`` and the user's salt, if any).
SALT_PREFIX = "lora_pin:"

# LoRARequest object id -> (the object, kept alive so its id is never reused; its digest).
_digests: dict[int, tuple[Any, str]] = {}
_lock = threading.Lock()


def digest_of(lora_request: Any) -> str:
    """The digest of the adapter ``lora_request`` names, read from its folder the first time it is asked
    for that object.

    Raises:
        lora_pin.errors.AdapterLoadError: the folder holds no adapter lora_pin can read.
    """
    with _lock:
        known = _digests.get(id(lora_request))
    if known is not None and known[0] is lora_request:
        return known[1]
    with open_adapter(lora_request.lora_name, lora_request.lora_path) as file:
        digest = file.standalone_digest()
    with _lock:
        _digests[id(lora_request)] = (lora_request, digest)
    return digest


def salted(lora_request: Any, user_salt: str | None) -> str:
    """The ``cache_salt`` of a request of ``lora_request`` whose user gave ``user_salt`` (or none)."""
    salt = SALT_PREFIX + digest_of(lora_request)
    return salt if not user_salt else f"{salt}|{user_salt}"


def salting_process_inputs(process_inputs: Any) -> Any:
    """``InputProcessor.process_inputs`` whose LoRA requests carry the adapter's digest in their salt."""

    @functools.wraps(process_inputs)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = process_inputs(self, *args, **kwargs)
        if request.lora_request is not None:
            request.cache_salt = salted(request.lora_request, request.cache_salt)
        return request

    return wrapper


def digesting_load(load_lora_adapter: Any) -> Any:
    """``OpenAIServingModels.load_lora_adapter`` that reads the digest of what it loaded (so a request
    never pays for it, and the digest is of the files as the load found them)."""

    @functools.wraps(load_lora_adapter)
    async def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = await load_lora_adapter(self, request, *args, **kwargs)
        loaded = self.lora_requests.get(request.lora_name)
        if isinstance(result, str) and loaded is not None:
            digest_of(loaded)
        return result

    return wrapper


def lora_keys_unless_salted(lora_keys: Any) -> Any:
    """vLLM's ``_gen_lora_extra_hash_keys`` (the ``("lora", name, path)`` key of every block of a LoRA
    request) that gives nothing for a request salted here: its salt names the weights, not the name."""

    @functools.wraps(lora_keys)
    def wrapper(request: Any) -> Any:
        salt = request.cache_salt
        if salt is not None and salt.startswith(SALT_PREFIX):
            return []
        return lora_keys(request)

    return wrapper
