"""Every HTTP route the gateway's app has wants the API key, but /health: listed from app.routes, so a
route added later is covered without editing this test (peers have shipped routes that skipped the key).

/openapi.json, /docs and /redoc want the key too (vLLM guards only /v1/*): the issue asks for every route
but /health, and the schema tells a scanner every route and field there is.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from taco_llm.gateway.app import GatewaySettings, create_app
from taco_llm.gateway.tenants import ApiKeys

KEY = "sk-route-test"
OPEN = {"/health"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # No worker answers at 127.0.0.1:1: with the key, routes that need one answer 503, never 401.
    settings = GatewaySettings(engines=["127.0.0.1:1"], api_keys=ApiKeys.from_flags(["alice=" + KEY, "plain"]))
    with TestClient(create_app(settings), raise_server_exceptions=False) as test_client:
        yield test_client


def _routes(client: TestClient) -> list[tuple[str, str]]:
    found = []
    for route in client.app.routes:  # type: ignore[attr-defined]
        assert isinstance(route, APIRoute | Route), f"a route of an unexpected kind: {route!r}"
        for method in sorted(route.methods or {"GET"}):
            if method != "HEAD":
                found.append((method, route.path))
    return found


def test_the_app_has_the_routes_this_test_expects(client: TestClient) -> None:
    paths = {path for _, path in _routes(client)}
    # Not the whole list (it is read from the app): the ones that must never go missing from it.
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/version",
            "/metrics", "/metrics/targets", "/openapi.json", "/docs", "/redoc", "/health"} <= paths


def test_every_route_but_health_wants_the_key(client: TestClient) -> None:
    routes = _routes(client)
    for method, path in routes:
        if path in OPEN:
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": f"Bearer {KEY}x"}):
            answer = client.request(method, path, headers=headers)
            assert answer.status_code == 401, f"{method} {path} with {headers} answered {answer.status_code}"
            error = answer.json()["error"]
            if path.startswith("/v1/messages"):  # Anthropic's shape: no code
                assert answer.json()["type"] == "error" and error["type"] == "authentication_error", (method, path)
            else:
                assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key", (method, path)
            assert "--api-key" in error["message"] and answer.headers["WWW-Authenticate"] == "Bearer"
        for key in (KEY, "plain"):
            for presented in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}):  # the latter: Anthropic's
                answer = client.request(method, path, headers=presented)
                assert answer.status_code != 401, f"{method} {path} refused the key"
                assert answer.status_code < 500 or answer.status_code == 503, f"{method} {path}: {answer.status_code}"


def test_health_and_preflight_need_no_key_and_unknown_paths_do(client: TestClient) -> None:
    assert client.get("/health").status_code != 401
    preflight = client.options("/v1/models", headers={"Origin": "https://a.example",
                                                      "Access-Control-Request-Method": "GET"})
    assert preflight.status_code != 401
    # Paths no route has: the key first, so that a scan learns nothing of which paths exist.
    for path in ("/health/", "/v1/nothing", "//health", "/HEALTH", "/docs/oauth2-redirect/x"):
        assert client.get(path).status_code == 401, path
