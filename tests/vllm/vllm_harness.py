"""The harness of tests/vllm: a real ``vllm serve`` process (:class:`VllmServer`), PEFT's greedy tokens
(:class:`Oracle`) and the request patterns the tests drive a server with, plugin on or off.

Every wait polls what the server reports, with a generous bound; none sleeps to let something happen.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from lora_pin import _testing

ROOT = Path(__file__).resolve().parents[2]
OVERLAY_PYTHON = ROOT / "target" / "vllm-venv" / "bin" / "python"
EOS = 2  # the char tokenizer's </s>
MAX_MODEL_LEN = 2048
# What a server start may take at most on a busy 2-core machine (its first start compiles kernels).
START_S = 900.0
# What one request may take at most on such a machine.
CALL_S = 180.0
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: Seven adapters over the vLLM model: ranks 4 and 8 (served with --max-lora-rank 8, so a rank-4 slot
#: shows whether its padding is multiplied), attention only or every linear.
ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    f"ad{i}": dict(
        r=8 if i % 2 else 4,
        lora_alpha=16 if i % 3 else 8,
        target_modules=ALL_LINEARS if i % 3 != 1 else ["q_proj", "v_proj"],
        seed=10 + i,
    )
    for i in range(1, 8)
}

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T | None], patience: float = CALL_S, every: float = 0.5) -> T:
    """:func:`lora_pin._testing.wait_for` with this module's patience."""
    return _testing.wait_for(what, check, patience, every)


def prompt(i: int) -> list[int]:
    """A short prompt of printable character ids, different for each ``i``."""
    return [32 + (i * 13 + k * 7) % 90 for k in range(5 + i % 6)]


class Oracle:
    """PEFT's greedy tokens of one prompt alone, through an adapter folder or the base model."""

    def __init__(self, base: Path) -> None:
        from lora_pin._testing import PeftOracle

        self._peft = PeftOracle(base, EOS)
        self._memo: dict[tuple[str | None, tuple[int, ...], int], list[int]] = {}

    def tokens(self, adapter_dir: Path | None, ids: Sequence[int], max_tokens: int) -> list[int]:
        key = (None if adapter_dir is None else str(adapter_dir), tuple(ids), max_tokens)
        if key not in self._memo:
            self._memo[key] = self._peft.tokens(list(ids), adapter_dir, max_tokens)
        return self._memo[key]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    """One ``vllm serve`` process: started by :meth:`start`, stopped by :meth:`stop`; its output goes to
    ``log`` (printed when it fails to start).

    ``env``: variables set for the server beside the harness's own.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        model: the served base model's name (its folder).
        dirs: adapter name -> PEFT folder, as given to ``--lora-modules``.
    """

    def __init__(
        self,
        python: Path,
        model: Path,
        dirs: dict[str, Path],
        log: Path,
        plugin: bool,
        args: Sequence[str],
        pinned: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.python, self.model, self.dirs, self.log, self.plugin = python, str(model), dirs, log, plugin
        self.env = dict(env or {})
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = list(args)
        self.pinned = set(pinned)
        self.process: subprocess.Popen[bytes] | None = None

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        if not self.plugin:
            # An empty allowlist: no plugin at all (unset would load every installed one).
            env["VLLM_PLUGINS"] = ""
        env.update(self.env)
        return env

    def start(self) -> None:
        modules = [
            json.dumps({"name": n, "path": str(p), **({"pinned": True} if n in self.pinned else {})})
            for n, p in self.dirs.items()
        ]
        # With the plugin through the documented switch, `lora-pin vllm-serve`; without, vLLM's own command.
        if self.plugin:
            launcher = [str(self.python.parent / "lora-pin"), "vllm-serve"]
        else:
            launcher = [str(self.python), "-m", "vllm.entrypoints.cli.main", "serve"]
        command = [
            *launcher,
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--enable-lora",
            "--lora-modules",
            *modules,
            *self.args,
        ]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True
            )
        try:
            wait_for("vllm serve answering /health", self._healthy, patience=START_S, every=1.0)
        except AssertionError:
            self.stop()
            sys.stderr.write(self.log.read_text(errors="replace")[-6000:])
            raise

    def _healthy(self) -> bool:
        assert self.process is not None
        assert self.process.poll() is None, f"vllm serve exited with {self.process.returncode}"
        return self.http("/health")[0] == 200

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        # Its own session: the engine core and worker processes go with it.
        os.killpg(self.process.pid, 15)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait(60)

    def http(
        self, path: str, method: str = "GET", body: Any = None, timeout: float = CALL_S
    ) -> tuple[int, Any]:
        """``(status, JSON or text)`` of one request; status 0 when nothing answered."""
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
            return status, payload.decode(errors="replace")

    def served(self) -> set[str]:
        """The model names ``/v1/models`` lists now."""
        status, models = self.http("/v1/models")
        assert status == 200, models
        return {m["id"] for m in models["data"]}

    def refused_load(self, name: str, folder: Path) -> str:
        """Loads the adapter in ``folder`` as ``name`` and returns the error's text, having checked that the
        load answered 500 and that ``name`` is not served afterwards (a refusal registers nothing)."""
        status, body = self.http(
            "/v1/load_lora_adapter", "POST", {"lora_name": name, "lora_path": str(folder)}
        )
        assert status == 500, body
        assert name not in self.served()
        return str(body)

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=CALL_S)

    def complete(self, model: str, ids: Sequence[int], max_tokens: int = 8, **extra: Any) -> list[int]:
        """Greedy token ids of one completion, through the ``openai`` client."""
        with self.client() as client:
            result = client.completions.create(
                model=model,
                prompt=list(ids),
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"return_token_ids": True, **extra},
            )
        return list(result.choices[0].token_ids)

    @contextlib.contextmanager
    def streaming(self, model: str, ids: Sequence[int], max_tokens: int) -> Iterator[list[int]]:
        """A streamed greedy completion running in a thread: the block starts once its first token has
        come back (so the request is running in the engine), and its token ids are in the yielded list
        once the block ends."""
        tokens: list[int] = []
        first = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                with self.client() as client:
                    stream = client.completions.create(
                        model=model,
                        prompt=list(ids),
                        max_tokens=max_tokens,
                        temperature=0,
                        stream=True,
                        extra_body={"return_token_ids": True, "ignore_eos": True},
                    )
                    for chunk in stream:
                        tokens.extend(chunk.choices[0].token_ids or [])
                        if tokens:
                            first.set()
            except BaseException as e:
                failed.append(e)
            finally:
                first.set()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert first.wait(CALL_S), f"no first token of {model} within {CALL_S:g} s"
        assert not failed, failed
        yield tokens
        thread.join(CALL_S)
        assert not thread.is_alive(), f"the stream of {model} did not end"
        assert not failed, failed


