"""``lora-pin serve`` as people use servers: sampling, seeds, ``n``, stop strings, log-probabilities,
strict parameters, prefix caching keyed by adapter, versions that never mix, and the operations
endpoints. The real server on a free localhost port, driven by the official ``openai`` client, every
output checked against PEFT (greedy tokens, ``log_softmax`` of its logits) or against the server's own
answers for the same seed."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_app import HANG_GUARD_S, Server  # noqa: E402

from lora_pin._testing import PeftOracle  # noqa: E402
from lora_pin.fixtures import make_peft_adapter, make_tiny_llama, save_char_tokenizer  # noqa: E402

EOF_ID = 2  # the char tokenizer's </s>
ADAPTERS = ["a0", "a1", "a2", "a3", "a4", "a5"]
API_KEY = "parity-key"
PAGE = 16


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny model, adapters ``a0``..``a5`` (``twin``: ``a0``'s weights under another name;
    ``swap``/``swap2``: weights to replace ``a5`` with), and two servers: ``lora`` (prefix caching on,
    an API key, 3 slots) and ``plain`` (``--no-prefix-caching``, the key on every endpoint, a host tier of
    4 adapters for 7 given at start-up, a tokenizer folder and a chat template file of its own, requests
    offered longest remaining first)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("parity")
    base_dir = make_tiny_llama(root / "base", layers=2)
    save_char_tokenizer(base_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    adapters = root / "adapters"
    dirs: dict[str, Path] = {}
    for i, name in enumerate([*ADAPTERS, "swap", "swap2"]):
        dirs[name] = make_peft_adapter(
            base, adapters / name, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=i + 1
        )
    dirs["twin"] = make_peft_adapter(
        base, adapters / "twin", r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=1
    )
    items = [json.dumps({"lora_name": n, "lora_path": str(dirs[n])}) for n in [*ADAPTERS, "twin"]]
    common = [
        "--model", str(base_dir), "--served-model-name", "tiny", "--device", "cpu",
        "--num-blocks", "128", "--page-size", str(PAGE), "--max-batch-tokens", "64",
        "--lora-paths", *items, "--max-loras-per-batch", "3", "--max-loaded-loras", "10",
        "--max-lora-rank", "8", "--lora-target-modules", "all",
        "--allow-runtime-lora-updating", "--lora-root", str(adapters), "--api-key", API_KEY,
    ]  # fmt: skip
    template = root / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    lora = Server(common, root / "lora.log", api_key=API_KEY)
    plain = Server(
        # Seven start-up adapters over a host tier of four: all are registered.
        [
            *common,
            "--no-prefix-caching",
            "--admission-order",
            "longest-remaining",
            "--api-key-all-endpoints",
            "--log-interval",
            "0.5",
            "--max-loaded-loras",
            "4",
            "--tokenizer",
            str(base_dir),
            "--chat-template",
            str(template),
        ],
        root / "plain.log",
        api_key=API_KEY,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lora.wait_ready()
        plain.wait_ready()
        yield {"lora": lora, "plain": plain, "dirs": dirs, "oracle": PeftOracle(base_dir, EOF_ID)}
    finally:
        torch.set_num_threads(threads)
        lora.stop()
        plain.stop()


def _prompt(i: int, length: int) -> list[int]:
    return [32 + (i * 13 + k * 5) % 90 for k in range(length)]


def _complete(server: Server, **kwargs: Any) -> Any:
    extra = kwargs.pop("extra_body", {})
    return server.client().completions.create(extra_body={"return_token_ids": True, **extra}, **kwargs)


async def _acomplete(client: Any, **kwargs: Any) -> Any:
    extra = kwargs.pop("extra_body", {})
    return await client.completions.create(extra_body={"return_token_ids": True, **extra}, **kwargs)


def _outstanding(server: Server, adapter: str) -> float:
    return sum(server.metric("lora_pin_serve_requests_outstanding", adapter=adapter).values())


# ---- sampling ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("server", ["lora", "plain"])
def test_a_seeded_request_gives_the_same_tokens_alone_and_in_any_batch(
    world: dict[str, Any], server: str
) -> None:
    """``seed`` 7 at temperature 1 over ``a1``: alone, then among 9 other requests (other adapters, the
    base, greedy and sampled, other seeds) twice in different orders: the same tokens every time, and
    the greedy ones PEFT's. Other seeds give other tokens (the draws are random, not the argmax). On
    both servers: ``plain`` offers requests longest remaining first, so with 3 slots for 5 adapters
    requests sit out steps mid-decode."""
    lora = world[server]
    prompt = _prompt(3, 12)
    ask = {"model": "a1", "prompt": prompt, "max_tokens": 24, "temperature": 1.0, "seed": 7}
    alone = _complete(lora, **ask).choices[0].token_ids
    greedy = world["oracle"].tokens(prompt, world["dirs"]["a1"], 24)
    assert alone != greedy

    async def crowd(order: int) -> list[Any]:
        client = lora.async_client()
        others = [
            {"model": m, "prompt": _prompt(i, 5 + i), "max_tokens": 20, "temperature": t, "seed": i}
            for i, (m, t) in enumerate(
                [
                    *[("a0", 1.0), ("tiny", 0.0), ("a2", 0.7), ("a1", 1.3), ("tiny", 1.0)],
                    *[("a3", 0.0), ("a1", 0.5), ("a0", 0.0), ("a4", 1.0)],
                ]
            )
        ]
        jobs = [*others[:order], ask, *others[order:]]
        results = await asyncio.gather(*(_acomplete(client, **job) for job in jobs))
        await client.close()
        for job, r in zip(jobs, results, strict=True):
            if job["temperature"] == 0.0:
                adapter = None if job["model"] == "tiny" else world["dirs"][job["model"]]
                want = world["oracle"].tokens(job["prompt"], adapter, job["max_tokens"])
                assert r.choices[0].token_ids == want, job
        return [r.choices[0].token_ids for r in results]

    for order in (0, 6):
        assert asyncio.run(crowd(order))[order] == alone
    others = {tuple(_complete(lora, **{**ask, "seed": s}).choices[0].token_ids) for s in (8, 9, 10)}
    assert tuple(alone) not in others


def test_sampling_that_can_only_pick_the_top_token_is_greedy(world: dict[str, Any]) -> None:
    """``top_k`` 1, a ``top_p`` that keeps one token, and a temperature near 0 (with a seed): PEFT's
    greedy tokens, through the sampling path. (Near 0 is 1e-4 here: the random tiny model's two most
    likely tokens can be closer than 0.05 in logit, which 0.01 would not separate.)"""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    for i, adapter in enumerate(["a2", None]):
        prompt = _prompt(10 + i, 9)
        want = oracle.tokens(prompt, None if adapter is None else dirs[adapter], 16)
        model = adapter or "tiny"
        for extra in ({"top_k": 1}, {"top_p": 1e-9}, {"seed": 3}):
            temperature = 1e-4 if "seed" in extra else 1.0
            r = _complete(
                lora,
                model=model,
                prompt=prompt,
                max_tokens=16,
                temperature=temperature,
                extra_body={"seed": extra.get("seed", 1), **{k: v for k, v in extra.items() if k != "seed"}},
            )
            assert r.choices[0].token_ids == want, (model, extra)


def test_top_k_keeps_the_draws_among_the_k_most_likely(world: dict[str, Any]) -> None:
    """The first token of 32 draws with ``top_k`` 3 (``n`` 8, four seeds) is always one of PEFT's 3 most
    likely first tokens, and more than one of them comes up."""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    prompt = _prompt(20, 10)
    top3 = set(oracle.log_softmax(prompt, dirs["a3"], [0])[0].topk(3).indices.tolist())
    firsts: list[int] = []
    for seed in range(4):
        r = _complete(
            lora,
            model="a3",
            prompt=prompt,
            max_tokens=1,
            temperature=2.0,
            n=8,
            extra_body={"top_k": 3, "seed": seed},
        )
        assert [c.index for c in r.choices] == list(range(8))
        firsts += [c.token_ids[0] for c in r.choices]
    assert set(firsts) <= top3 and len(set(firsts)) > 1, (firsts, top3)


def test_n_seeded_choices_stream_as_they_answer_whole(world: dict[str, Any]) -> None:
    """``n`` 3 with a seed and a stop string, streamed with usage and whole: each choice's streamed text,
    tokens and end equal the whole answer's (choice j draws with ``seed + j``), the choices differ, and
    the usage chunk counts every choice's tokens."""
    lora = world["lora"]
    ask = {
        "model": "a2", "prompt": _prompt(90, 8), "max_tokens": 20, "temperature": 1.0, "n": 3,
        "extra_body": {"seed": 11, "stop": ["A"]},
    }  # fmt: skip
    whole = _complete(lora, **ask)
    assert len({tuple(c.token_ids) for c in whole.choices}) == 3
    texts, tokens, ends = ["", "", ""], [[], [], []], [None, None, None]
    usage = None
    for chunk in _complete(lora, stream=True, stream_options={"include_usage": True}, **ask):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            tokens[c.index] += c.token_ids
            ends[c.index] = c.finish_reason or ends[c.index]
    for c in whole.choices:
        assert (texts[c.index], tokens[c.index], ends[c.index]) == (c.text, c.token_ids, c.finish_reason)
        assert "A" not in c.text
    assert usage is not None and usage.completion_tokens == sum(len(t) for t in tokens)


