"""LoRA end to end: a tiny adapter built with peft at test time (conftest.build_tiny_lora), served by name."""

from __future__ import annotations

import grpc
import openai
import pytest

from taco_llm.protos import engine_pb2, engine_pb2_grpc

from .conftest import BROKEN_LORA_NAME, LORA_NAME
from .support import Stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colours are"


def _greedy(client: openai.OpenAI, model: str) -> tuple[str, list[int]]:
    reply = client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=24,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    return reply.choices[0].text, reply.choices[0].model_extra["token_ids"]


def test_the_adapter_is_a_model_whose_parent_is_the_base(frontend_client: openai.OpenAI) -> None:
    models = {m.id: m for m in frontend_client.models.list().data}
    assert list(models) == [MODEL, LORA_NAME, BROKEN_LORA_NAME]
    lora = models[LORA_NAME].model_extra
    assert lora["parent"] == MODEL
    assert lora["root"].endswith(LORA_NAME)
    assert models[MODEL].model_extra["parent"] is None


def test_model_info_lists_the_adapter(frontend_stack: Stack) -> None:
    with grpc.insecure_channel(frontend_stack.grpc_address) as channel:
        info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert list(info.served_model_names) == [MODEL, LORA_NAME, BROKEN_LORA_NAME]
    adapter = info.lora_adapters[0]
    assert [a.name for a in info.lora_adapters] == [LORA_NAME, BROKEN_LORA_NAME]
    assert adapter.name == LORA_NAME and adapter.base_model_name == MODEL and adapter.path.endswith(LORA_NAME)


def test_the_adapter_changes_greedy_output_and_the_base_is_untouched(
    frontend_client: openai.OpenAI, client: openai.OpenAI
) -> None:
    base_text, base_ids = _greedy(frontend_client, MODEL)
    lora_text, lora_ids = _greedy(frontend_client, LORA_NAME)
    plain_text, plain_ids = _greedy(client, MODEL)  # an engine started without --enable-lora
    assert lora_ids != base_ids and lora_text != base_text
    assert base_ids == plain_ids and base_text == plain_text
    # And the adapter is deterministic too: asked again, the same tokens.
    assert _greedy(frontend_client, LORA_NAME)[1] == lora_ids


def test_adapter_and_base_requests_run_side_by_side(frontend_client: openai.OpenAI) -> None:
    reply = frontend_client.completions.create(model=LORA_NAME, prompt=[PROMPT, PROMPT], temperature=0,
                                               max_tokens=24, extra_body={"ignore_eos": True})
    assert reply.model == LORA_NAME
    assert reply.choices[0].text == reply.choices[1].text == _greedy(frontend_client, LORA_NAME)[0]


def test_chat_with_the_adapter(frontend_client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    base = frontend_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    lora = frontend_client.chat.completions.create(model=LORA_NAME, messages=messages, temperature=0,
                                                   max_tokens=16)
    assert lora.model == LORA_NAME
    assert lora.choices[0].message.content != base.choices[0].message.content


def test_an_unknown_model_is_a_404_naming_it(frontend_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        frontend_client.completions.create(model="no-such-lora", prompt=PROMPT, max_tokens=4)
    assert caught.value.body["param"] == "model"
    assert "no-such-lora" in caught.value.body["message"]


def test_an_adapter_that_fails_to_load_is_a_400_and_the_engine_stays_up(frontend_client: openai.OpenAI) -> None:
    for _ in range(2):  # and again: a failed load is not remembered as loaded
        with pytest.raises(openai.BadRequestError) as caught:
            frontend_client.completions.create(model=BROKEN_LORA_NAME, prompt=PROMPT, max_tokens=4)
        assert caught.value.body["param"] == "model"
        assert f"the LoRA adapter `{BROKEN_LORA_NAME}`" in caught.value.body["message"]
        assert "failed to load" in caught.value.body["message"]
    assert _greedy(frontend_client, LORA_NAME)[0]
    assert _greedy(frontend_client, MODEL)[0]
