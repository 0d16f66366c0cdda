"""The OpenAI SDK against `taco_llm serve` on the default model: gateway → gRPC → vLLM."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from .support import Stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert reply.model == MODEL
    assert reply.id.startswith("chatcmpl-")
    assert reply.usage.prompt_tokens > 10
    assert 0 < reply.usage.completion_tokens <= 20
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_streaming_matches_non_streaming_and_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    # The last chunk carries the usage, and no choices; the others carry no usage.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_token_count_matches_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=MODEL, prompt="The numbers from one to twenty are", temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True, "ignore_eos": True},
    ))
    streamed = sum(len(c.model_extra.get("token_ids") or []) for ch in chunks for c in ch.choices)
    assert chunks[-1].usage.completion_tokens == streamed == 30


def test_completions_non_streaming_and_streaming(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=12)
    assert whole.object == "text_completion"
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=12,
                                           stream=True)
        if c.choices
    )
    assert streamed == whole.choices[0].text and streamed


def test_completions_batch_of_prompts(client: openai.OpenAI) -> None:
    prompts = ["The sky is", "Two plus two is"]
    batch = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6)
    singles = [client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=6) for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_n_two_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], n=2, temperature=1.0,
        max_tokens=16, seed=7,
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.message.content for c in reply.choices)
    assert reply.usage.completion_tokens >= 2


def test_n_two_streaming(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", n=2, temperature=1.0, max_tokens=8,
                                            seed=3, stream=True))
    indices = {c.index for ch in chunks for c in ch.choices}
    assert indices == {0, 1}
    finished = [c.index for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(finished) == [0, 1]


def test_stop_string(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20)
    assert " 6" in free.choices[0].text, free.choices[0].text
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20,
                                        stop=[" 6"])
    assert stopped.choices[0].text == free.choices[0].text.split(" 6")[0]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == " 6"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    # The end-of-turn token is scored too, though its text is not part of the content.
    assert "".join(t.token for t in content).removesuffix("<|im_end|>") == reply.choices[0].message.content
    for token in content:
        assert token.logprob <= 0
        assert len(token.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-4)
        assert token.bytes == list(token.token.encode())


def test_completion_logprobs(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5,
                                      logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == reply.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Give the largest city of France and its population as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    data = json.loads(reply.choices[0].message.content)
    jsonschema.validate(data, schema)


def test_guided_choice_and_regex(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet? Answer yes or no."}], temperature=0,
        max_tokens=5, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.completions.create(model=MODEL, prompt="My phone number is", temperature=0, max_tokens=20,
                                      extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert regex.choices[0].text[0] == " " and regex.choices[0].text[4] == "-"


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(model=MODEL, prompt="In a distant land", temperature=1.0, max_tokens=20,
                                          seed=seed)
        return reply.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def _error(excinfo: pytest.ExceptionInfo[openai.APIStatusError]) -> dict[str, object]:
    body = excinfo.value.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    error = _error(excinfo)
    assert error["param"] == "model" and "no-such-model" in str(error["message"])


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.5), ("max_tokens", 0), ("top_p", 1.5), ("presence_penalty", 3.0), ("top_logprobs", 50)],
)
def test_bad_sampling_values_are_400_naming_the_field(client: openai.OpenAI, field: str, value: float) -> None:
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL, messages=QUESTION, **extra, **{field: value})
    error = _error(excinfo)
    assert error["param"] == ("max_completion_tokens" if field == "max_tokens" else field)
    # The message names the engine's field (logprobs for top_logprobs); `param` names the client's.
    assert {"top_logprobs": "logprobs"}.get(field, field) in str(error["message"])
    assert "Traceback" not in str(error["message"])


def test_malformed_json_is_400(stack: Stack) -> None:
    reply = httpx.post(f"{stack.base_url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert "JSON" in error["message"] and error["type"] == "invalid_request_error"


def test_wrong_type_is_400_naming_the_field(stack: Stack) -> None:
    reply = httpx.post(f"{stack.base_url}/v1/chat/completions",
                       json={"model": MODEL, "messages": "not a list"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages"


def test_over_long_prompt_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=MODEL, prompt="hello " * 3000, max_tokens=5)
    error = _error(excinfo)
    assert "context length" in str(error["message"]) and error["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 3000}])


def test_max_tokens_past_the_context_is_refused_and_within_it_clamped_as_vllm_does(client: openai.OpenAI) -> None:
    # As vLLM's server: more than the whole context is a 400; what only the prompt leaves no room for is clamped.
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=100_000)
    error = _error(excinfo)
    assert error["param"] == "max_completion_tokens" and "max_tokens" in str(error["message"])
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=2048)
    assert "Paris" in reply.choices[0].message.content and reply.choices[0].finish_reason == "stop"


def test_still_serving_after_bad_requests(client: openai.OpenAI) -> None:
    for bad in ({"temperature": -1}, {"max_tokens": 0}, {"model": "nope"}):
        with pytest.raises(openai.APIStatusError):
            client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, **bad})
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=10)
    assert "Paris" in reply.choices[0].message.content


def test_tokenize_detokenize_health_version(stack: Stack) -> None:
    tokens = httpx.post(f"{stack.base_url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 2048
    text = httpx.post(f"{stack.base_url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert text["prompt"].endswith("Hello world")
    chat = httpx.post(f"{stack.base_url}/tokenize", json={"model": MODEL, "messages": QUESTION}).json()
    assert chat["count"] > tokens["count"]
    bad = httpx.post(f"{stack.base_url}/detokenize", json={"model": MODEL, "tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{stack.base_url}/health").status_code == 200
    version = httpx.get(f"{stack.base_url}/version").json()
    assert version["vllm"].startswith("0.32")
    assert "taco_llm_gateway_requests_total" in httpx.get(f"{stack.base_url}/metrics").text


def _check_prompt_logprobs(entries: list[dict[str, dict[str, object]] | None], prompt_ids: list[int],
                           top: int) -> None:
    """vLLM's shape: None for the first token, then {token_id: {logprob, rank, decoded_token}} with the
    prompt's own token and the `top` likeliest."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token, entry in zip(prompt_ids[1:], entries[1:], strict=True):
        assert entry is not None and str(token) in entry and len(entry) <= top + 1
        for value in entry.values():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert isinstance(value["rank"], int) and float(value["logprob"]) <= 0.0  # type: ignore[arg-type]


