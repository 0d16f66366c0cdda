"""Streamed chat with `return_token_ids` through the whole stack (`taco_llm serve`, the real vLLM engine, the
openai SDK): a reply whose characters span several tokens (emoji) streams every token id, as the
non-streamed reply lists them, and vLLM's server streams them."""

from __future__ import annotations

import openai

MODEL = "SmolLM2-135M-Instruct"
# The default model answers this, greedy, with emoji only: three tokens each, the first two of which
# show no text on their own.
MESSAGES = [{"role": "user", "content": "Reply with only emojis: \N{PARTY POPPER}\N{GRINNING FACE}\N{THUMBS UP SIGN}"}]


def test_streamed_chat_token_ids_add_up_to_the_whole_replys(client: openai.OpenAI) -> None:
    options = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0,
               "extra_body": {"return_token_ids": True}}
    whole = client.chat.completions.create(**options)  # type: ignore[call-overload]
    whole_ids = whole.choices[0].model_extra["token_ids"]
    whole_text = whole.choices[0].message.content
    assert len(whole_ids) == 24 and whole_text
    assert len(whole_ids) > len(whole_text), f"no character of {whole_text!r} spans tokens: the test shows nothing"

    streamed_ids: list[int] = []
    streamed_text = ""
    silent_chunks = 0
    for chunk in client.chat.completions.create(stream=True, **options):  # type: ignore[call-overload]
        for choice in chunk.choices:
            ids = (choice.model_extra or {}).get("token_ids") or []
            streamed_ids += ids
            streamed_text += choice.delta.content or ""
            silent_chunks += bool(ids and not choice.delta.content and choice.finish_reason is None)
    assert streamed_text == whole_text
    assert streamed_ids == whole_ids, "the ids of deltas that showed no text were not streamed"
    assert silent_chunks > 0, "no chunk carried ids without text: the reply did not exercise them"
