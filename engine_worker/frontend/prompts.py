"""Request inputs (text, token ids, chat messages) to the engine input vLLM's renderer produces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.inputs import tokens_input

from taco_llm.protos import engine_pb2
from taco_llm.protos.rich_status import Reason

from ..vllm_internals import UNTRUSTED_CHAT_TEMPLATE, BaseRenderer, ChatParams, merge_kwargs, parse_model_prompt
from .sampling import InvalidField, json_value

_PART_TEXT_KEYS = {"refusal": "refusal", "thinking": "thinking"}


@dataclass(frozen=True)
class ChatDefaults:
    """The server-wide chat settings: --chat-template (its text) and --trust-request-chat-template."""

    chat_template: str | None = None
    trust_request_chat_template: bool = False


def _message_dict(message: engine_pb2.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role}
    if message.HasField("content"):
        out["content"] = message.content
    elif message.content_parts:
        # vLLM's renderer reads a part's text under the key its type names ("refusal", "thinking").
        out["content"] = [{"type": p.type, _PART_TEXT_KEYS.get(p.type, "text"): p.text}
                          for p in message.content_parts]
    else:
        out["content"] = None
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": c.type or "function",
             "function": {"name": c.function_name, "arguments": c.function_arguments}}
            for c in message.tool_calls
        ]
    return out


def chat_messages(chat: engine_pb2.ChatInput) -> list[dict[str, Any]]:
    if not chat.messages:
        raise InvalidField("chat.messages", "messages must not be empty", Reason.FIELD_REQUIRED)
    return [_message_dict(m) for m in chat.messages]


def chat_tools(chat: engine_pb2.ChatInput) -> list[Any] | None:
    """The tool definitions; None when the field is unset (an empty list is passed on, for vLLM to refuse)."""
    return json_value(chat.tools) if chat.HasField("tools") else None  # type: ignore[no-any-return]


def _chat_params(chat: engine_pb2.ChatInput, defaults: ChatDefaults) -> ChatParams:
    for i, message in enumerate(chat.messages):
        if not message.role:
            raise InvalidField(f"chat.messages[{i}].role", f"messages[{i}] has no role", Reason.FIELD_REQUIRED)
    add_generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    if chat.continue_final_message and add_generation_prompt:
        raise InvalidField("chat.continue_final_message",
                           "continue_final_message needs add_generation_prompt set to false")
    user_kwargs: dict[str, Any] = json_value(chat.chat_template_kwargs) if chat.HasField("chat_template_kwargs") else {}
    for reserved in ("chat_template", "tokenize"):
        if reserved in user_kwargs:
            raise InvalidField("chat.chat_template_kwargs", f"chat_template_kwargs may not set {reserved!r}")
    if chat.HasField("chat_template") and not defaults.trust_request_chat_template:
        # As vLLM's server: a request's own template runs only where the operator allows it.
        raise InvalidField("chat.chat_template", UNTRUSTED_CHAT_TEMPLATE, Reason.CHAT_TEMPLATE_NOT_TRUSTED)
    tools = chat_tools(chat)
    return ChatParams(
        chat_template=chat.chat_template if chat.HasField("chat_template") else defaults.chat_template,
        chat_template_kwargs=merge_kwargs(
            dict(add_generation_prompt=add_generation_prompt,
                 continue_final_message=chat.continue_final_message, tools=tools, tokenize=False),
            user_kwargs,
        ),
    )


async def render_chat(renderer: BaseRenderer, chat: engine_pb2.ChatInput, add_special_tokens: bool | None,
                      defaults: ChatDefaults) -> dict[str, Any]:
    messages = chat_messages(chat)
    tok_params = renderer.default_chat_tok_params
    if add_special_tokens is not None:
        tok_params = tok_params.with_kwargs(add_special_tokens=add_special_tokens)
    _, (engine_input,) = await renderer.render_chat_async(
        [messages], _chat_params(chat, defaults), tok_params  # type: ignore[list-item]
    )
    return engine_input  # type: ignore[return-value]


async def render_text(renderer: BaseRenderer, model_config: Any, text: str,
                      add_special_tokens: bool | None) -> dict[str, Any]:
    tok_params = renderer.default_cmpl_tok_params
    if add_special_tokens is not None:
        tok_params = tok_params.with_kwargs(add_special_tokens=add_special_tokens)
    (engine_input,) = await renderer.render_cmpl_async([parse_model_prompt(model_config, text)], tok_params)
    return engine_input  # type: ignore[return-value]


def check_token_ids(ids: Sequence[int], vocab_size: int, *, field: str = "token_ids") -> None:
    """Refuses the first id outside the model's vocabulary, naming `field`."""
    for i, token in enumerate(ids):
        if token >= vocab_size:
            raise InvalidField(field, f"{field}[{i}] = {token} is outside the vocabulary "
                                      f"(size {vocab_size})", Reason.TOKEN_OUT_OF_VOCABULARY)


def token_input(ids: list[int], vocab_size: int, *, cache_salt: str | None = None) -> dict[str, Any]:
    check_token_ids(ids, vocab_size)
    return tokens_input(ids, cache_salt=cache_salt)  # type: ignore[return-value]