LONG = 1500  # tokens of the streams that hold adapters in their slots while a base request runs


def concurrent_mix(server: VllmServer, oracle: Oracle, prompts: int = 3, max_tokens: int = 12) -> list[tuple]:
    """The base model and every adapter, ``prompts`` prompts each, all sent at once (more adapters than
    ``--max-loras``): returns ``(model, prompt index, served tokens, PEFT's)`` for every answer that
    differs from PEFT's greedy tokens."""
    models: list[str | None] = [None, *server.dirs]
    want = {
        (m, i): oracle.tokens(None if m is None else server.dirs[m], prompt(i), max_tokens)
        for m in models
        for i in range(prompts)
    }
    got: dict[tuple[str | None, int], list[int]] = {}
    failed: list[BaseException] = []

    def one(m: str | None, i: int) -> None:
        try:
            got[(m, i)] = server.complete(m or server.model, prompt(i), max_tokens)
        except BaseException as e:
            failed.append(e)

    threads = [threading.Thread(target=one, args=key, daemon=True) for key in want]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not failed, failed
    assert set(got) == set(want)
    return [(m, i, got[(m, i)], want[(m, i)]) for (m, i) in want if got[(m, i)] != want[(m, i)]]


def base_beside_two_adapters(
    server: VllmServer, oracle: Oracle, x: str, y: str, tries: int = 8
) -> tuple[list[int], dict]:
    """A base request served while adapters ``x`` and ``y`` fill both slots (``--max-loras 2``): each
    streams ``LONG`` tokens and is running (its first token came back) before the base request is sent,
    and neither has ended when its answer comes back, so every step of the base request was batched
    with both. Returns the base tokens and PEFT's: ``{"base": ..., x: ..., y: ...}`` for that prompt.

    Whether the streams outlived the base request is judged from what the server sent, not from a timing
    assumption: the tokens each stream's reader holds when the base answer is back (they lag what the
    server generated, so a stream may have ended there a little earlier than its reader shows). A try
    where a stream ended first proves nothing about batching and is made again, up to ``tries`` times;
    none overlapping fails.
    Many tries end so on this 2-core machine: vLLM takes a request that arrives while others decode only
    seconds later, often once they have ended (measured with the plugin and without: a base request sent
    while two adapters' long requests ran came back as they ended, 2-5 s later); three tries were not
    enough in one CI run of 2026-12-06.
    """
    ids = prompt(5)
    want = {
        "base": oracle.tokens(None, ids, 8),
        x: oracle.tokens(server.dirs[x], ids, 8),
        y: oracle.tokens(server.dirs[y], ids, 8),
    }
    for _ in range(tries):
        x_stream, y_stream = server.streaming(x, prompt(6), LONG), server.streaming(y, prompt(7), LONG)
        with x_stream as x_tokens, y_stream as y_tokens:
            base = server.complete(server.model, ids, 8)
            overlapped = len(x_tokens) < LONG and len(y_tokens) < LONG
        if overlapped:
            break
    assert overlapped, f"in {tries} tries a stream ended before the base request did: nothing was batched"
    # The streams are right too (their first tokens: PEFT's greedy decoding of 1500 would take long).
    assert x_tokens[: len(want_x := oracle.tokens(server.dirs[x], prompt(6), 32))] == want_x
    assert y_tokens[: len(want_y := oracle.tokens(server.dirs[y], prompt(7), 32))] == want_y
    return base, want


