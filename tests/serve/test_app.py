"""``lora-pin serve`` end to end: the real server on a free localhost port, driven by the official
``openai`` client (sync, async, streaming) and plain HTTP, every completion checked token for token
against the same prompt run alone through PEFT (or the base model) under greedy decoding."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from lora_pin import _testing  # noqa: E402
from lora_pin._testing import PeftOracle  # noqa: E402
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama, save_char_tokenizer  # noqa: E402

EOS = 2  # the char tokenizer's </s>
ADAPTERS = [f"ad{i:02d}" for i in range(12)]
STARTUP = ADAPTERS[:6]  # the first two pinned; the rest are loaded over HTTP
PINNED = ADAPTERS[:2]
API_KEY = "test-key"
# Seconds a wait may take before the test calls it a hang: far past any busy machine, never the outcome.
HANG_GUARD_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A ``lora-pin serve`` subprocess and how to reach it."""

    def __init__(self, args: list[str], log: Path, api_key: str | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = log
        # One thread: the tiny model's forward is far slower with several on a busy CI machine.
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lora_pin", "serve", "--port", str(self.port), *args],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log.read_text()}")
            status, _ = self.http("GET", "/health")
            if status == 200:
                return
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log.read_text()}")

    def http(
        self, method: str, path: str, body: Any = None, raw: bytes | None = None, key: bool = True
    ) -> Any:
        """``(status, parsed JSON or text)``; ``(0, None)`` when nothing answers."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if key and self.api_key is not None:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as e:
            status, payload = e.code, e.read()
        except (urllib.error.URLError, ConnectionError):
            return 0, None
        try:
            return status, json.loads(payload)
        except ValueError:
            return status, payload.decode()

    def client(self) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0)

    def async_client(self, timeout: float | None = None) -> Any:
        return openai.AsyncOpenAI(
            base_url=self.url + "/v1",
            api_key=self.api_key or "none",
            max_retries=0,
            **({} if timeout is None else {"timeout": timeout}),
        )

    def metric(self, name: str, **labels: str) -> dict[str, float]:
        """``{label values: value}`` of every sample of ``name`` in ``/metrics`` whose labels include
        ``labels`` (a sample without labels under ``""``)."""
        status, text = self.http("GET", "/metrics")
        assert status == 200, text
        found: dict[str, float] = {}
        for m in re.finditer(rf"^{name}(?:\{{(.*)\}})? (\S+)$", text, re.M):
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                found[",".join(f"{k}={v}" for k, v in sorted(have.items()))] = float(m.group(2))
        return found

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log_file.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The model, its adapters (and spares to load at run time), the oracle, and two servers: ``lora``
    (12 adapters over 4 slots and an 8-adapter host tier, runtime updates allowed under the adapter root)
    and ``plain`` (LoRA off, an API key, no runtime updates, at most 2 requests queued)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("serve")
    base_dir = make_tiny_llama(root / "base", layers=2)
    save_char_tokenizer(base_dir)
    adapters_dir = root / "adapters"
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    dirs: dict[str, Path] = {}
    targets = (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "down_proj"])
    for i, name in enumerate([*ADAPTERS, "other-weights", "fragile"]):
        dirs[name] = make_peft_adapter(
            base,
            adapters_dir / name,
            r=4 + 4 * (i % 2),
            lora_alpha=16,
            target_modules=targets[i % 3],
            seed=i + 1,
        )
    broken = adapters_dir / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((dirs["ad00"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    outside = make_peft_adapter(
        base, root / "outside", r=4, lora_alpha=16, target_modules=["q_proj"], seed=99
    )
    items = [json.dumps({"lora_name": n, "lora_path": str(dirs[n]), "pinned": n in PINNED}) for n in STARTUP]
    engine = ["--num-blocks", "128", "--page-size", "16", "--max-batch-tokens", "64", "--device", "cpu"]
    lora = Server(
        [
            "--model", str(base_dir), "--served-model-name", "tiny", *engine,
            "--lora-paths", *items, "--max-loras-per-batch", "4", "--max-loaded-loras", "8",
            "--max-lora-rank", "8", "--lora-target-modules", "all",
            "--allow-runtime-lora-updating", "--lora-root", str(adapters_dir), "--max-body-bytes", "65536",
        ],
        root / "lora.log",
    )  # fmt: skip
    plain = Server(
        [
            "--model",
            str(base_dir),
            "--served-model-name",
            "tiny",
            *engine,
            "--api-key",
            API_KEY,
            "--max-queued-requests",
            "2",
        ],
        root / "plain.log",
        api_key=API_KEY,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lora.wait_ready()
        plain.wait_ready()
        yield {
            "lora": lora,
            "plain": plain,
            "dirs": dirs,
            "oracle": PeftOracle(base_dir, EOS),
            "outside": outside,
        }
    finally:
        torch.set_num_threads(threads)
        lora.stop()
        plain.stop()


def _prompt(i: int, length: int | None = None) -> list[int]:
    """A prompt of printable-character ids, different per ``i``, 3 to 40 tokens."""
    n = length or 3 + (i * 7) % 38
    return [32 + (i * 13 + k * 5) % 90 for k in range(n)]


async def _complete(
    client: Any, model: str, prompt: list[int], max_tokens: int, stream: bool, **extra: Any
) -> Any:
    """``(token ids, text)`` of one completion, streamed or whole."""
    body = {"return_token_ids": True, **extra}
    if not stream:
        r = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=body
        )
        return r.choices[0].token_ids, r.choices[0].text
    tokens: list[int] = []
    text = ""
    response = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, extra_body=body
    )
    async for chunk in response:
        if chunk.choices:
            tokens += chunk.choices[0].token_ids
            text += chunk.choices[0].text
    return tokens, text


def _wait_for(condition: Callable[[], bool]) -> None:
    """Poll what the server reports until ``condition`` holds; only a hang ends it otherwise."""
    _testing.wait_for("the server", condition, HANG_GUARD_S, every=0.05)


async def _until(condition: Callable[[], bool]) -> None:
    """:func:`_wait_for` from asyncio code: ``condition`` (blocking HTTP) runs on a worker thread."""
    await asyncio.to_thread(_wait_for, condition)


def _model_field(i: int, adapter: str | None) -> tuple[str, dict[str, Any]]:
    """The three spellings, in turn: vLLM's ``model=<adapter>``, SGLang's ``<base>:<adapter>``, and
    SGLang's ``lora_path`` field."""
    if adapter is None:
        return "tiny", {}
    return [(adapter, {}), (f"tiny:{adapter}", {}), ("tiny", {"lora_path": adapter})][i % 3]


