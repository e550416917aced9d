"""An adapter's life under its name: loads from a folder or from tensors, replacement in place, its
identity (what an engine puts in its cache keys) and where every adapter is.

Identity: every registered adapter has a content digest (:mod:`lora_pin.weights.digest`) and a generation,
which grows with each load of the name in this manager (kept across unload and load of the same name, and
across replacements). The digest changes exactly when what is served changes; the generation orders the
versions a name has had.

Replacement (``replace=True``): the new weights are read and checked first, with nothing changed; then,
under the residency lock at once, the registry takes the new size, the host tier the new weights, and the
identity its new digest and generation. The id and the pin stay. Whatever tier the old weights were in, the
new ones end in the host tier: old weights only in host memory are dropped; a background read of the old
weights (the adapter was being fetched) is over, and what it reads is dropped when it ends; an adapter
evicted to disk comes back into host memory. A device slot holding the old weights keeps them while the step
running now reads them, and is refreshed before the next step that uses it: every step that begins after
the replacement returns runs on the new weights. A refused replacement (unreadable files, NaN, shapes, no
host room, weights that would leave a registered adapter no room beside the pinned ones) changes nothing:
the core refuses before any tensor is swapped.

With tensor parallelism every rank reads its part and hashes the whole adapter's tensors; the ranks agree on
the outcome and then on the digest and the whole adapter's bytes before any registers or replaces, so ranks
that read different files (a file renamed into place between their reads, per-node copies that differ) all
refuse the load, naming the ranks (:func:`lora_pin.parallel.identity.agree_identity`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lora_pin._core import LoRARef, LoRARegistry
from lora_pin.errors import DuplicateAdapterError
from lora_pin.model.residency import Residency
from lora_pin.parallel import Collective, SingleProcess
from lora_pin.weights.host_adapter import HostAdapter
from lora_pin.weights.tensors import WHERE, AdapterTensors, adapter_tensors

__all__ = ["TIERS", "AdapterIdentity", "AdapterPlacement", "Lifecycle", "Placement"]

#: Where an adapter can be, nearest the kernels first.
TIERS = ("device", "host", "fetching", "disk")


@dataclass(frozen=True)
class AdapterIdentity:
    """What a registered adapter serves, for cache keys.

    Attributes:
        name: the adapter's name.
        id: its registry id (stays across replacements; a fresh one after an unload and load).
        digest: the content digest, 64 hex characters (BLAKE3 of the served tensors and the config fields
            that change outputs): the same weights give the same digest in every folder, format, process
            and tensor-parallel rank; any served change (one element, ``lora_alpha``, a rank pattern) gives
            another. Put it in prefix-cache keys.
        generation: 1 for the name's first load in this manager, then one more for each load or
            replacement of that name.
    """

    name: str
    id: str
    digest: str
    generation: int


@dataclass(frozen=True)
class AdapterPlacement:
    """Where one adapter is (one entry of :class:`Placement`).

    Attributes:
        tier: ``"device"`` (in a slot, and in host memory), ``"host"``, ``"fetching"`` (a background read
            is in flight) or ``"disk"`` (evicted; read again on its next use).
        slot: its device slot, None outside the device tier.
        pinned: never evicted until unpinned.
        in_flight: requests acquired and not yet released.
        unloading: being unloaded (takes no new requests; its requests drain).
        host_bytes: what the host tier counts for it (the whole adapter's bytes).
    """

    name: str
    id: str
    digest: str
    generation: int
    tier: str
    slot: int | None
    pinned: bool
    in_flight: int
    unloading: bool
    host_bytes: int


@dataclass(frozen=True)
class Placement:
    """Every adapter's :class:`AdapterPlacement` (sorted by name) and the tiers' room, taken at one instant.

    Attributes:
        slots, free_slots: device slots in all, and those holding no adapter.
        host_bytes: bytes of the adapters in the host tier (as the registry counts them).
        reserved_bytes: bytes set aside in the host tier for adapters being fetched.
        max_host_bytes: the host tier's capacity in bytes, None when unbounded.
    """

    adapters: tuple[AdapterPlacement, ...]
    slots: int
    free_slots: int
    host_bytes: int
    reserved_bytes: int
    max_host_bytes: int | None

    def __getitem__(self, name: str) -> AdapterPlacement:
        """The entry of adapter ``name``.

        Raises:
            KeyError: no such adapter in the snapshot.
        """
        for entry in self.adapters:
            if entry.name == name:
                return entry
        raise KeyError(name)


class Lifecycle:
    """A manager's loads, replacements, identities and placement (see the module's docs).

    Args:
        residency: the manager's tensors and the registry they follow.
        collective: how loads agree over the processes serving the model (collective over
            tensor-parallel ranks).
    """

    def __init__(self, residency: Residency, collective: Collective | None = None) -> None:
        self.residency = residency
        self.registry: LoRARegistry = residency.registry
        self.collective = SingleProcess() if collective is None else collective

    def load(
        self,
        name: str,
        path: str | None,
        tensors: Mapping[str, torch.Tensor] | None,
        config: Any,
        *,
        pinned: bool,
        replace: bool,
    ) -> LoRARef:
        """Load the adapter at ``path`` (or ``tensors`` with ``config``) as ``name``; with ``replace``,
        replace the weights of a registered ``name`` in place (a name not registered is loaded afresh).

        Raises:
            AdapterLoadError (and subclasses): the adapter cannot be served (with tensor parallelism: on
                some rank, or the ranks read different adapters).
            DuplicateAdapterError: ``name`` is registered and ``replace`` is False.
            AdapterNotFoundError: the adapter to replace was unloaded meanwhile.
            CapacityError: the host tier cannot take it, pinning would leave no slot for unpinned
                adapters, or a registered adapter would no longer fit in the host tier beside the pinned
                ones (the core's pin rule, for loads and replacements alike). In every case nothing
                changes.
        """
        where = WHERE if path is None else path

        def read() -> tuple[HostAdapter, AdapterTensors | None]:
            LoRARef.new(name, where, pinned)  # the name and path checks, before anything is read
            if not replace and name in self.registry:
                raise DuplicateAdapterError(f"adapter {name!r} is already registered")
            held = None
            if tensors is not None:
                host = self.residency.host
                held = adapter_tensors(
                    name, tensors, config, max_file_bytes=host.max_file_bytes, max_tensors=host.max_tensors
                )
            return self.residency.read_new(name, where, None, held), held

        what = f"load of adapter {name!r}"
        (adapter, held), token = self.collective.agreed(what, read)
        self.collective.agree_identity(what, adapter.digest, adapter.whole_nbytes)
        adapter = self.collective.finish_read(adapter)
        if replace and name in self.registry:
            self.residency.replace(name, adapter, where, None, held)
            return self.registry.lora_ref(name)
        ref = (
            LoRARef.new(name, where, pinned)
            if token is None
            else LoRARef(name, where, pinned=pinned, lora_id=token)
        )
        self.residency.add(ref, adapter=adapter, tensors=held)
        return ref

    def identity(self, name: str) -> AdapterIdentity:
        """The identity of ``name`` (registered, or being unloaded).

        Raises:
            AdapterNotFoundError: ``name`` is not registered.
        """
        lora_id, digest, generation = self.residency.identity(name)
        return AdapterIdentity(name, lora_id, digest, generation)

    def identities(self) -> dict[str, AdapterIdentity]:
        """The identity of every adapter registered (or being unloaded), by name."""
        with self.residency.lock:
            ids = {entry[0]: entry[1] for entry in self.registry.placement()["adapters"]}
            versions = self.residency.versions()
        return {
            name: AdapterIdentity(name, lora_id, *versions[name])
            for name, lora_id in ids.items()
            if name in versions
        }

    def placement(self) -> Placement:
        """Every adapter's tier, pin, requests in flight, digest and generation, with the tiers' room, at
        one instant: the registry's snapshot and the identities, read under the residency lock (which
        every registration, replacement and forget holds). O(adapters); cheap enough to poll each second.
        """
        with self.residency.lock:
            snapshot = self.registry.placement()
            versions = self.residency.versions()
        entries = []
        for name, lora_id, _serial, tier, slot, pinned, in_flight, draining, host_bytes in snapshot[
            "adapters"
        ]:
            version = versions.get(name)
            if version is None:
                # Registered in the core by a caller other than this manager: no identity to show.
                continue
            entries.append(
                AdapterPlacement(
                    name, lora_id, version[0], version[1], tier, slot, pinned, in_flight, draining, host_bytes
                )
            )
        return Placement(
            tuple(entries),
            snapshot["slots"],
            snapshot["free_slots"],
            snapshot["host_bytes"],
            snapshot["reserved_bytes"],
            snapshot["max_host_bytes"],
        )
