"""``lora-pin serve --replicas``: two CPU replicas of the tiny model on a local Ray cluster behind one
ingress, driven over HTTP with the official ``openai`` client: pinned adapters sit on every replica,
one adapter's requests stay on one replica until it spills, outputs equal PEFT's token for token, and
adapter changes over HTTP reach every replica (and a replica started again gets them back)."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import hypothesis  # noqa: F401  (see below)
import pytest

# hypothesis is imported before Ray's threads start: its pytest plugin imports it lazily at the end of
# the session, and CPython 3.11.7's parser then fails ("AST constructor recursion depth mismatch",
# python/cpython#106905) after Ray has run in the process.

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from lora_pin._testing import PeftOracle  # noqa: E402
from lora_pin.cli.serve_cmd import ray_app  # noqa: E402
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama, save_char_tokenizer  # noqa: E402
from lora_pin.serve.ray import RouteHint  # noqa: E402
from lora_pin.serve.ray.router import LoRARouter  # noqa: E402

EOS = 2  # the char tokenizer's </s>
ADAPTERS = ["pin0", "ad1", "ad2", "ad3"]
PINNED = ["pin0"]
APP = "lora_pin"
QUEUE_BOUND = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, method: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    except (urllib.error.URLError, ConnectionError):
        return 0, None
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny model, four adapters (one pinned) and a spare, and the replicated server on a local
    Ray cluster (started once for the module)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("ray")
    base_dir = make_tiny_llama(root / "base", layers=2)
    save_char_tokenizer(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    adapters = root / "adapters"
    dirs = {
        name: make_peft_adapter(
            base, adapters / name, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=i + 1
        )
        for i, name in enumerate([*ADAPTERS, "late"])
    }
    items = [json.dumps({"lora_name": n, "lora_path": str(dirs[n]), "pinned": n in PINNED}) for n in ADAPTERS]
    flags = [
        "--model", str(base_dir), "--served-model-name", "tiny", "--device", "cpu",
        "--num-blocks", "64", "--page-size", "16", "--max-batch-tokens", "64",
        "--lora-paths", *items, "--max-loras-per-batch", "3", "--max-loaded-loras", "6",
        "--max-lora-rank", "8", "--lora-target-modules", "all",
        "--allow-runtime-lora-updating", "--lora-root", str(adapters),
        "--replicas", "2", "--replica-cpus", "1", "--replica-queue-bound", str(QUEUE_BOUND),
    ]  # fmt: skip
    port = _free_port()
    # On a busy CI machine Ray Serve's HTTP proxy can take longer than its 5 s readiness check to start.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "30")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(ray_app({"flags": shlex.join(flags)}), name=APP)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while _http(url + "/health", "GET")[0] != 200:
            assert time.monotonic() < deadline, "the replicated server did not become healthy"
            time.sleep(0.5)
        yield {"url": url, "dirs": dirs, "base_dir": base_dir}
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_names() -> list[str]:
    """The running replicas, as Ray Serve last told this process's router."""
    router = LoRARouter.of(APP, "LoRAReplica")
    if router is None:
        handle = serve.get_deployment_handle("LoRAReplica", APP)
        handle.options(method_name="adapters").remote(route=RouteHint()).result(timeout_s=60)
        router = LoRARouter.of(APP, "LoRAReplica")
    assert router is not None
    return router.replica_names()


def _replicas() -> dict[str, dict[str, Any]]:
    """Every running replica's adapters (name -> tier, pinned), asked of each replica in turn."""
    handle = serve.get_deployment_handle("LoRAReplica", APP)
    deadline = time.monotonic() + 30
    while len(_replica_names()) < 2:
        assert time.monotonic() < deadline, "fewer than 2 replicas running"
        time.sleep(0.2)
    answers = {}
    for name in _replica_names():
        answer = handle.options(method_name="adapters").remote(route=RouteHint(replica=name))
        answers[name] = answer.result(timeout_s=60)["adapters"]
    return answers


def _complete(url: str, model: str, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], str]:
    """One completion over HTTP: its token ids and the replica that answered (its header)."""
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
        raw = client.completions.with_raw_response.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        return list(raw.parse().choices[0].token_ids), raw.headers["x-lora-pin-replica"]


def _prompt(i: int) -> list[int]:
    return [32 + (i * 13 + k * 5) % 90 for k in range(4 + i % 5)]


def test_pinned_adapters_are_resident_on_every_replica(world: dict[str, Any]) -> None:
    replicas = _replicas()
    assert len(replicas) == 2
    for name, adapters in replicas.items():
        for pinned in PINNED:
            assert adapters[pinned]["pinned"], (name, adapters)
            assert adapters[pinned]["tier"] in ("device", "host"), (name, adapters)


def test_outputs_equal_peft_token_for_token(world: dict[str, Any]) -> None:
    oracle = PeftOracle(world["base_dir"], EOS)
    for i, adapter in enumerate([None, *ADAPTERS]):
        prompt = _prompt(i)
        want = oracle.tokens(prompt, None if adapter is None else world["dirs"][adapter], 6)
        got, _ = _complete(world["url"], adapter or "tiny", prompt)
        assert got == want, adapter


