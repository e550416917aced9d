"""The Ray Serve seams ``lora_pin.serve.ray`` builds on, checked without starting a cluster: an upgrade
that moves one fails here, loudly, rather than at a user's (the ``ray`` extra pins the minor version).

Each check names where lora_pin uses the seam."""

from __future__ import annotations

import inspect

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from ray.serve.config import RequestRouterConfig  # noqa: E402
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica  # noqa: E402


def test_the_pinned_minor_version() -> None:
    # pyproject.toml's ray extra: ray[serve]>=2.60,<2.61.
    assert ray.__version__.startswith("2.60."), ray.__version__


def test_request_router_hooks() -> None:
    # router.LoRARouter overrides these and calls super() where it extends them.
    assert getattr(RequestRouter.choose_replicas, "__isabstractmethod__", False)
    assert inspect.iscoroutinefunction(RequestRouter.choose_replicas)
    assert list(inspect.signature(RequestRouter.choose_replicas).parameters) == [
        "self",
        "candidate_replicas",
        "pending_request",
    ]
    for hook, params in {
        "initialize_state": ["self", "kwargs"],
        "update_replicas": ["self", "replicas"],
        "on_send_request": ["self", "replica_id"],
        "on_request_completed": ["self", "replica_id", "internal_request_id"],
    }.items():
        assert list(inspect.signature(getattr(RequestRouter, hook)).parameters) == params, hook
    assert isinstance(inspect.getattr_static(RequestRouter, "curr_replicas"), property)
    # initialize_state reads the deployment's id (application and name) the router serves.
    assert "self._deployment_id = deployment_id" in inspect.getsource(RequestRouter.__init__)


def test_the_router_backs_off_only_when_asked() -> None:
    # router.LoRARouter sets should_backoff: without it Ray Serve asks again at once, in a loop.
    source = inspect.getsource(RequestRouter._choose_replicas_with_backoff)
    assert "routing_context.should_backoff" in source
    fields = PendingRequest.__dataclass_fields__
    assert {"args", "kwargs", "metadata", "routing_context"} <= set(fields)


def test_running_replica_carries_routing_stats() -> None:
    # router.LoRARouter reads each candidate's id and the stats its record_routing_stats returned.
    assert isinstance(inspect.getattr_static(RunningReplica, "routing_stats"), property)
    assert isinstance(inspect.getattr_static(RunningReplica, "replica_id"), property)
    from ray.serve._private.common import ReplicaID, RequestMetadata
    from ray.serve._private.constants import REQUEST_ROUTING_STATS_METHOD

    assert REQUEST_ROUTING_STATS_METHOD == "record_routing_stats"
    assert "unique_id" in ReplicaID.__dataclass_fields__
    assert "internal_request_id" in RequestMetadata.__dataclass_fields__


def test_deployment_options_used() -> None:
    # serve.ray.build_application and the ingress.
    fields = set(RequestRouterConfig.model_fields)
    assert {
        "request_router_class",
        "request_router_kwargs",
        "request_routing_stats_period_s",
        "request_routing_stats_timeout_s",
    } <= fields
    options = set(inspect.signature(serve.deployment).parameters)
    assert {
        "name",
        "num_replicas",
        "ray_actor_options",
        "max_ongoing_requests",
        "request_router_config",
    } <= options
    assert {"blocking", "name", "route_prefix"} <= set(inspect.signature(serve.run).parameters)
    assert "http_options" in inspect.signature(serve.start).parameters
    for name in ("ingress", "get_replica_context", "get_deployment_handle", "shutdown"):
        assert callable(getattr(serve, name)), name
    from ray.serve.context import ReplicaContext

    assert {"app_name", "replica_id"} <= set(ReplicaContext.__dataclass_fields__) | {"app_name"}
    assert "method_name" in inspect.signature(serve.handle.DeploymentHandle.options).parameters
    assert "stream" in inspect.signature(serve.handle.DeploymentHandle.options).parameters


def test_status_counts_running_replicas() -> None:
    # ingress.LoRAIngress._adopt: serve.status() -> applications[app].deployments[name].replica_states,
    # keyed by ReplicaState, a str enum whose "RUNNING" member equals the plain string.
    from ray.serve._private.common import ReplicaState
    from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    assert inspect.signature(serve.status).parameters == {}
    assert "applications" in ServeStatus.__dataclass_fields__
    assert "deployments" in ApplicationStatusOverview.__dataclass_fields__
    assert "replica_states" in DeploymentStatusOverview.__dataclass_fields__
    assert {ReplicaState.RUNNING: 2}.get("RUNNING") == 2


def test_a_request_of_its_own_in_an_empty_context() -> None:
    # ingress._own_request runs a call in an empty contextvars.Context so it gets a request id of its own:
    # Ray Serve reads the caller's request from a context variable and mints ids when there is none.
    import contextvars

    from ray.serve._private import default_impl
    from ray.serve.context import _serve_request_context

    assert isinstance(_serve_request_context, contextvars.ContextVar)
    source = inspect.getsource(default_impl.get_request_metadata)
    assert "else generate_request_id()" in source and "_internal_request_id" in source


def test_what_a_lost_replica_raises() -> None:
    # ingress._lost tells a replica that went away from one that raised; ingress._relay cancels the
    # answer it gives up on.
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
    from ray.serve.exceptions import ReplicaUnavailableError
    from ray.serve.handle import DeploymentResponseGenerator

    assert issubclass(ActorDiedError, RayActorError) and issubclass(ActorUnavailableError, RayActorError)
    assert "cause" in inspect.signature(RayTaskError.__init__).parameters
    assert issubclass(ReplicaUnavailableError, Exception)
    assert callable(DeploymentResponseGenerator.cancel)
