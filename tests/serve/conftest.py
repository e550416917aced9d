"""The replicated server for the ``test_ray_*`` files: two CPU replicas of the tiny model behind one
ingress on a local Ray cluster (one cluster per test file, ``deployment``), and the calls the tests make
of it: HTTP with the official ``openai`` client, each replica's own report through a Serve handle, and
the faults (a replica killed, or frozen with SIGSTOP so that it holds what it was given).

Every wait polls what the system reports (a replica's report, the router's queue counts, an HTTP
status) with a generous bound; none sleeps to let something happen.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import signal
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from lora_pin import _testing

EOS = 2  # the char tokenizer's </s>
ADAPTERS = ["pin0", "pin1", "ad1", "ad2", "ad3"]
# Two pins fill what three slots allow: a replica that pins one too many at start is refused.
PINNED = ["pin0", "pin1"]
SPARES = ["late", "ad2b"]  # loaded over HTTP by the tests
APP = "lora_pin"
REPLICAS = 2
QUEUE_BOUND = 2
# What a test waits for at most: far above what each wait takes on a machine busy with other work.
PATIENCE_S = 180.0
# What one call to a live replica takes at most, on such a machine.
CALL_S = 30.0

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], patience: float = PATIENCE_S, every: float = 0.2) -> T:
    """:func:`lora_pin._testing.wait_for` with this module's patience."""
    return _testing.wait_for(what, check, patience, every)


def prompt(i: int) -> list[int]:
    """A short prompt of ids in the char tokenizer's printable range, different for each ``i``."""
    return [32 + (i * 13 + k * 5) % 90 for k in range(4 + i % 5)]


