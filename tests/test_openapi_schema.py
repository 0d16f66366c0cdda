"""The gateway's /openapi.json documents every route: its body's model, its answers by status with
their models and media types (no FastAPI 422, which the app never sends). Built without an engine: the
app is made but its pool never starts, so this runs in a second."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from schemathesis.core.result import Ok

from gateway.app import GatewaySettings, create_app
from gateway.protocol import ErrorResponse, HealthStatus

ERROR_REF = "#/components/schemas/ErrorResponse"
# Anthropic's Messages API refuses in Anthropic's error shape.
ANTHROPIC_ROUTES = {"/v1/messages", "/v1/messages/count_tokens"}
ANTHROPIC_ERROR_REF = "#/components/schemas/AnthropicErrorResponse"
# Routes that take a body, and those whose request may ask for a stream.
BODY_ROUTES = {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/chat/completions/batch",
               "/invocations", "/v1/responses", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
               *ANTHROPIC_ROUTES}
# Answered as vLLM answers them: Prometheus text, and the runtime LoRA routes' line of text.
TEXT_ROUTES = {"/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
STREAM_ROUTES = {"/v1/chat/completions", "/v1/completions", "/invocations", "/v1/messages", "/v1/responses"}


@pytest.fixture(scope="module")
def app_and_schema() -> tuple[Any, dict[str, Any]]:
    # An address nothing serves: the pool is made, never started (no lifespan without a `with`).
    app = create_app(GatewaySettings(engines=["127.0.0.1:9"]))
    return app, app.openapi()


def _operations(app: Any) -> list[tuple[str, str]]:
    return [(route.path, method.lower()) for route in app.routes if isinstance(route, APIRoute)
            for method in sorted(route.methods)]


def test_every_route_is_documented_with_its_answers(app_and_schema: tuple[Any, dict[str, Any]]) -> None:
    app, schema = app_and_schema
    operations = _operations(app)
    assert len(operations) >= 9, operations  # the app's routes are listed from the app, not by hand
    for path, method in operations:
        operation = schema["paths"][path][method]
        responses = operation["responses"]
        assert "422" not in responses, f"{method} {path}: documents FastAPI's 422, which the app never sends"
        ok = responses["200"]["content"]
        assert ok and all("schema" in media for media in ok.values()), f"{method} {path}: 200 has no schema"
        assert "4XX" in responses, f"{method} {path}: its refusals are not documented"
        for status, answer in responses.items():
            if status in ("200", "503") and path == "/health":
                continue
            if status != "200":
                error_ref = ANTHROPIC_ERROR_REF if path in ANTHROPIC_ROUTES else ERROR_REF
                assert answer["content"]["application/json"]["schema"] == {"$ref": error_ref}, (method, path, status)
        if path in BODY_ROUTES:
            body = operation["requestBody"]
            assert body["required"]
            assert body["content"]["application/json"]["schema"]["$ref"].startswith("#/components/schemas/")
            assert {"400", "404", "413", "503"} <= set(responses), (method, path)
        else:
            assert "requestBody" not in operation, (method, path)
        if path in STREAM_ROUTES:
            assert set(ok) == {"application/json", "text/event-stream"}, (method, path)
        elif path in TEXT_ROUTES:
            assert set(ok) == {"text/plain"}, (method, path)
        else:
            assert set(ok) == {"application/json"}, (method, path)
        if path != "/health":
            assert "401" in responses, f"{method} {path}: the API key's refusal is not documented"


def test_the_schema_is_a_valid_openapi_document(app_and_schema: tuple[Any, dict[str, Any]]) -> None:
    _, schema = app_and_schema
    loaded = schemathesis.openapi.from_dict(schema)
    labels = {result.ok().label for result in loaded.get_all_operations() if isinstance(result, Ok)}
    assert "POST /v1/chat/completions" in labels and len(labels) == len(_operations(app_and_schema[0]))


def test_what_the_app_answers_without_a_worker_matches_the_documented_models(
        app_and_schema: tuple[Any, dict[str, Any]]) -> None:
    app, _ = app_and_schema
    client = TestClient(app)  # no `with`: the pool stays unstarted, so no worker is ever ready
    refused = client.post("/v1/completions", json={"prompt": 5})
    assert refused.status_code == 400
    param = ErrorResponse.model_validate(refused.json()).error.param
    assert param is not None and param.split(".")[0] == "prompt", param
    not_json = client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 400
    ErrorResponse.model_validate(not_json.json())
    health = client.get("/health")
    assert health.status_code == 503 and HealthStatus.model_validate(health.json()).status == "unavailable"
    models = client.get("/v1/models")
    assert models.status_code == 503 and models.headers["retry-after"]
    ErrorResponse.model_validate(models.json())