def test_models_list_the_base_and_every_adapter(world: dict[str, Any]) -> None:
    models = {m.id: m for m in world["lora"].client().models.list().data}
    assert set(models) >= {"tiny", *STARTUP}
    assert models["tiny"].parent is None
    assert models["ad03"].parent == "tiny"
    assert models["ad03"].root == str(world["dirs"]["ad03"])


def test_concurrent_requests_over_adapters_base_and_pinned_match_peft(world: dict[str, Any]) -> None:
    """Loads, then 40 concurrent requests (12 adapters, pinned ones, the base; streamed and not; the
    three naming styles) over 4 slots and an 8-adapter host tier, with a pin and an unpin in between."""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    for name in ADAPTERS[6:]:
        status, text = lora.http(
            "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(dirs[name])}
        )
        assert status == 200, text
    jobs = [(i, [None, *ADAPTERS][i % 13], _prompt(i), 4 + i % 9, i % 2 == 1) for i in range(40)]

    async def run() -> list[Any]:
        client = lora.async_client()

        async def one(i: int, adapter: str | None, prompt: list[int], n: int, stream: bool) -> Any:
            model, extra = _model_field(i, adapter)
            return await _complete(client, model, prompt, n, stream, **extra)

        async def admin() -> None:
            await asyncio.sleep(0.2)
            await asyncio.to_thread(lora.http, "POST", "/v1/pin_lora_adapter", {"lora_name": "ad07"})
            await asyncio.sleep(0.2)
            await asyncio.to_thread(lora.http, "POST", "/v1/unpin_lora_adapter", {"lora_name": "ad07"})

        results = await asyncio.gather(*(one(*job) for job in jobs), admin())
        await client.close()
        return results[:-1]

    results = asyncio.run(run())
    for (_, adapter, prompt, n, _), (tokens, text) in zip(jobs, results, strict=True):
        expected = oracle.tokens(prompt, None if adapter is None else dirs[adapter], n)
        assert tokens == expected, (adapter, prompt)
        assert text == "".join(chr(t) for t in expected if t > 2)
    status, metrics = lora.http("GET", "/metrics")
    assert status == 200
    assert 'lora_pin_serve_requests_total{adapter="__base__",outcome="ok"}' in metrics
    assert (
        'lora_pin_adapter_loaded{adapter="ad00",pinned="true",tier="device"}' in metrics or "ad00" in metrics
    )


