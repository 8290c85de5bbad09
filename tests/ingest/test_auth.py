"""API keys: the pure checks (which keys, how they are presented, constant-time comparison over every
key), then an auth matrix against a live `met serve --api-key ...`: every route × {no key, wrong key,
Bearer, x-api-key}, in the protocol's own error shape, and path spellings that must not skip auth."""

from __future__ import annotations

import hmac
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anthropic
import httpx
import openai
import orjson
import pytest

from ingest.http import auth
from ingest.http.auth import ANONYMOUS, Authenticator, caller_id, load_keys, presented_keys
from shared.errors import ApiError
from shared.settings import Settings

from ..conftest import LiveServer, start_server, stop_server

# ---- pure -------------------------------------------------------------------------------------


def test_keys_come_from_the_comma_separated_setting_and_the_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("# operators\nk3\n\n  k4  \nk1\n")
    assert load_keys(Settings(api_keys="k1, k2,,", api_keys_file=str(path))) == ("k1", "k2", "k3", "k4")
    assert load_keys(Settings()) == ()


@pytest.mark.parametrize(
    ("authorization", "x_api_key", "expected"),
    [
        (b"Bearer k1", None, ("k1",)),
        (b"bearer   k1 ", None, ("k1",)),
        (None, b"k1", ("k1",)),
        (b"Bearer k1", b"k2", ("k1", "k2")),
        (b"Basic azE6", None, ()),
        (b"Bearer", None, ()),
        (None, b"  ", ()),
        (None, None, ()),
    ],
)
def test_a_key_is_read_from_a_bearer_token_or_x_api_key(authorization: bytes | None, x_api_key: bytes | None, expected: tuple[str, ...]) -> None:
    assert presented_keys(authorization, x_api_key) == expected


def test_without_configured_keys_everyone_is_the_anonymous_caller() -> None:
    assert not Authenticator([]).enabled
    assert Authenticator([]).authenticate(None, None) == ANONYMOUS


def test_a_missing_or_wrong_key_is_a_401_and_a_right_one_names_the_caller_by_digest() -> None:
    gate = Authenticator(["k1", "k2"])
    with pytest.raises(ApiError) as missing:
        gate.authenticate(None, None)
    assert (missing.value.status, missing.value.kind, missing.value.code) == (401, "authentication", "missing_api_key")
    with pytest.raises(ApiError) as wrong:
        gate.authenticate(b"Bearer k3", None)
    assert (wrong.value.status, wrong.value.code) == (401, "invalid_api_key")
    assert gate.authenticate(b"Bearer k2", None) == gate.authenticate(None, b"k2") == caller_id("k2")
    assert gate.authenticate(b"Bearer wrong", b"k1") == caller_id("k1")
    assert "k2" not in caller_id("k2") and caller_id("k1") != caller_id("k2")


def test_every_configured_key_is_compared_whether_or_not_one_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    gate = Authenticator(["k1", "k2", "k3"])
    for key, ok in (("k1", True), ("k3", True), ("nope", False), ("k1" * 100, False)):
        compared.clear()
        assert gate.matches(key) is ok
        assert len(compared) == 3  # no early exit
        assert all(len(a) == len(b) == 32 for a, b in compared)  # digests: equal lengths whatever the key


# ---- a live server with keys --------------------------------------------------------------------

KEYS = ("k1", "k2")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
MESSAGES = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

