"""--chat-template (server-wide) and a request's own chat_template (only with --trust-request-chat-template)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from .conftest import TEMPLATE_MARKER
from .support import Stack

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Say hello."}]
REQUEST_TEMPLATE = ("{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<<assistant>>{% endif %}")


def _prompt(stack: Stack, **extra: Any) -> tuple[str, int]:
    """The chat prompt the worker renders, as text, and its length in tokens."""
    tokens = httpx.post(f"{stack.base_url}/tokenize", json={"model": MODEL, "messages": MESSAGES, **extra},
                        timeout=60)
    assert tokens.status_code == 200, tokens.text
    body = tokens.json()
    text = httpx.post(f"{stack.base_url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]}, timeout=60)
    return text.json()["prompt"], body["count"]


def test_the_server_template_renders_every_chat(frontend_stack: Stack, stack: Stack,
                                                frontend_client: openai.OpenAI) -> None:
    ours, count = _prompt(frontend_stack)
    model_own, _ = _prompt(stack)
    assert ours == f"<|im_start|>user\n{TEMPLATE_MARKER} Say hello.<|im_end|>\n<|im_start|>assistant\n"
    assert TEMPLATE_MARKER not in model_own and "Say hello." in model_own
    # Generation renders with it too: the prompt it reports is the same length.
    reply = frontend_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert reply.usage.prompt_tokens == count


def test_a_request_template_is_refused_unless_trusted(client: openai.OpenAI, stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       extra_body={"chat_template": REQUEST_TEMPLATE})
    assert caught.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in caught.value.body["message"]
    refused = httpx.post(f"{stack.base_url}/tokenize",
                         json={"model": MODEL, "messages": MESSAGES, "chat_template": REQUEST_TEMPLATE}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"


def test_a_trusted_request_template_wins_over_the_server_one(frontend_stack: Stack,
                                                             frontend_client: openai.OpenAI) -> None:
    text, count = _prompt(frontend_stack, chat_template=REQUEST_TEMPLATE)
    assert text == "<<user>> Say hello.\n<<assistant>>"
    reply = frontend_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                                    extra_body={"chat_template": REQUEST_TEMPLATE})
    assert reply.usage.prompt_tokens == count