def test_one_adapters_requests_stay_on_one_replica_until_it_spills(world: dict[str, Any]) -> None:
    served_by = {_complete(world["url"], "ad2", _prompt(i))[1] for i in range(6)}
    assert len(served_by) == 1, served_by
    assert _replicas()[served_by.pop()]["ad2"]["tier"] == "device"

    async def burst() -> set[str]:
        client = openai.AsyncOpenAI(base_url=world["url"] + "/v1", api_key="none", max_retries=0)

        async def one(i: int) -> str:
            raw = await client.completions.with_raw_response.create(
                model="ad3", prompt=_prompt(i), max_tokens=64, temperature=0, extra_body={"ignore_eos": True}
            )
            return str(raw.headers["x-lora-pin-replica"])

        async with client:
            return set(await asyncio.gather(*(one(i) for i in range(3 * QUEUE_BOUND))))

    # More requests at once than one replica's queue bound: the rest spill to the other replica.
    assert len(asyncio.run(burst())) == 2


def test_adapter_changes_over_http_reach_every_replica(world: dict[str, Any]) -> None:
    url, late = world["url"], str(world["dirs"]["late"])
    status, body = _http(url + "/v1/load_lora_adapter", "POST", {"lora_name": "late", "lora_path": late})
    assert status == 200, body
    assert all("late" in adapters for adapters in _replicas().values())
    status, body = _http(url + "/v1/pin_lora_adapter", "POST", {"lora_name": "late"})
    assert status == 200, body
    assert all(adapters["late"]["pinned"] for adapters in _replicas().values())
    # Refused on every replica alike: the replicas' own answer, and nothing changes anywhere.
    status, body = _http(url + "/v1/load_lora_adapter", "POST", {"lora_name": "x", "lora_path": "/nowhere"})
    assert status == 400, body
    assert not any("x" in adapters for adapters in _replicas().values())
    status, body = _http(url + "/v1/models", "GET")
    assert status == 200 and "late" in {m["id"] for m in body["data"]}, body


def test_a_restarted_replica_comes_back_with_the_adapters_and_pins(world: dict[str, Any]) -> None:
    url, late = world["url"], str(world["dirs"]["late"])
    if "late" not in next(iter(_replicas().values())):
        assert (
            _http(url + "/v1/load_lora_adapter", "POST", {"lora_name": "late", "lora_path": late})[0] == 200
        )
        assert _http(url + "/v1/pin_lora_adapter", "POST", {"lora_name": "late"})[0] == 200
    assert _http(url + "/v1/unload_lora_adapter", "POST", {"lora_name": "ad1"})[0] == 200
    before = set(_replicas())
    victim = sorted(before)[0]
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#LoRAReplica#{victim}", namespace="serve")
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + 90
    while victim in (names := _replica_names()) or len(names) < 2:
        assert time.monotonic() < deadline, f"no replica replaced {victim}: {names}"
        time.sleep(0.5)
    # A replica is running only once it has converged to the desired adapters.
    for name, adapters in _replicas().items():
        assert adapters["late"]["pinned"], (name, adapters)
        assert "ad1" not in adapters, (name, adapters)
        assert adapters["pin0"]["pinned"], (name, adapters)


def _ingress_id() -> str:
    ingress = serve.status().applications[APP].deployments
    assert "LoRAIngress" in ingress, ingress
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#LoRAIngress#" in a["name"]]
    assert len(actors) == 1, actors
    return str(actors[0]["name"])


def test_a_restarted_ingress_keeps_the_adapters_loaded_over_http(world: dict[str, Any]) -> None:
    url, late = world["url"], str(world["dirs"]["late"])
    if "late" not in next(iter(_replicas().values())):
        assert (
            _http(url + "/v1/load_lora_adapter", "POST", {"lora_name": "late", "lora_path": late})[0] == 200
        )
    assert _http(url + "/v1/pin_lora_adapter", "POST", {"lora_name": "late"})[0] == 200
    ingress = serve.get_deployment_handle("LoRAIngress", APP)
    before = ingress.desired_adapters.remote().result(timeout_s=60)
    assert before["adapters"]["late"]["pinned"], before
    old = _ingress_id()
    ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 90
    while True:
        try:
            if _ingress_id() != old and _http(url + "/health", "GET")[0] == 200:
                break
        except AssertionError:
            pass  # between the old ingress and the new one
        assert time.monotonic() < deadline, "no ingress replaced the killed one"
        time.sleep(0.5)
    # The new ingress started with the start-up adapters only; it adopts the replicas' newer ones.
    after = ingress.desired_adapters.remote().result(timeout_s=60)

    def summary(desired: dict[str, Any]) -> tuple[int, dict[str, tuple[str, bool]]]:
        adapters = desired["adapters"]
        return desired["generation"], {
            n: (os.path.realpath(a["path"]), a["pinned"]) for n, a in adapters.items()
        }

    assert summary(after) == summary(before), (before, after)
    # And a replica started after it gets them.
    victim = sorted(_replica_names())[0]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#LoRAReplica#{victim}", namespace="serve"), no_restart=True)
    while victim in (names := _replica_names()) or len(names) < 2:
        assert time.monotonic() < deadline + 90, f"no replica replaced {victim}: {names}"
        time.sleep(0.5)
    for name, adapters in _replicas().items():
        assert adapters["late"]["pinned"], (name, adapters)


def test_models_health_and_metrics_cover_every_replica(world: dict[str, Any]) -> None:
    url, names = world["url"], set(_replica_names())
    status, body = _http(url + "/v1/models", "GET")
    assert status == 200 and "lora_pin_disagreement" not in body, body
    assert {"tiny", *PINNED} <= {m["id"] for m in body["data"]}  # earlier tests load and unload others
    status, body = _http(url + "/health", "GET")
    assert status == 200 and body == {"replicas": dict.fromkeys(names, 200)}, body
    with urllib.request.urlopen(url + "/metrics", timeout=120) as response:
        text = response.read().decode()
    labelled = {name for name in names if f'replica="{name}"' in text}
    assert labelled == names, text[:2000]
