"""A bounded soak of `vllm serve` with DDTree: 600 requests, 32 in flight, random prompts (the tiny pair's prompts,
cut, repeated, as token ids, or a single token), random lengths and sampling settings
(temperature 0..1.2, top-p, top-k, seeds, penalties, n), completions and chat, streamed or not, and one in five
abandoned by its client mid-stream or mid-request.

Afterwards: the server is alive and logged no traceback, every answer that finished is well-formed, the greedy
ones equal the server without speculation, and the KV cache is empty again (`vllm:kv_cache_usage_perc`, which is
1 - free blocks / all blocks, back to its idle value 0).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from tests.serve.counters import check_tree_metrics, spec_counters, tree_metrics
from tests.serve.pair import prompts
from tests.serve.server import MODEL_NAME

NUM_REQUESTS = 600
IN_FLIGHT = 32
ABANDON = 0.2
SEED = 20261129

pytestmark = pytest.mark.slow


def random_request(rng: random.Random) -> dict:
    prompt = rng.choice(prompts())
    shape = rng.random()
    if shape < 0.2:
        prompt = prompt[: rng.randint(1, len(prompt))]
    elif shape < 0.35:
        prompt = " ".join([prompt] * rng.randint(2, 6))
    elif shape < 0.4:  # as byte token ids
        prompt = [4 + b for b in prompt.encode()]
    elif shape < 0.5:  # one token: joining a decode batch, vLLM gives it placeholder drafts
        prompt = [4 + ord(rng.choice("abcdefghijklmnopqrstuvwxyz"))]
    temperature = 0.0 if rng.random() < 0.3 else rng.uniform(0.0, 1.2)
    params = {"max_tokens": rng.randint(1, 96), "temperature": temperature, "extra_body": {}}
    if rng.random() < 0.5:
        params["top_p"] = rng.uniform(0.3, 1.0)
    if rng.random() < 0.5:
        params["extra_body"]["top_k"] = rng.choice([1, 3, 20, 100])
    if rng.random() < 0.5:
        params["seed"] = rng.randint(0, 2**31 - 1)
    if rng.random() < 0.2:
        params["presence_penalty"] = rng.uniform(-1.0, 1.0)
        params["frequency_penalty"] = rng.uniform(-1.0, 1.0)
        params["extra_body"]["repetition_penalty"] = rng.uniform(0.8, 1.3)
    if temperature > 0 and rng.random() < 0.15:
        params["n"] = rng.randint(2, 3)
    use_chat = not isinstance(prompt, list) and rng.random() < 0.4
    return {
        "prompt": prompt,
        "chat": use_chat,
        "stream": rng.random() < 0.5,
        "abandon_after": rng.randint(1, 6) if rng.random() < ABANDON else None,
        "params": params,
    }


async def send(client, request: dict) -> dict:
    """Send one request; returns {'abandoned': bool, 'choices': [(text, finish_reason)], 'tokens': int | None}."""
    params = request["params"]
    if request["chat"]:
        messages = [{"role": "user", "content": request["prompt"]}]
        call = client.chat.completions.create(model=MODEL_NAME, messages=messages, stream=request["stream"], **params)
    else:
        call = client.completions.create(model=MODEL_NAME, prompt=request["prompt"], stream=request["stream"], **params)
    abandon_after = request["abandon_after"]
    if not request["stream"]:
        if abandon_after is None:
            response = await call
        else:  # the client gives up before the answer comes (unless it comes first)
            try:
                response = await asyncio.wait_for(call, timeout=0.05 * abandon_after)
            except asyncio.TimeoutError:
                return {"abandoned": True}
        choices = sorted(response.choices, key=lambda c: c.index)
        texts = [c.text if getattr(c, "message", None) is None else (c.message.content or "") for c in choices]
        return {
            "abandoned": False,
            "choices": [(t, c.finish_reason) for t, c in zip(texts, choices)],
            "tokens": response.usage.completion_tokens,
        }
    stream = await call
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = 0
    async for chunk in stream:
        chunks += 1
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            piece = (choice.text or "") if delta is None else (delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
        if abandon_after is not None and chunks >= abandon_after:
            await stream.close()
            return {"abandoned": True}
    return {"abandoned": False, "choices": [(texts[i], finish.get(i)) for i in sorted(texts)], "tokens": None}


async def run_all(server, make_async_client, requests: list[dict]) -> list[dict]:
    limit = asyncio.Semaphore(IN_FLIGHT)
    async with make_async_client(server) as client:

        async def one(request):
            async with limit:
                return await send(client, request)

        return await asyncio.gather(*[one(r) for r in requests])


def check_answer(request: dict, result: dict) -> None:
    params = request["params"]
    assert len(result["choices"]) == params.get("n", 1), result
    for text, finish in result["choices"]:
        assert finish in ("stop", "length"), result
    if result["tokens"] is not None:
        assert 1 <= result["tokens"] <= params["max_tokens"] * params.get("n", 1), result


def is_greedy(request: dict) -> bool:
    return request["params"]["temperature"] == 0.0


def test_soak(ddtree_server, plain_server, make_async_client):
    idle = ddtree_server.settle()
    assert idle["vllm:kv_cache_usage_perc"] == 0.0
    rng = random.Random(SEED)
    requests = [random_request(rng) for _ in range(NUM_REQUESTS)]

    start = time.monotonic()
    results = asyncio.run(run_all(ddtree_server, make_async_client, requests))
    elapsed = time.monotonic() - start
    abandoned = sum(r["abandoned"] for r in results)
    print(f"soak: {NUM_REQUESTS} requests ({abandoned} abandoned) in {elapsed:.0f} s")

    assert ddtree_server.alive() and ddtree_server.healthy()
    assert "Traceback" not in ddtree_server.log_path.read_text(errors="replace")
    finished = [(q, r) for q, r in zip(requests, results) if not r["abandoned"]]
    assert len(finished) >= NUM_REQUESTS // 2
    for request, result in finished:
        check_answer(request, result)

    # Greedy answers under this load equal the server without speculation (token-identical text).
    greedy = [(q, r) for q, r in finished if is_greedy(q)]
    assert len(greedy) >= 50
    plain = asyncio.run(run_all(plain_server, make_async_client, [{**q, "abandon_after": None} for q, _ in greedy]))
    for (request, result), expected in zip(greedy, plain):
        assert result["choices"] == expected["choices"], request

    metrics = ddtree_server.settle()
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == idle["vllm:kv_cache_usage_perc"]
    # The tree metrics agree with vLLM's spec-decode counters after aborts, placeholder drafts, n > 1, ...
    check_tree_metrics(spec_counters(metrics), tree_metrics(metrics))