def test_prompt_logprobs_over_http_as_vllm_returns_them(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2,
                                           temperature=0, extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    choice = completion.choices[0].model_extra or {}
    _check_prompt_logprobs(choice["prompt_logprobs"], choice["prompt_token_ids"], 2)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    extra = chat.model_extra or {}  # a chat's prompt logprobs are on the response, as in vLLM
    _check_prompt_logprobs(extra["prompt_logprobs"], extra["prompt_token_ids"], 1)
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert _error(excinfo)["param"] == "prompt_logprobs"


# -- the small routes load balancers and platforms call, and vLLM 0.32's batch of conversations ------------


def test_batch_of_conversations_answers_each_as_alone(client: openai.OpenAI, stack: Stack) -> None:
    conversations = [[{"role": "user", "content": "Name a colour."}],
                     [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Say hi."}]]
    alone = [client.chat.completions.create(model=MODEL, messages=c, max_tokens=12, temperature=0)  # type: ignore[arg-type]
             for c in conversations]
    reply = httpx.post(f"{stack.base_url}/v1/chat/completions/batch", timeout=120, json={
        "model": MODEL, "messages": conversations, "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == [a.choices[0].message.content for a in alone]
    assert body["usage"]["completion_tokens"] == sum(a.usage.completion_tokens for a in alone if a.usage)
    for field, value in (("stream", True), ("n", 2), ("tools", [{"type": "function", "function": {"name": "f"}}])):
        refused = httpx.post(f"{stack.base_url}/v1/chat/completions/batch", timeout=30, json={
            "model": MODEL, "messages": conversations, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


def test_invocations_dispatch_on_the_body_as_sagemaker_does(client: openai.OpenAI, stack: Stack) -> None:
    messages = [{"role": "user", "content": "Count to three."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    invoked = httpx.post(f"{stack.base_url}/invocations", timeout=120,
                         json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0})
    assert invoked.status_code == 200 and invoked.json()["object"] == "chat.completion"
    assert invoked.json()["choices"][0]["message"]["content"] == chat.choices[0].message.content
    completion = httpx.post(f"{stack.base_url}/invocations", timeout=120,
                            json={"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "temperature": 0})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    neither = httpx.post(f"{stack.base_url}/invocations", timeout=30, json={"model": MODEL})
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt", neither.text


def test_ping_load_and_server_info(stack: Stack) -> None:
    for method in ("GET", "POST"):
        ping = httpx.request(method, f"{stack.base_url}/ping", timeout=30)
        assert ping.status_code == 200 and ping.json() == {"status": "ok"}
    assert httpx.get(f"{stack.base_url}/load", timeout=30).json() == {"server_load": 0}
    # A stream the client leaves early is no longer counted once the gateway has seen it go (the count
    # during a stream is tested in test_gateway_unit.py, with a stream the test controls).
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True,
            "stream": True}) as streaming:
        first = next(streaming.iter_lines())
        assert streaming.status_code == 200 and first.startswith("data: {"), first
    deadline = time.monotonic() + 30
    while httpx.get(f"{stack.base_url}/load", timeout=30).json() != {"server_load": 0}:
        assert time.monotonic() < deadline, "the stream the client left is still counted"
        time.sleep(0.1)
    info = httpx.get(f"{stack.base_url}/server_info", timeout=30).json()
    assert info["routing"] == "cache_aware" and info["workers"]
    assert all(w["ready"] and MODEL in w["models"] and w["max_model_len"] == 2048 for w in info["workers"])