class Deployment:
    """The running application as a test sees it (test files reach this module's names through it:
    ``deployment.PINNED``, ``deployment.wait_for(...)``).

    Attributes:
        url: the ingress's base URL.
        dirs: adapter name -> its PEFT folder (``ADAPTERS`` and ``SPARES``).
        base_dir: the base model's folder.
    """

    ADAPTERS, PINNED, SPARES, QUEUE_BOUND, REPLICAS = ADAPTERS, PINNED, SPARES, QUEUE_BOUND, REPLICAS
    wait_for = staticmethod(wait_for)
    prompt = staticmethod(prompt)

    def __init__(self, url: str, dirs: dict[str, Path], base_dir: Path) -> None:
        self.url, self.dirs, self.base_dir = url, dirs, base_dir
        self._oracle: Any = None

    # --- HTTP, as a user would -------------------------------------------------------------------

    def http(self, path: str, method: str = "GET", body: Any = None, timeout: float = 120) -> tuple[int, Any]:
        """One HTTP request: ``(status, body as JSON or text)``; status 0 when no answer came."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return 0, None
        try:
            return status, json.loads(payload)
        except ValueError:
            return status, payload.decode()

    def complete(
        self, model: str, ids: list[int], max_tokens: int = 6, **extra: Any
    ) -> tuple[list[int], str]:
        """One completion with the ``openai`` client: its token ids and the replica that answered."""
        import openai

        with openai.OpenAI(
            base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=PATIENCE_S
        ) as client:
            raw = client.completions.with_raw_response.create(
                model=model,
                prompt=ids,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"return_token_ids": True, **extra},
            )
            return list(raw.parse().choices[0].token_ids), raw.headers["x-lora-pin-replica"]

    def completion(
        self, model: str, ids: list[int], max_tokens: int = 6, timeout: float = PATIENCE_S
    ) -> tuple[int, Any, str | None]:
        """One completion over plain HTTP: ``(status, body, the answering replica)``, whatever the status
        (0: no answer, or the connection dropped)."""
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
        request = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps({**body, "return_token_ids": True}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, payload, replica = (
                    response.status,
                    response.read(),
                    response.headers.get("x-lora-pin-replica"),
                )
        except urllib.error.HTTPError as e:
            status, payload, replica = e.code, e.read(), e.headers.get("x-lora-pin-replica")
        except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException):
            return 0, None, None
        try:
            return status, json.loads(payload), replica
        except ValueError:
            return status, payload.decode("utf-8", "replace"), replica

    def peft(self, model: str, ids: list[int], max_tokens: int = 6, weights: Path | None = None) -> list[int]:
        """PEFT's greedy tokens for ``model`` (an adapter's name or the base's, ``tiny``), through the
        adapter folder ``weights`` when given (an adapter replaced in place)."""
        from lora_pin._testing import PeftOracle

        if self._oracle is None:
            self._oracle = PeftOracle(self.base_dir, EOS)
        folder = weights if weights is not None else None if model == "tiny" else self.dirs[model]
        return list(self._oracle.tokens(ids, folder, max_tokens))

    @contextlib.contextmanager
    def traffic(self, models: dict[str, Path | None]) -> Iterator[list[tuple[str, int, Any]]]:
        """Two clients asking for completions of ``models`` (name -> the adapter folder its answers must
        equal PEFT's through, None: the base) in turn, until the block ends. Yields the list of every
        answer that was not 200 with PEFT's tokens, as ``(model, status, body)``, filled as they come;
        after the block at least one request per model has been answered."""
        want = {(m, i): self.peft(m, prompt(i), weights=w) for m, w in models.items() for i in range(2)}
        keys = list(want)
        wrong: list[tuple[str, int, Any]] = []
        answered: set[str] = set()
        stop = threading.Event()

        def client(start: int) -> None:
            k = start
            while not stop.is_set() or not answered >= set(models):
                model, i = keys[k % len(keys)]
                k += 1
                status, body, _ = self.completion(model, prompt(i))
                answered.add(model)
                if status != 200 or body["choices"][0]["token_ids"] != want[(model, i)]:
                    wrong.append((model, status, body))

        threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in (0, len(keys) // 2)]
        for thread in threads:
            thread.start()
        try:
            yield wrong
        finally:
            stop.set()
            for thread in threads:
                thread.join(PATIENCE_S)

    # --- the deployment's own reports --------------------------------------------------------------

    def names(self) -> list[str]:
        """The running replicas, as Ray Serve last told this process's router."""
        from lora_pin.serve.ray import RouteHint
        from lora_pin.serve.ray.router import LoRARouter

        router = LoRARouter.of(APP, "LoRAReplica")
        if router is None:
            self.replica_handle().options(method_name="adapters").remote(route=RouteHint()).result(
                timeout_s=PATIENCE_S
            )
            router = LoRARouter.of(APP, "LoRAReplica")
        assert router is not None
        return router.replica_names()

    def replica_handle(self) -> Any:
        from ray import serve

        return serve.get_deployment_handle("LoRAReplica", APP)

    def call(self, replica: str, method: str, *args: Any, timeout: float = PATIENCE_S) -> Any:
        """``method(*args)`` on the replica named ``replica`` (its answer).

        Raises:
            TimeoutError: no answer within ``timeout`` s (a call to a replica that died waits for it
                until then; the call tells this process's router it died).
        """
        from lora_pin.serve.ray import RouteHint

        handle = self.replica_handle().options(method_name=method)
        return handle.remote(*args, route=RouteHint(replica=replica)).result(timeout_s=timeout)

    def ingress(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the ingress (its answer)."""
        from ray import serve

        handle = serve.get_deployment_handle("LoRAIngress", APP).options(method_name=method)
        return handle.remote(*args).result(timeout_s=PATIENCE_S)

    def desired(self) -> dict[str, Any]:
        """The ingress's desired adapters, ``{"generation", "adapters"}``."""
        return dict(self.ingress("desired_adapters"))

    def reports(self) -> dict[str, dict[str, Any]]:
        """Every running replica's report (``LoRAReplica.report``), once ``REPLICAS`` run.

        Raises:
            TimeoutError: a replica did not answer in ``CALL_S`` (it died: ask again).
        """
        names = wait_for(
            f"{REPLICAS} replicas running", lambda: n if len(n := self.names()) == REPLICAS else None
        )
        return {name: self.call(name, "report", timeout=CALL_S) for name in names}

    def adapters(self) -> dict[str, dict[str, Any]]:
        """Every running replica's adapters (``LoRAReplica.adapters``: tier, pin, digest, version)."""
        return {name: self.call(name, "adapters")["adapters"] for name in self.reports()}

    def converged(self) -> dict[str, dict[str, Any]]:
        """Waits until ``REPLICAS`` replicas run and each serves exactly the desired adapters (names,
        versions, pins); returns their reports."""
        from lora_pin.serve.ray.desired import differences

        def check() -> dict[str, dict[str, Any]] | None:
            desired = self.desired()["adapters"]
            try:
                reports = self.reports()
            except TimeoutError:  # a replica named a moment ago had died: look again
                return None
            if any(differences(r["serves"], desired) for r in reports.values()):
                return None
            return reports

        return wait_for("every replica serves exactly the desired adapters", check)

    # --- faults -------------------------------------------------------------------------------------

    def actor(self, replica: str) -> Any:
        import ray

        return ray.get_actor(f"SERVE_REPLICA::{APP}#LoRAReplica#{replica}", namespace="serve")

    def behind_the_back(self, replica: str, path: str, body: dict[str, Any]) -> int:
        """POSTs ``body`` to ``path`` on the replica named ``replica`` alone, not through the ingress (a
        change the desired adapters do not know of, as on a replica that missed or lost changes);
        returns the replica's status."""
        from lora_pin.serve.ray import RouteHint

        request = {
            "method": "POST",
            "path": path,
            "query": "",
            "headers": [("content-type", "application/json")],
            "body": json.dumps(body).encode(),
        }
        handle = self.replica_handle().options(method_name="forward", stream=True)
        answer = handle.remote(request, route=RouteHint(replica=replica))
        status = 0
        for message in answer:
            status = message.get("status", status)
        return int(status)

    def kill(self, replica: str) -> None:
        """Kills the replica's actor (Ray Serve starts another in its place)."""
        import ray

        ray.kill(self.actor(replica), no_restart=True)

    @contextlib.contextmanager
    def frozen(self, replica: str) -> Iterator[None]:
        """The replica's process stopped (SIGSTOP) inside the block: it answers nothing and finishes
        nothing, as a stuck replica; it goes on (SIGCONT) after."""
        import ray

        pid = int(ray.get(self.actor(replica).__ray_call__.remote(lambda _: os.getpid()), timeout=PATIENCE_S))
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):  # Ray Serve may have replaced it meanwhile
                os.kill(pid, signal.SIGCONT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """The tiny model, its adapters (two pinned) and spares, and the replicated server on a local Ray
    cluster, started once for the test file."""
    # hypothesis is imported before Ray's threads start: its pytest plugin imports it lazily at the end
    # of the session, and CPython 3.11.7's parser then fails ("AST constructor recursion depth
    # mismatch", python/cpython#106905) after Ray has run in the process.
    import hypothesis  # noqa: F401

    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    pytest.importorskip("openai")
    from transformers import AutoModelForCausalLM

    from lora_pin.cli.serve_cmd import ray_app
    from lora_pin.fixtures import make_peft_adapter, make_tiny_llama, save_char_tokenizer
    from lora_pin.serve.ray.router import _live_routers

    root = tmp_path_factory.mktemp("ray")
    base_dir = make_tiny_llama(root / "base", layers=2)
    save_char_tokenizer(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    adapters = root / "adapters"
    dirs = {
        name: make_peft_adapter(
            base, adapters / name, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=i + 1
        )
        for i, name in enumerate([*ADAPTERS, *SPARES])
    }
    items = [json.dumps({"lora_name": n, "lora_path": str(dirs[n]), "pinned": n in PINNED}) for n in ADAPTERS]
    flags = [
        "--model", str(base_dir), "--served-model-name", "tiny", "--device", "cpu",
        "--num-blocks", "64", "--page-size", "16", "--max-batch-tokens", "64",
        "--lora-paths", *items, "--max-loras-per-batch", "3", "--max-loaded-loras", "8",
        "--max-lora-rank", "8", "--lora-target-modules", "all",
        "--allow-runtime-lora-updating", "--lora-root", str(adapters),
        "--replicas", str(REPLICAS), "--replica-cpus", "1", "--replica-queue-bound", str(QUEUE_BOUND),
        # A frozen replica must stay one for as long as a test holds it, however slow the machine:
        # Ray Serve would replace it after its health check's 30 s (the holder gone from the router).
        "--replica-health-check-timeout", "600",
    ]  # fmt: skip
    port = _free_port()
    # On a busy machine Ray Serve's HTTP proxy can take longer than its 5 s readiness check to start.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "30")
    env = {
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        # Ray Serve sends to a replica its cache says has room, and probes one whose entry is older
        # than this: a frozen replica fails the probe, and the request would go elsewhere by Ray's
        # choice, not the router's. Entries are refreshed by every request sent and answered.
        "RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": "600",
    }
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_app({"flags": shlex.join(flags)}), name=APP)
        world = Deployment(f"http://127.0.0.1:{port}", dirs, base_dir)
        wait_for("the replicated server answers /health", lambda: world.http("/health")[0] == 200)
        yield world
    finally:
        serve.shutdown()
        ray.shutdown()
        # The next file's cluster makes its own router; this one's must not answer for it.
        _live_routers().clear()