def test_n_choices_share_their_prompts_prefill(world: dict[str, Any]) -> None:
    """``n`` 3 over a fresh 40-token prompt (two whole pages), greedy, streamed and not: the first choice
    computes the prompt, the two others are each given its two pages by the prefix cache (the server's
    hit counter grows by four pages; the answer reports two), and every choice equals PEFT's tokens."""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]

    def hits() -> float:
        return sum(lora.metric("lora_pin_serve_prefix_cache_hit_tokens_total").values())

    for k, stream in enumerate((False, True)):
        before = hits()
        prompt = _prompt(95 + k, 40)
        want = oracle.tokens(prompt, dirs["a3"], 5)
        ask = {"model": "a3", "prompt": prompt, "max_tokens": 5, "temperature": 0, "n": 3}
        if not stream:
            r = _complete(lora, **ask)
            choices = {c.index: c.token_ids for c in r.choices}
            usage = r.usage
        else:
            choices, usage = {0: [], 1: [], 2: []}, None
            for chunk in _complete(lora, stream=True, stream_options={"include_usage": True}, **ask):
                usage = chunk.usage or usage
                for c in chunk.choices:
                    choices[c.index] += c.token_ids
        assert choices == {0: want, 1: want, 2: want}
        assert usage is not None and usage.prompt_tokens_details.cached_tokens == 2 * PAGE
        assert hits() - before == 2 * 2 * PAGE