# (method, path, json body, status with a good key, protocol of the error shape)
ROUTES: list[tuple[str, str, Any, int, str]] = [
    ("GET", "/v1/models", None, 200, "openai"),
    ("GET", "/metrics", None, 200, "openai"),
    ("POST", "/v1/chat/completions", CHAT, 200, "openai"),
    ("POST", "/v1/messages", MESSAGES, 200, "anthropic"),
    ("POST", "/v1/messages/count_tokens", {"model": "m", "messages": MESSAGES["messages"]}, 200, "anthropic"),
    ("POST", "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 1, "store": False}, 200, "openai"),
    ("GET", "/v1/responses/resp_unknown", None, 404, "openai"),
    ("DELETE", "/v1/responses/resp_unknown", None, 404, "openai"),
    ("GET", "/v1/unknown", None, 404, "openai"),
    ("POST", "/v1/messages/unknown", {}, 404, "anthropic"),
]
ADMIN_KEY = "admin-k"  # may also load and unload LoRA adapters
CREDENTIALS = {
    "no key": ({}, False),
    "wrong key": ({"Authorization": "Bearer k9"}, False),
    "wrong x-api-key": ({"x-api-key": "k1x"}, False),
    "Bearer": ({"Authorization": "Bearer k1"}, True),
    "x-api-key": ({"x-api-key": "k2"}, True),
}


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    args = [a for k in KEYS for a in ("--api-key", k)]
    server = start_server(tmp_path_factory.mktemp("keyed"), "--workers", "1", *args, "--admin-key", ADMIN_KEY)
    yield server
    stop_server(server)


def assert_401_in_shape(response: httpx.Response, protocol: str) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    body = response.json()
    if protocol == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error" and body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "authentication_error"


@pytest.mark.e2e
@pytest.mark.parametrize("credential", list(CREDENTIALS))
@pytest.mark.parametrize("route", ROUTES, ids=[f"{r[0]} {r[1]}" for r in ROUTES])
def test_every_route_needs_a_key(keyed_server: LiveServer, credential: str, route: tuple[str, str, Any, int, str]) -> None:
    method, path, body, ok_status, protocol = route
    headers, good = CREDENTIALS[credential]
    response = httpx.request(method, keyed_server.base_url + path, json=body, headers=headers, timeout=120)
    if good:
        assert response.status_code == ok_status, response.text
    else:
        assert_401_in_shape(response, protocol)


@pytest.mark.e2e
@pytest.mark.parametrize("path", ["/health", "/ready", "/HEALTH", "/ready/"])
def test_health_and_ready_stay_open(keyed_server: LiveServer, path: str) -> None:
    assert httpx.get(keyed_server.base_url + path, timeout=10).status_code == 200


TRICKS = [
    "//v1/chat/completions",
    "/v1/chat/completions/",
    "/V1/Chat/Completions",
    "/v1//chat/completions",
    "/v1/chat/completions?key=k1",
    "/./v1/chat/completions",
    "/health/../v1/chat/completions",
    "/health/..%2Fv1/chat/completions",
    "/%761/chat/completions",
    "/v1/chat/completions%00",
    "/metrics/",
    "/METRICS",
    "/health%2F..%2Fmetrics",
    "/v1/MESSAGES",
]


@pytest.mark.e2e
@pytest.mark.parametrize("path", TRICKS)
def test_no_spelling_of_a_path_skips_auth(keyed_server: LiveServer, path: str) -> None:
    response = raw_request(keyed_server, f"POST {path} HTTP/1.1", host="127.0.0.1", body=CHAT)
    assert_401_in_shape(response, "anthropic" if path.lower().startswith("/v1/messages") else "openai")


@pytest.mark.e2e
@pytest.mark.parametrize(
    "target",
    ["http://127.0.0.1/v1/chat/completions", "http://localhost:1/v1/models", "http://evil.example/health/../v1/chat/completions"],
)
@pytest.mark.parametrize("host", ["127.0.0.1", "evil.example", "localhost:1"])
def test_absolute_form_targets_and_other_host_headers_still_need_a_key(keyed_server: LiveServer, target: str, host: str) -> None:
    response = raw_request(keyed_server, f"{'GET' if target.endswith('models') else 'POST'} {target} HTTP/1.1", host=host, body=CHAT)
    assert_401_in_shape(response, "openai")


@pytest.mark.e2e
def test_a_good_key_gets_the_same_route_under_another_host_header(keyed_server: LiveServer) -> None:
    response = httpx.get(keyed_server.base_url + "/v1/models", headers={"Host": "evil.example", "x-api-key": "k1"}, timeout=10)
    assert response.status_code == 200 and response.json()["object"] == "list"


@pytest.mark.e2e
def test_the_official_sdks_authenticate_with_their_usual_headers(keyed_server: LiveServer) -> None:
    with openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key="k1", max_retries=0) as good:
        assert good.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1).choices
    with openai.OpenAI(base_url=f"{keyed_server.base_url}/v1", api_key="bad", max_retries=0) as bad, pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with anthropic.Anthropic(base_url=keyed_server.base_url, api_key="k2", max_retries=0) as good_a:
        assert good_a.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}]).content is not None
    with anthropic.Anthropic(base_url=keyed_server.base_url, api_key="bad", max_retries=0) as bad_a, pytest.raises(anthropic.AuthenticationError) as caught:
        bad_a.messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 401


