"""``lora-pin serve --replicas N``: N lora_pin replicas of one base model on Ray Serve, one HTTP face.

Needs the ``ray`` extra (``ray[serve]``, its minor version pinned: the request-router API is young, and
``tests/serve/test_ray_contract.py`` checks every seam used). The pieces:

- :mod:`~lora_pin.serve.ray.replica`: one replica, the same engine and app as ``lora-pin serve``;
- :mod:`~lora_pin.serve.ray.router`: Ray Serve's request router, ranking replicas by their placement
  snapshots with :func:`lora_pin.routing.rank_replicas`;
- :mod:`~lora_pin.serve.ray.ingress`: the OpenAI-compatible face; adapter changes reach every replica,
  replicas that differ from the desired adapters are sent them again, lost requests are retried;
- :mod:`~lora_pin.serve.ray.desired`: the desired adapters and the order of steps that reaches them.

:func:`build_application` makes the Ray Serve application (for ``serve.run`` or ``serve run``);
:func:`run_local` starts a local Ray cluster and serves it until interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from lora_pin.serve.ray.ingress import REPLICA_DEPLOYMENT, LoRAIngress
from lora_pin.serve.ray.replica import LoRAReplica
from lora_pin.serve.ray.router import LoRARouter, RouteHint

__all__ = ["LoRAIngress", "LoRAReplica", "LoRARouter", "RouteHint", "build_application", "run_local"]

INGRESS_DEPLOYMENT = "LoRAIngress"
# How often each replica's placement snapshot reaches the router.
ROUTING_STATS_PERIOD_S = 1.0


def build_application(
    args: argparse.Namespace,
    build_state: Callable[[argparse.Namespace], Any],
    *,
    replicas: int,
    replica_cpus: float = 0.5,
    replica_gpus: float = 0.0,
    queue_bound: int = 8,
    max_ongoing_requests: int = 64,
    health_check_timeout_s: float = 30.0,
) -> Any:
    """The Ray Serve application: ``replicas`` lora_pin replicas built by ``build_state(args)`` behind
    one ingress (its route prefix is ``/``).

    Args:
        args: the ``lora-pin serve`` arguments, the same for every replica.
        build_state: ``lora_pin.cli.serve_cmd.build_server`` (model, manager, engine started).
        replicas: how many replicas (>= 1).
        replica_cpus: Ray's logical CPUs each replica claims (fractional on small machines).
        replica_gpus: GPUs each replica claims (Ray then gives it those devices alone); 0 on CPU.
        queue_bound: a replica's queued and running requests at which requests spill to the next choice.
        max_ongoing_requests: Ray Serve's own limit per replica (requests past it wait in the ingress).
        health_check_timeout_s: how long a replica may leave Ray Serve's health check unanswered
            before it is replaced (Ray Serve's default, 30 s; more where replicas may stall, e.g. a
            machine that is swapping).

    Raises:
        ValueError: ``replicas`` or ``queue_bound`` below 1, ``replica_cpus`` or
            ``health_check_timeout_s`` not positive, ``replica_gpus`` negative, or
            ``max_ongoing_requests`` below ``queue_bound``.
    """
    if (
        replicas < 1
        or queue_bound < 1
        or replica_cpus <= 0
        or replica_gpus < 0
        or max_ongoing_requests < queue_bound
        or not health_check_timeout_s > 0
    ):
        raise ValueError(
            f"replicas ({replicas}) and queue_bound ({queue_bound}) must be at least 1, replica_cpus "
            f"({replica_cpus}) above 0, replica_gpus ({replica_gpus}) at least 0, and "
            f"max_ongoing_requests ({max_ongoing_requests}) at least queue_bound, and "
            f"health_check_timeout_s ({health_check_timeout_s}) above 0"
        )
    router = RequestRouterConfig(
        request_router_class=LoRARouter,
        request_router_kwargs={"queue_bound": queue_bound, "memory_s": 3 * ROUTING_STATS_PERIOD_S},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_routing_stats_timeout_s=10 * ROUTING_STATS_PERIOD_S,
    )
    replica = serve.deployment(
        LoRAReplica,
        name=REPLICA_DEPLOYMENT,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        max_ongoing_requests=max_ongoing_requests,
        request_router_config=router,
        health_check_timeout_s=health_check_timeout_s,
    )
    ingress = serve.deployment(
        LoRAIngress,
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(1000, replicas * max_ongoing_requests),
    )
    return ingress.bind(replica.bind(build_state, args, INGRESS_DEPLOYMENT), args)


def run_local(
    args: argparse.Namespace, build_state: Callable[[argparse.Namespace], Any], *, replicas: int
) -> int:
    """Starts a local Ray cluster (``replicas * args.replica_cpus`` logical CPUs, no dashboard) and
    serves :func:`build_application` on ``args.host:args.port`` until interrupted; 0 after a clean
    shutdown.

    Raises:
        ValueError: as :func:`build_application`.
    """
    import math
    import signal
    import threading

    import ray

    cpus = max(1, math.ceil(replicas * args.replica_cpus))
    ray.init(num_cpus=cpus, include_dashboard=False, configure_logging=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        application = build_application(
            args,
            build_state,
            replicas=replicas,
            replica_cpus=args.replica_cpus,
            replica_gpus=args.replica_gpus,
            queue_bound=args.replica_queue_bound,
            health_check_timeout_s=args.replica_health_check_timeout,
        )
        serve.run(application, name="lora_pin", route_prefix="/")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