# ---- stop strings, stop tokens, logprobs ----------------------------------------------------------------


def test_a_stop_string_ends_the_text_before_it_even_split_across_chunks(world: dict[str, Any]) -> None:
    """A two-character stop string (two tokens of the char tokenizer, so two stream chunks) taken from
    PEFT's greedy text: the text ends just before it, streamed or not, ``finish_reason`` is ``stop``, and
    no chunk carries its first character."""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    prompt = _prompt(30, 8)
    greedy = oracle.tokens(prompt, dirs["a0"], 30)
    text = "".join(chr(t) for t in greedy if t > 2)
    cut = next(k for k in range(4, len(text) - 1) if text[k : k + 2] not in text[:k])
    stop = text[cut : cut + 2]
    ask = {"model": "a0", "prompt": prompt, "max_tokens": 30, "temperature": 0, "stop": [stop, "\x7f\x7f"]}
    whole = lora.client().completions.create(**ask)
    assert whole.choices[0].text == text[:cut] and whole.choices[0].finish_reason == "stop"
    chunks = list(lora.client().completions.create(stream=True, **ask))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == text[:cut]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    chat = lora.client().chat.completions.create(
        model="a0", messages=[{"role": "user", "content": "hi"}], max_tokens=30, temperature=0, stop=stop
    )
    assert stop not in (chat.choices[0].message.content or "")


