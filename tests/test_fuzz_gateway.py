"""Fuzzes the running gateway (the session `stack`: real `taco_llm serve`, default model) with
schemathesis against its own /openapi.json: at least 1,000 generated requests, bodies that fit the
schema and bodies that break it, on every route. No answer may be a 5xx or break the schema the
gateway publishes (its status, media type and body), and the server serves the same greedy text
afterwards as before."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import hypothesis
import openai
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.core.failures import FailureGroup

from .support import Stack

# The fuzz is about input handling, not generation length: a request the gateway accepts runs on the
# CPU engine, where every generated token costs time. Capping the fields that multiply generation keeps
# 1,000 requests within the CI budget; every other field (and these, at or below the cap, negative,
# or of the wrong type) is generated freely.
GENERATION_CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2, "best_of": 2}
# Where a chat leaves max_tokens out it generates to the end of the context: give it the cap.
GENERATION_ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/chat/completions/batch", "/invocations",
                     "/v1/messages", "/v1/responses"}
EXAMPLES = 1000
# The checks a schema-driven fuzz can honestly hold this server to; left out: negative_data_rejection
# and positive_data_acceptance (the gateway accepts unknown fields, as OpenAI's does, and refuses
# valid-typed values by range, which the schema does not state), and max_response_time.
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance"]
PROMPT = "The capital of France is"


def capped(case: Case) -> Case:
    body = case.body
    if isinstance(body, dict) and case.operation.path in GENERATION_ROUTES:
        for name, cap in GENERATION_CAPS.items():
            value = body.get(name)
            # bool is an int to Python, and true is a wrong type worth sending as it is.
            if isinstance(value, int | float) and not isinstance(value, bool) and value > cap:
                body[name] = cap
        if case.operation.path == "/v1/responses":
            if body.get("max_output_tokens") is None:
                body["max_output_tokens"] = GENERATION_CAPS["max_output_tokens"]
        elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = GENERATION_CAPS["max_tokens"]
    return case


def served(model: str) -> Callable[[Case], Case]:
    """Points a schema-valid body at the served model. The schema cannot say which names are served, so
    a generated name is almost never one: without this the valid bodies of a route end in the unknown-model
    404 and never reach the engine (a run of the tokenize route once got 2 of 161 through). Bodies that
    break the schema keep whatever model they were generated with."""

    def point(case: Case) -> Case:
        body = case.body
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            body["model"] = model
        # The schema cannot say that a prompt must not be empty, nor that /tokenize wants a prompt or
        # messages: without this most valid-typed bodies of those routes end in that one refusal, which
        # the broken bodies reach anyway, and a draw can leave a route with no accepted body at all.
        if isinstance(body, dict) and case.operation.path in ("/v1/completions", "/tokenize") and (
                body.get("prompt") in ("", []) or (body.get("prompt") is None and not body.get("messages"))):
            body["prompt"] = PROMPT
        return case

    return point


def _greedy_text(client: openai.OpenAI) -> str:
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    return reply.choices[0].text


def _shown(case: Case, response: schemathesis.Response, failure: str) -> str:
    body = json.dumps(case.body, ensure_ascii=True, default=repr)[:600] if case.body is not None else "-"
    return (f"{case.method} {case.path} body={body}\n  -> {response.status_code} "
            f"{response.headers.get('content-type')} {response.text[:400]!r}\n  {failure[:800]}")


def test_the_gateway_survives_1000_schema_fuzzed_requests(stack: Stack, client: openai.OpenAI) -> None:
    before = _greedy_text(client)
    schema = schemathesis.openapi.from_url(f"{stack.base_url}/openapi.json")
    checks = [getattr(schemathesis.checks, name) for name in CHECKS]
    session = requests.Session()
    sent: list[str] = []
    statuses: dict[str, dict[int, int]] = {}
    log_start = stack.process.log.stat().st_size
    failures: list[str] = []
    model = client.models.list().data[0].id
    strategy = st.one_of(schema.as_strategy(GenerationMode.POSITIVE).map(served(model)),
                         schema.as_strategy(GenerationMode.NEGATIVE)).map(capped)

    # derandomize + no database: CI sends the same 1,000 requests every run. Shrinking is off: every
    # failure is collected (not raised) so that one run reports them all, each as sent.
    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                         phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def send(case: Case) -> None:
        response = case.call(base_url=stack.base_url, session=session, timeout=120)
        sent.append(case.operation.label)
        counts = statuses.setdefault(case.operation.label, {})
        counts[response.status_code] = counts.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=checks)
        except FailureGroup as group:
            failures.append(_shown(case, response, str(group)))
        except AssertionError as error:
            failures.append(_shown(case, response, str(error)))

    started = time.monotonic()
    send()
    elapsed = time.monotonic() - started
    routes = sorted(set(sent))
    print(f"fuzz: {len(sent)} requests over {len(routes)} routes in {elapsed:.0f}s; {len(failures)} failed; "
          f"statuses: {json.dumps(statuses, sort_keys=True)}")
    assert len(sent) >= EXAMPLES, f"only {len(sent)} requests were sent"
    assert len(routes) == len(list(schema.get_all_operations())), routes
    assert not failures, f"{len(failures)} of {len(sent)} answers failed:\n" + "\n".join(failures[:20])
    # The fuzz reached the engine (accepted bodies) and the refusals (broken ones) on every body route.
    for label in ("POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize", "POST /detokenize"):
        assert statuses[label].get(200, 0) >= 5 and statuses[label].get(400, 0) >= 5, (label, statuses[label])
    # An answer can be right while a process logged a failure behind it (a worker's handler that
    # raised, a gateway error handler that caught something unplanned).
    with stack.process.log.open("rb") as log:
        log.seek(log_start)
        logged = log.read().decode(errors="replace")
    assert "Traceback" not in logged, logged[logged.index("Traceback") - 2000:][:6000]
    assert _greedy_text(client) == before, "the server answers differently after the fuzz"


@pytest.fixture(autouse=True, scope="module")
def _health_after(stack: Stack) -> Any:
    yield
    assert requests.get(f"{stack.base_url}/health", timeout=10).status_code == 200