def test_sync_chat_and_streaming_chat_match_peft(world: dict[str, Any]) -> None:
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    client = lora.client()
    messages = [{"role": "user", "content": "Say hi"}]
    prompt = [ord(c) for c in "user: Say hi\nassistant:"]
    for model, adapter in (("tiny", None), ("ad01", "ad01"), ("tiny:ad04", "ad04")):
        expected = oracle.tokens(prompt, None if adapter is None else dirs[adapter], 6)
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        assert r.choices[0].message.content == "".join(chr(t) for t in expected if t > 2)
        assert r.usage.prompt_tokens == len(prompt)
        chunks = client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, temperature=0, stream=True
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == r.choices[0].message.content
        )


def test_prefix_sharing_same_prompt_and_an_adapter_replaced_under_its_name(world: dict[str, Any]) -> None:
    """The same prompt under the base and two adapters at once, then ``ad05`` unloaded and loaded again
    under its name with other weights: each request gets its own adapter's tokens (block sharing would
    hand KV computed under one to another)."""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    prompt = _prompt(5, length=40)  # longer than two KV pages

    async def same_prompt(models: list[str]) -> list[Any]:
        client = lora.async_client()
        results = await asyncio.gather(*(_complete(client, m, prompt, 8, False) for m in models))
        await client.close()
        return results

    models = ["tiny", "ad05", "ad02", "tiny", "ad05"]
    for model, (tokens, _) in zip(models, asyncio.run(same_prompt(models)), strict=True):
        assert tokens == oracle.tokens(prompt, None if model == "tiny" else dirs[model], 8), model
    status, body = lora.http("POST", "/unload_lora_adapter", {"lora_name": "ad05"})
    assert status == 200 and body["success"] and "ad05" not in body["loaded_adapters"]
    status, body = lora.http(
        "POST", "/load_lora_adapter", {"lora_name": "ad05", "lora_path": str(dirs["other-weights"])}
    )
    assert status == 200 and body["success"], body
    (tokens, _), (base_tokens, _) = asyncio.run(same_prompt(["ad05", "tiny"]))
    assert tokens == oracle.tokens(prompt, dirs["other-weights"], 8)
    assert tokens != oracle.tokens(prompt, dirs["ad05"], 8)
    assert base_tokens == oracle.tokens(prompt, None, 8)
    status, text = lora.http(
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "ad05", "lora_path": str(dirs["ad05"]), "load_inplace": True},
    )
    assert status == 200, text
    assert asyncio.run(same_prompt(["ad05"]))[0][0] == oracle.tokens(prompt, dirs["ad05"], 8)
    # An in-place load that is refused (a broken file) leaves the old weights serving under the name.
    status, _ = lora.http(
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "ad05", "lora_path": str(dirs["ad00"].parent / "broken"), "load_inplace": True},
    )
    assert status == 400
    assert asyncio.run(same_prompt(["ad05"]))[0][0] == oracle.tokens(prompt, dirs["ad05"], 8)