def test_stop_token_ids_end_a_choice_on_that_token(world: dict[str, Any]) -> None:
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    prompt = _prompt(31, 8)
    greedy = oracle.tokens(prompt, dirs["a2"], 20)
    token = greedy[5]
    r = _complete(
        lora,
        model="a2",
        prompt=prompt,
        max_tokens=20,
        temperature=0,
        extra_body={"stop_token_ids": [token]},
    )
    assert r.choices[0].token_ids == greedy[: greedy.index(token) + 1]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs_equal_log_softmax_of_pefts_logits(world: dict[str, Any]) -> None:
    """Completions' ``logprobs`` 5 and chat's ``top_logprobs`` 3, streamed and not, for an adapter and
    the base: every chosen and top log-probability equals ``log_softmax`` of PEFT's logits for that row,
    to float32 rounding."""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    for model, adapter in (("a4", dirs["a4"]), ("tiny", None)):
        prompt = _prompt(40, 11)
        r = _complete(lora, model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=5)
        tokens = r.choices[0].token_ids
        ref = oracle.log_softmax(prompt, adapter, tokens)
        lp = r.choices[0].logprobs
        assert lp.tokens == [chr(t) if t > 2 else "" for t in tokens] or len(lp.tokens) == len(tokens)
        for k, t in enumerate(tokens):
            assert lp.token_logprobs[k] == pytest.approx(float(ref[k, t]), abs=1e-4)
            top = ref[k].topk(5)
            got = sorted(lp.top_logprobs[k].values(), reverse=True)
            assert got == pytest.approx(top.values.tolist()[: len(got)], abs=1e-4)
            assert len(got) == len({chr(i) for i in top.indices.tolist()})
        chunks = lora.client().completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=5, stream=True
        )
        streamed = [
            x
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for x in c.choices[0].logprobs.token_logprobs
        ]
        assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)
    messages = [{"role": "user", "content": "abc"}]
    chat_prompt = [ord(c) for c in "user: abc\nassistant:"]
    r = lora.client().chat.completions.create(
        model="a4", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    tokens = [ord(e.token) for e in content]
    ref = oracle.log_softmax(chat_prompt, dirs["a4"], tokens)
    for k, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(ref[k, tokens[k]]), abs=1e-4)
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(
            ref[k].topk(3).values.tolist(), abs=1e-4
        )


# ---- strict parameters and the defects ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("repetition_penalty", 1.2),
        ("logit_bias", {"65": 5}),
        ("echo", True),
        ("best_of", 3),
        ("suffix", "x"),
        ("stream", "yes"),
        ("temperature", -1),
        ("temperature", "0.5"),
        ("top_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("logprobs", 99),
        ("seed", True),
        ("stop", [1]),
        ("stream_options", 5),
        ("no_such_field", 1),
    ],
)
def test_a_parameter_the_server_does_not_honour_is_refused_by_name(
    world: dict[str, Any], field: str, value: Any
) -> None:
    lora = world["lora"]
    status, body = lora.http("POST", "/v1/completions", {"model": "a3", "prompt": "ab", field: value})
    assert status == 400, body
    assert body["error"]["param"] == field, body


