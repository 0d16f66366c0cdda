"""The worker's share of vLLM's OpenAI-frontend flags: chat template, tool calling, LoRA modules.

vLLM keeps these outside its engine arguments (they belong to its API server), but here the worker
renders chats, parses tool calls and picks LoRA adapters, so it takes them. Each is checked before the
engine starts, and a bad value is an argparse error that names its flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from vllm.exceptions import VLLMValidationError

from ..vllm_internals import LoRAModulePath, LoRAParserAction, load_chat_template, tool_parser_names
from .admission import (
    DEFAULT_MAX_N,
    DEFAULT_MAX_STOP_STRING_LENGTH,
    DEFAULT_MAX_STOP_STRINGS,
    AdmissionLimits,
)
from .lora import LoraProblem, check_adapter
from .tools import ToolParserProblem, tool_parser_class


@dataclass
class FrontendOptions:
    # The template text (read from the file --chat-template named, or given inline); None: the model's.
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    lora_modules: list[LoRAModulePath] = field(default_factory=list)
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("OpenAI frontend (as vLLM's `vllm serve` has them)")
    group.add_argument("--chat-template", default=None,
                       help="the chat template for every chat request: a file, or the Jinja template inline")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests send their own chat_template (refused otherwise, as in vLLM)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="parse tool calls from the model's text for tool_choice 'auto' (needs "
                       "--tool-call-parser)")
    group.add_argument("--tool-call-parser", default=None,
                       help="vLLM's tool-call parser for this model (hermes, mistral, ...)")
    group.add_argument("--lora-modules", nargs="+", action=LoRAParserAction, default=None,
                       help="LoRA adapters as name=path, or JSON {\"name\": ..., \"path\": ..., "
                       "\"base_model_name\": ...}; each is served as its own model name")
    limits = parser.add_argument_group("request limits (each refusal names its field)")
    limits.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help=f"most choices (n) one request may ask for (default {DEFAULT_MAX_N}, OpenAI's maximum)")
    limits.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS,
                        help=f"most stop strings one request may give (default {DEFAULT_MAX_STOP_STRINGS})")
    limits.add_argument("--max-stop-string-length", type=int, default=DEFAULT_MAX_STOP_STRING_LENGTH,
                        help="longest stop string, in characters: vLLM holds back that much streamed text "
                        f"(default {DEFAULT_MAX_STOP_STRING_LENGTH})")


def from_cli_args(parser: argparse.ArgumentParser, args: argparse.Namespace, tokenizer: str) -> FrontendOptions:
    """Checks the flags (`tokenizer`: where the tool parser's tokenizer loads from); errors exit via argparse."""
    options = FrontendOptions(
        trust_request_chat_template=args.trust_request_chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        lora_modules=list(args.lora_modules or []),
        admission=AdmissionLimits(max_n=args.max_n, max_stop_strings=args.max_stop_strings,
                                  max_stop_string_length=args.max_stop_string_length),
    )
    for flag, value in (("--max-n", args.max_n), ("--max-stop-strings", args.max_stop_strings),
                        ("--max-stop-string-length", args.max_stop_string_length)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.chat_template is not None:
        try:
            options.chat_template = load_chat_template(args.chat_template)
        except (OSError, VLLMValidationError) as error:
            parser.error(f"--chat-template {args.chat_template}: {error}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (one of: "
                     f"{', '.join(tool_parser_names())})")
    if args.tool_call_parser:
        if args.tool_call_parser not in tool_parser_names():
            parser.error(f"--tool-call-parser {args.tool_call_parser}: no such tool-call parser; vLLM has "
                         f"{', '.join(tool_parser_names())}")
        try:
            tool_parser_class(args.tool_call_parser, args.enable_auto_tool_choice, tokenizer)
        except ToolParserProblem as error:
            parser.error(str(error))
    names = [m.name for m in options.lora_modules]
    if options.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    for module in options.lora_modules:
        if names.count(module.name) > 1:
            parser.error(f"--lora-modules: the name {module.name!r} is given twice")
        try:
            check_adapter(Path(module.path), args.max_lora_rank)
        except LoraProblem as error:
            parser.error(f"--lora-modules {module.name}={module.path}: {error}")
    return options