def prefix_cache_hits(server: VllmServer) -> float:
    """vLLM's count of prompt tokens served from its prefix cache, from ``/metrics``."""
    status, text = server.http("/metrics")
    assert status == 200, text
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:prefix_cache_hits_total in /metrics")


def reload_in_place(
    server: VllmServer, oracle: Oracle, folder: Path, first: str, second: str
) -> dict[str, Any]:
    """Adapter ``swap`` at ``folder`` holds ``first``'s files, then (``load_inplace``, same path)
    ``second``'s; the same prompt (two full KV blocks of ``--block-size 32``) is asked before, twice, and
    after. Returns the tokens served and PEFT's, and the prefix-cache hits of the second request and of
    the one after."""
    import shutil

    ids = [32 + (k * 11) % 90 for k in range(72)]
    shutil.copytree(server.dirs[first], folder)
    load = {"lora_name": "swap", "lora_path": str(folder)}
    status, body = server.http("/v1/load_lora_adapter", "POST", load)
    assert status == 200, body
    before = server.complete("swap", ids, 8)
    hits = prefix_cache_hits(server)
    again = server.complete("swap", ids, 8)
    hits_again = prefix_cache_hits(server) - hits
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(server.dirs[second] / name, folder / name)
    status, body = server.http("/v1/load_lora_adapter", "POST", {**load, "load_inplace": True})
    assert status == 200, body
    hits = prefix_cache_hits(server)
    after = server.complete("swap", ids, 8)
    return {
        "before": before,
        "again": again,
        "after": after,
        "want_before": oracle.tokens(server.dirs[first], ids, 8),
        "want_after": oracle.tokens(server.dirs[second], ids, 8),
        "hits_again": hits_again,
        "hits_after": prefix_cache_hits(server) - hits,
    }


def long_prompt(seed: int) -> list[int]:
    """72 printable ids: two full KV blocks of ``--block-size 32``."""
    return [32 + (k * 7 + seed * 13) % 90 for k in range(72)]


def twin_hits(server: VllmServer, oracle: Oracle, folder: Path) -> float:
    """Adapter ``twin`` loaded from a copy of ``ad3``'s folder (the same weights, another name and
    path); the same prompt asked of ``ad3`` then of ``twin``: the prompt tokens the second request found
    in the prefix cache. Both answers must equal PEFT's."""
    import shutil

    shutil.copytree(server.dirs["ad3"], folder)
    status, body = server.http(
        "/v1/load_lora_adapter", "POST", {"lora_name": "twin", "lora_path": str(folder)}
    )
    assert status == 200, body
    ids = long_prompt(2)
    want = oracle.tokens(server.dirs["ad3"], ids, 4)
    assert server.complete("ad3", ids, 4) == want
    hits = prefix_cache_hits(server)
    assert server.complete("twin", ids, 4) == want
    return prefix_cache_hits(server) - hits