def test_chat_tools_and_response_formats_are_refused_and_nulls_are_defaults(world: dict[str, Any]) -> None:
    lora = world["lora"]
    messages = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for field, value in (
        ("tools", [tool]),
        ("response_format", {"type": "json_object"}),
        ("top_logprobs", 2),
    ):
        status, body = lora.http(
            "POST", "/v1/chat/completions", {"model": "tiny", "messages": messages, field: value}
        )
        assert status == 400 and body["error"]["param"] == field, body
    nulls = {
        k: None for k in ("n", "max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "stream")
    }
    status, body = lora.http(
        "POST", "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 3, **nulls}
    )
    assert status == 200, body


def test_a_refused_stream_options_leaks_no_request_and_the_adapter_unloads(world: dict[str, Any]) -> None:
    """``stream_options: 5`` was a 500 that kept the adapter's request count up for good (an unload then
    blocked and failed). Now: 400, nothing outstanding, and the unload answers at once."""
    lora, dirs = world["lora"], world["dirs"]
    status, body = lora.http(
        "POST", "/load_lora_adapter", {"lora_name": "leaky", "lora_path": str(dirs["swap2"])}
    )
    assert status == 200, body
    for _ in range(3):
        status, body = lora.http(
            "POST", "/v1/completions", {"model": "leaky", "prompt": "ab", "stream": True, "stream_options": 5}
        )
        assert status == 400 and body["error"]["param"] == "stream_options"
    assert _outstanding(lora, "leaky") == 0
    started = time.monotonic()
    status, body = lora.http("POST", "/v1/unload_lora_adapter", {"lora_name": "leaky"})
    assert status == 200, body
    assert time.monotonic() - started < HANG_GUARD_S / 4


def test_max_tokens_defaults_to_the_room_left_in_the_context(world: dict[str, Any]) -> None:
    """The tiny model's context is 256 tokens: a prompt of 250 without ``max_tokens`` is answered with at
    most 6 tokens (it was refused: a fixed default did not fit)."""
    lora = world["lora"]
    r = _complete(lora, model="a1", prompt=_prompt(50, 250), temperature=0, extra_body={"ignore_eos": True})
    assert len(r.choices[0].token_ids) == 6 and r.choices[0].finish_reason == "length"
    status, body = lora.http(
        "POST", "/v1/completions", {"model": "a1", "prompt": _prompt(50, 250), "max_tokens": 7}
    )
    assert status == 400 and body["error"]["param"] == "max_tokens"


def test_an_adapter_name_no_request_could_reach_is_refused(world: dict[str, Any]) -> None:
    lora, dirs = world["lora"], world["dirs"]
    before = sorted(m.id for m in lora.client().models.list().data)
    for name in ("tiny", "tiny:x", "x" * 5000):
        status, body = lora.http(
            "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(dirs["swap"])}
        )
        assert status == 400, (name[:20], body)
    # A string is not a boolean: "no" would have replaced a0's weights.
    status, body = lora.http(
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "a0", "lora_path": str(dirs["swap"]), "load_inplace": "no"},
    )
    assert status == 400 and body["error"]["param"] == "load_inplace", body
    assert sorted(m.id for m in lora.client().models.list().data) == before


# ---- prefix caching ------------------------------------------------------------------------------------


def test_the_prefix_cache_hits_within_an_adapters_weights_and_never_across(world: dict[str, Any]) -> None:
    """One 40-token prompt (two full pages) in turn: the cached prompt tokens each answer reports are the
    two pages exactly when an earlier request had the same weights (``a0`` again, ``twin`` with ``a0``'s
    weights, the base again) and 0 for other adapters, the base after adapters, and ``a5`` after its
    weights were replaced; every answer equals PEFT's. Then 12 concurrent requests of the prompt over
    four adapters and the base: each equals PEFT's for its own weights."""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    prompt = _prompt(60, 40)

    def ask(model: str) -> tuple[list[int], int]:
        r = _complete(lora, model=model, prompt=prompt, max_tokens=6, temperature=0)
        return r.choices[0].token_ids, r.usage.prompt_tokens_details.cached_tokens

    def peft(model: str, weights: str | None = None) -> list[int]:
        return oracle.tokens(prompt, None if model == "tiny" else dirs[weights or model], 6)

    hits_before = sum(lora.metric("lora_pin_serve_prefix_cache_hit_tokens_total").values())
    sequence = [
        ("a0", 0), ("a0", 2 * PAGE), ("a1", 0), ("tiny", 0), ("tiny", 2 * PAGE), ("twin", 2 * PAGE),
        ("a5", 0), ("a1", 2 * PAGE),
    ]  # fmt: skip
    for model, cached in sequence:
        tokens, got = ask(model)
        assert tokens == peft(model), model
        assert got == cached, (model, got)
    hits = sum(lora.metric("lora_pin_serve_prefix_cache_hit_tokens_total").values()) - hits_before
    assert hits == 4 * 2 * PAGE
    status, text = lora.http(
        "POST",
        "/v1/load_lora_adapter",
        {"lora_name": "a5", "lora_path": str(dirs["swap"]), "load_inplace": True},
    )
    assert status == 200, text
    tokens, got = ask("a5")
    assert got == 0 and tokens == peft("a5", "swap")
    assert tokens != peft("a5")

    async def crowd() -> list[Any]:
        client = lora.async_client()
        models = ["a0", "a1", "a2", "a3", "tiny", "a5"] * 2
        results = await asyncio.gather(
            *(_acomplete(client, model=m, prompt=prompt, max_tokens=6, temperature=0) for m in models)
        )
        await client.close()
        return list(zip(models, results, strict=True))

    for model, r in asyncio.run(crowd()):
        assert r.choices[0].token_ids == peft(model, "swap" if model == "a5" else None), model


