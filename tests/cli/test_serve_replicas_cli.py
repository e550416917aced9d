"""``lora-pin serve --replicas`` and the ``serve run`` builder: flags checked before any cluster starts."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from lora_pin.cli.serve_cmd import ray_app
from lora_pin.errors import SpecError


def test_the_builder_needs_lora_pin_serve_flags() -> None:
    with pytest.raises(SpecError, match="flags"):
        ray_app({})
    with pytest.raises(SpecError, match="--no-such-flag"):
        ray_app({"flags": "--model m --no-such-flag"})


def test_the_builder_makes_an_ingress_over_the_replicas() -> None:
    from ray.serve.deployment import Application

    app = ray_app({"flags": "--model /m --replicas 3 --replica-cpus 0.25 --replica-queue-bound 4"})
    assert isinstance(app, Application)


def test_bad_replica_settings_are_refused_before_a_cluster_starts() -> None:
    with pytest.raises(ValueError, match="queue_bound"):
        ray_app({"flags": "--model /m --replicas 2 --replica-queue-bound 0"})
    with pytest.raises(ValueError, match="replica_cpus"):
        ray_app({"flags": "--model /m --replicas 2 --replica-cpus 0"})
    with pytest.raises(ValueError, match="replica_gpus"):
        ray_app({"flags": "--model /m --replicas 2 --replica-gpus -1"})