@pytest.mark.e2e
def test_the_session_server_without_keys_stays_open(live_server: LiveServer) -> None:
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(live_server.base_url + path, timeout=10).status_code == 200


def raw_request(server: LiveServer, request_line: str, *, host: str, body: Any) -> httpx.Response:
    """Send a request line as given (httpx would normalize the target) and parse the reply."""
    payload = orjson.dumps(body)
    port = urlsplit(server.base_url).port
    head = f"{request_line}\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + payload)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head_bytes, _, content = reply.partition(b"\r\n\r\n")
    status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
    headers = [tuple(line.split(": ", 1)) for line in header_lines if ": " in line]
    return httpx.Response(int(status_line.split()[1]), headers=headers, content=content)


def test_met_api_takes_repeated_api_key_flags_and_a_keys_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    import cli.serve
    from cli.main import app

    seen: list[Settings] = []

    async def fake_run_api(settings: Settings) -> None:
        seen.append(settings)

    monkeypatch.setattr(cli.serve, "run_api", fake_run_api)
    monkeypatch.delenv("MET_API_KEYS", raising=False)
    (tmp_path / "keys").write_text("k3\n")
    args = ["api", "--redis-url", "redis://127.0.0.1:1/0", "--api-key", "k1", "--api-key", "k2", "--api-keys-file", str(tmp_path / "keys")]
    result = CliRunner().invoke(app, [*args, "--rate-limit-rpm", "5", "--max-body-bytes", "1000"])
    assert result.exit_code == 0, result.output
    assert seen[0].api_keys == "k1,k2" and seen[0].rate_limit_rpm == 5 and seen[0].max_body_bytes == 1000
    assert load_keys(seen[0]) == ("k1", "k2", "k3")
    assert CliRunner().invoke(app, ["api", "--redis-url", "redis://127.0.0.1:1/0"]).exit_code == 0
    assert seen[1].api_keys == ""


def test_with_api_keys_only_an_admin_key_may_load_or_unload_a_lora_adapter(keyed_server: LiveServer, default_adapters: dict[str, Path]) -> None:
    body = {"lora_name": "pirate", "lora_path": str(default_adapters["pirate"])}
    load, unload = f"{keyed_server.base_url}/v1/load_lora_adapter", f"{keyed_server.base_url}/v1/unload_lora_adapter"
    assert httpx.post(load, json=body, timeout=30).status_code == 401
    refused = httpx.post(load, json=body, headers={"Authorization": "Bearer k1"}, timeout=30)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    assert httpx.post(load, json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30).status_code == 200
    listed = httpx.get(f"{keyed_server.base_url}/v1/models", headers={"Authorization": "Bearer k1"}, timeout=30).json()
    assert "pirate" in {m["id"] for m in listed["data"]}
    assert httpx.post(unload, json={"lora_name": "pirate"}, headers={"x-api-key": "k2"}, timeout=30).status_code == 403
    assert httpx.post(unload, json={"lora_name": "pirate"}, headers={"x-api-key": ADMIN_KEY}, timeout=30).status_code == 200