def test_without_prefix_caching_nothing_is_shared(world: dict[str, Any]) -> None:
    plain = world["plain"]
    prompt = _prompt(61, 40)
    for _ in range(2):
        r = _complete(plain, model="a0", prompt=prompt, max_tokens=3, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_start_up_adapters_past_the_host_tier_are_all_served(world: dict[str, Any]) -> None:
    """``plain`` was given 7 start-up adapters for a host tier of 4 (refused before): each is listed and
    answers PEFT's tokens, in two rounds (the host tier evicts and reads them again)."""
    plain, dirs, oracle = world["plain"], world["dirs"], world["oracle"]
    names = [*ADAPTERS, "twin"]
    assert {m.id for m in plain.client().models.list().data} >= set(names)
    prompt = _prompt(62, 7)
    for _ in range(2):
        for name in names:
            r = _complete(plain, model=name, prompt=prompt, max_tokens=4, temperature=0)
            assert r.choices[0].token_ids == oracle.tokens(prompt, dirs[name], 4), name


# ---- versions ------------------------------------------------------------------------------------------


def test_an_in_place_load_amid_running_requests_keeps_each_on_one_version(world: dict[str, Any]) -> None:
    """8 streamed requests of ``a4`` running (each has sent a token) when ``a4``'s weights are replaced
    in place, and one more request sent once the server logs that the replacement waits: each of the 8
    equals PEFT's tokens for the old weights from first to last, the one sent meanwhile PEFT's for the
    new ones."""
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    prompts = [_prompt(70 + i, 10) for i in range(8)]
    n = 200
    waits = "adapter 'a4': replacement from"

    async def run() -> tuple[list[list[int]], list[int], int, bool]:
        client = lora.async_client()
        started = [asyncio.Event() for _ in prompts]

        async def one(i: int) -> list[int]:
            tokens: list[int] = []
            stream = await _acomplete(
                client, model="a4", prompt=prompts[i], max_tokens=n, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            async for chunk in stream:
                if chunk.choices:
                    tokens += chunk.choices[0].token_ids
                    started[i].set()
            return tokens

        running = [asyncio.create_task(one(i)) for i in range(8)]
        for event in started:
            await event.wait()
        body = {"lora_name": "a4", "lora_path": str(dirs["swap2"]), "load_inplace": True}
        replace = asyncio.create_task(asyncio.to_thread(lora.http, "POST", "/v1/load_lora_adapter", body))
        await _until_logged(lora, waits)
        held = not replace.done() and not all(task.done() for task in running)
        late = asyncio.create_task(
            _acomplete(
                client,
                model="a4",
                prompt=prompts[0],
                max_tokens=n,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
        )
        results = await asyncio.gather(*running)
        status, _ = await replace
        late_tokens = (await late).choices[0].token_ids
        await client.close()
        return results, late_tokens, status, held

    results, late, status, held = asyncio.run(run())
    assert status == 200
    for prompt, tokens in zip(prompts, results, strict=True):
        assert tokens == oracle.tokens(prompt, dirs["a4"], n)
    assert late == oracle.tokens(prompts[0], dirs["swap2"], n)
    assert held, "the 8 requests ended before the late one was sent: the test proves nothing"


async def _until_logged(server: Server, text: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while text not in server.log.read_text():
        assert time.monotonic() < deadline, f"the server never logged {text!r}"
        await asyncio.sleep(0.02)


# ---- operations ----------------------------------------------------------------------------------------


def test_probes_are_open_and_the_api_needs_the_key(world: dict[str, Any]) -> None:
    lora, plain = world["lora"], world["plain"]
    for path in ("/health", "/metrics", "/version"):
        assert lora.http("GET", path, key=False)[0] == 200, path
        assert plain.http("GET", path, key=False)[0] == 401, path
        assert plain.http("GET", path)[0] == 200, path
    assert lora.http("GET", "/version")[1]["version"]
    assert lora.http("GET", "/v1/models", key=False)[0] == 401


def test_tokenize_detokenize_list_prompts_and_n(world: dict[str, Any]) -> None:
    lora, dirs, oracle = world["lora"], world["dirs"], world["oracle"]
    status, body = lora.http("POST", "/v1/tokenize", {"model": "a1", "prompt": "hello"})
    assert status == 200 and body["tokens"] == [ord(c) for c in "hello"] and body["count"] == 5
    status, body = lora.http("POST", "/v1/detokenize", {"model": "a1", "tokens": body["tokens"]})
    assert status == 200 and body["prompt"] == "hello"
    status, body = lora.http(
        "POST", "/v1/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert status == 200 and body["tokens"] == [ord(c) for c in "user: hi\nassistant:"]
    prompts = [_prompt(80, 6), _prompt(81, 9)]
    r = _complete(lora, model="a2", prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.token_ids == oracle.tokens(prompts[c.index // 2], dirs["a2"], 5)
    assert r.usage.prompt_tokens == 15 and r.usage.completion_tokens == sum(
        len(c.token_ids) for c in r.choices
    )


def test_the_chat_template_and_tokenizer_flags(world: dict[str, Any]) -> None:
    """``plain`` applies ``--chat-template``'s file (``<content>`` per message) where ``lora`` applies the
    tokenizer's own, in ``/v1/tokenize`` and in a chat completion's prompt."""
    plain, lora, oracle = world["plain"], world["lora"], world["oracle"]
    messages = [{"role": "user", "content": "hi"}]
    status, body = plain.http("POST", "/v1/tokenize", {"model": "tiny", "messages": messages})
    assert status == 200 and body["tokens"] == [ord(c) for c in "<hi>"]
    assert (
        lora.http("POST", "/v1/tokenize", {"model": "tiny", "messages": messages})[1]["tokens"]
        != body["tokens"]
    )
    r = plain.client().chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 4
    assert r.choices[0].message.content == "".join(
        chr(t) for t in oracle.tokens(body["tokens"], None, 4) if t > 2
    )


def test_evictions_and_status_are_logged_when_they_happen(world: dict[str, Any]) -> None:
    """``plain`` (3 slots) serves five adapters in turn: its log has eviction lines written without any
    scrape of ``/metrics`` since, and the periodic status line."""
    plain = world["plain"]
    for name in ADAPTERS[:5]:
        _complete(plain, model=name, prompt="ab", max_tokens=1, temperature=0)
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        log = plain.log.read_text()
        if re.search(r"status: \d+ running", log):
            break
        time.sleep(0.2)
    log = plain.log.read_text()
    assert re.search(r"adapter 'a\d': evicted from the device tier", log), log[-3000:]
    assert re.search(
        r"status: \d+ running, \d+ waiting, [\d.]+ output tokens/s; adapters: \d+ in device slots", log
    )
    # Logged when they happened: after the last scrape of /metrics (the probes' test made some).
    evictions = list(re.finditer(r"adapter 'a\d': evicted from the device tier", log))
    scrapes = list(re.finditer("GET /metrics", log))
    assert not scrapes or evictions[-1].start() > scrapes[-1].start()