def test_refusals_change_nothing_and_the_server_goes_on(world: dict[str, Any]) -> None:
    lora, plain, dirs = world["lora"], world["plain"], world["dirs"]
    client = lora.client()
    before = sorted(m.id for m in client.models.list().data)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"lora_path": "nope"})
    # Outside --lora-root, a bad file, a duplicate: the peers' status codes, nothing loaded.
    status, body = lora.http(
        "POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(world["outside"])}
    )
    assert status == 400 and "outside" in body["error"]["message"]
    status, body = lora.http(
        "POST", "/load_lora_adapter", {"lora_name": "x", "lora_path": str(dirs["ad00"].parent / "broken")}
    )
    assert status == 400 and body["success"] is False and body["error_message"]
    status, body = lora.http(
        "POST", "/v1/load_lora_adapter", {"lora_name": "ad00", "lora_path": str(dirs["ad00"])}
    )
    assert status == 400 and "already been loaded" in body["error"]["message"]
    status, body = lora.http("POST", "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert status == 404 and body["error"]["type"] == "NotFoundError"
    status, body = lora.http("POST", "/v1/load_lora_adapter", {"lora_name": "x"})
    assert status == 400
    assert sorted(m.id for m in client.models.list().data) == before
    # Malformed JSON, a body too large, a non-object body, a bad prompt, a negative temperature: 4xx.
    assert lora.http("POST", "/v1/completions", raw=b'{"model": ')[0] == 400
    assert lora.http("POST", "/v1/completions", raw=b"[1, 2]")[0] == 400
    assert lora.http("POST", "/v1/completions", raw=b'{"prompt": "' + b"x" * 70000 + b'"}')[0] == 413
    assert lora.http("POST", "/v1/completions", {"model": "tiny", "prompt": [1, 999]})[0] == 400
    assert (
        lora.http("POST", "/v1/completions", {"model": "tiny", "prompt": "a", "temperature": -0.7})[0] == 400
    )
    # Without --allow-runtime-lora-updating the adapter endpoints do not exist; without the key, 401.
    assert (
        plain.http("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(dirs["ad00"])})[0]
        == 404
    )
    assert (
        plain.http("POST", "/load_lora_adapter", {"lora_name": "x", "lora_path": str(dirs["ad00"])})[0] == 404
    )
    assert plain.http("GET", "/v1/models", key=False)[0] == 401
    assert plain.http("POST", "/v1/completions", {"model": "tiny", "prompt": "a"}, key=False)[0] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=plain.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        plain.client().completions.create(model="ad00", prompt="hi", max_tokens=2)
    # Both servers still answer, and correctly.
    prompt = _prompt(3)
    for server in (lora, plain):
        r = server.client().completions.create(
            model="tiny", prompt=prompt, max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
        )
        assert r.choices[0].token_ids == world["oracle"].tokens(prompt, None, 5)
        assert server.http("GET", "/health")[0] == 200


def test_a_failed_adapter_read_fails_its_request_alone(world: dict[str, Any]) -> None:
    """``fragile`` is evicted from host memory, its file then broken: its next request is answered with
    an error while the others run on, and the engine stays healthy."""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    status, text = lora.http(
        "POST", "/v1/load_lora_adapter", {"lora_name": "fragile", "lora_path": str(dirs["fragile"])}
    )
    assert status == 200, text
    client = lora.client()
    client.completions.create(model="fragile", prompt="ab", max_tokens=1)
    for name in ADAPTERS[2:12]:  # ten unpinned adapters through an eight-adapter host tier
        client.completions.create(model=name, prompt="ab", max_tokens=1)
    weights = dirs["fragile"] / "adapter_model.safetensors"
    weights.write_bytes(b"broken" + weights.read_bytes()[6:])

    async def run() -> list[Any]:
        c = lora.async_client()
        results = await asyncio.gather(
            _complete(c, "fragile", _prompt(1), 4, False),
            _complete(c, "ad03", _prompt(2), 4, False),
            _complete(c, "tiny", _prompt(3), 4, True),
            return_exceptions=True,
        )
        await c.close()
        return results

    failed, ok, base = asyncio.run(run())
    assert isinstance(failed, openai.InternalServerError), failed
    assert ok[0] == oracle.tokens(_prompt(2), dirs["ad03"], 4)
    assert base[0] == oracle.tokens(_prompt(3), None, 4)
    assert lora.http("GET", "/health")[0] == 200


def test_an_unload_waits_for_the_adapters_queued_and_running_requests(world: dict[str, Any]) -> None:
    """Requests of ``ad09`` running and queued when its unload arrives all finish with its tokens; a new
    request for it meanwhile is 404; the unload answers once they are done.

    Each move waits for what the server reports, not for time to pass: the unload is sent once all six
    requests count as outstanding, the new request once ``ad09`` has left ``/v1/models`` (draining)."""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    prompts = [_prompt(20 + i, length=30) for i in range(6)]
    n = 200  # long enough that the unload arrives while they run

    def outstanding() -> float:
        return sum(lora.metric("lora_pin_serve_requests_outstanding", adapter="ad09").values())

    def listed() -> bool:
        return "ad09" in {m.id for m in lora.client().models.list().data}

    async def run() -> tuple[list[Any], float, Any, Any]:
        client = lora.async_client()
        requests = [
            asyncio.create_task(_complete(client, "ad09", p, n, i % 2 == 0, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        await _until(lambda: outstanding() == len(prompts))
        unload = asyncio.create_task(
            asyncio.to_thread(lora.http, "POST", "/v1/unload_lora_adapter", {"lora_name": "ad09"})
        )
        await _until(lambda: not listed())
        at_drain = await asyncio.to_thread(outstanding)
        refused = await asyncio.gather(
            _complete(client, "ad09", prompts[0], 2, False), return_exceptions=True
        )
        results = await asyncio.gather(*requests)
        unloaded = await unload
        await client.close()
        return results, at_drain, refused[0], unloaded

    results, at_drain, refused, (status, text) = asyncio.run(run())
    assert at_drain > 0, "the requests ended before the unload began: the test proves nothing"
    # Had the unload not waited for them, their adapter would have gone from under them.
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        expected = oracle.tokens(prompt, dirs["ad09"], n)
        assert tokens[: len(expected)] == expected and len(tokens) == n
    assert isinstance(refused, openai.NotFoundError)
    assert status == 200, text
    assert "ad09" not in {m.id for m in lora.client().models.list().data}


def test_a_client_that_goes_away_cancels_its_request_and_leaves_nothing_behind(world: dict[str, Any]) -> None:
    """A streamed request closed after its first chunk and a plain one whose client gives up (its task
    cancelled once the server counts the request), both far from their last token: each is cancelled in
    the engine (counted ``cancelled``, not answered), and nothing of them stays in the engine's tables
    or the adapters' counts (``/metrics``)."""
    lora = world["lora"]

    def cancelled() -> float:
        return sum(lora.metric("lora_pin_serve_requests_total", outcome="cancelled").values())

    def outstanding(adapter: str) -> float:
        return sum(lora.metric("lora_pin_serve_requests_outstanding", adapter=adapter).values())

    before = cancelled()

    async def run() -> None:
        client = lora.async_client()
        stream = await client.completions.create(
            model="ad02",
            prompt=_prompt(7),
            max_tokens=220,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            break
        await stream.close()
        impatient = asyncio.create_task(
            client.completions.create(
                model="ad03",
                prompt=_prompt(8),
                max_tokens=220,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        )
        await _until(lambda: outstanding("ad03") == 1)
        impatient.cancel()  # the client gives up: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await impatient
        await client.close()

    asyncio.run(run())

    def nothing_left() -> bool:
        held = lora.metric("lora_pin_serve_engine_requests")
        outstanding = lora.metric("lora_pin_serve_requests_outstanding")
        return not any(held.values()) and not outstanding and cancelled() - before == 2

    _wait_for(nothing_left)
    held = lora.metric("lora_pin_serve_engine_requests")
    assert set(held) == {f"state={s}" for s in ("queued", "running", "tracked", "result_handlers")}
    prompt = _prompt(9)
    r = lora.client().completions.create(
        model="ad03", prompt=prompt, max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].token_ids == world["oracle"].tokens(prompt, world["dirs"]["ad03"], 5)


def test_past_max_queued_requests_a_request_is_refused_with_503_and_retry_after(
    world: dict[str, Any],
) -> None:
    """``plain`` lets at most 2 requests wait for the engine to start them. 16 at once, each a prefill of
    most of a step's token budget (so the engine starts about one a step): the ones past the bound get
    SGLang's answer, 503 "The request queue is full." in OpenAI's error shape with ``Retry-After``; the
    others their own tokens; and the server answers on."""
    plain, oracle = world["plain"], world["oracle"]
    prompts = [_prompt(40 + i, length=60) for i in range(16)]

    def refused() -> float:
        return sum(plain.metric("lora_pin_serve_requests_total", outcome="refused").values())

    before = refused()

    async def run() -> list[Any]:
        client = plain.async_client()
        results = await asyncio.gather(
            *(_complete(client, "tiny", p, 3, False) for p in prompts), return_exceptions=True
        )
        await client.close()
        return results

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors, "no request was refused: the bound was never reached"
    for e in errors:
        assert isinstance(e, openai.InternalServerError) and e.status_code == 503, e
        assert e.response.headers["retry-after"] == "1"
        assert e.response.json()["error"] == {
            "message": "The request queue is full.",
            "type": "ServiceUnavailable",
            "param": None,
            "code": 503,
        }
    for prompt, result in zip(prompts, results, strict=True):
        if not isinstance(result, BaseException):
            assert result[0] == oracle.tokens(prompt, None, 3)
    assert refused() - before == len(errors)
    assert plain.client().completions.create(model="tiny", prompt=prompts[0], max_tokens=3).choices
