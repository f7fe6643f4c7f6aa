"""Small request-level holes (issue 27 item 7), against the real server on loopback: empty
``cache_salt`` and stop strings, errors naming the right ``param``, ``/health``'s body,
``/openapi.json`` documenting the 400s actually sent, and HTTP framing a proxy could read
differently (a chunk size past 63 bits, Content-Length with Transfer-Encoding)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from server.cli import uvicorn_config
from server.config_file import ServerSettings
from server.http_framing import strict_h11_protocol
from tests.server.helpers import assert_error

pytestmark = pytest.mark.slow

PATHS = [("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 1})]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)


@pytest.mark.parametrize("path,body", PATHS, ids=["completions", "chat"])
def test_an_empty_cache_salt_or_stop_string_is_a_400(real_server, path, body):
    assert_error(_post(real_server, path, {**body, "cache_salt": ""}), 400, param="cache_salt")
    for stop in ("", [""], ["x", ""]):
        assert_error(_post(real_server, path, {**body, "stop": stop}), 400, param="stop",
                     contains="must not be empty")
    assert _post(real_server, path, {**body, "cache_salt": "tenant-a", "stop": ["x"]}) \
        .status_code == 200


@pytest.mark.parametrize("path,body", PATHS, ids=["completions", "chat"])
def test_out_of_vocabulary_ids_are_blamed_on_their_own_field(real_server, path, body):
    assert_error(_post(real_server, path, {**body, "stop_token_ids": [10**7]}), 400,
                 param="stop_token_ids", contains="stop_token_ids")
    assert_error(_post(real_server, path, {**body, "logit_bias": {str(10**7): 1}}), 400,
                 param="logit_bias", contains="logit_bias")
    assert_error(_post(real_server, "/v1/completions", {"prompt": [10**7], "max_tokens": 1}),
                 400, param="prompt")


def test_a_raw_control_character_names_no_parameter(real_server):
    r = httpx.post(f"{real_server.url}/v1/completions", headers={
        **real_server.headers, "content-type": "application/json"},
        content=b'{"prompt": "a\x00b"}')
    err = assert_error(r, 400, contains="not valid JSON at character")
    assert err["param"] is None


def test_health_answers_json(real_server):
    r = httpx.get(f"{real_server.url}/health")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "ok"}


def test_openapi_documents_the_errors_actually_sent(real_server):
    schema = httpx.get(f"{real_server.url}/openapi.json").json()
    assert "HTTPValidationError" not in json.dumps(schema)
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert responses["400"]["content"]["application/json"]["schema"] == ref
    error = schema["components"]["schemas"]["Error"]
    assert set(error["required"]) == {"message", "type", "param", "code"}
    # what the schema says is what a validation error looks like
    err = _post(real_server, "/v1/completions", {"prompt": "x", "n": 0}).json()["error"]
    assert set(err) == set(error["properties"])


def _exchange(url: str, raw: bytes) -> tuple[int, dict, bytes]:
    """Send ``raw`` on a fresh connection; the status, the JSON body and whatever followed
    until the server closed (bounded by a socket timeout, never a timed assertion)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    return int(head.split()[1]), json.loads(rest[:length]), head


def _request(headers: bytes, body: bytes, key: str) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + key.encode() + b"\r\n" + headers + b"\r\n" + body)


def test_a_chunk_size_beyond_63_bits_is_a_400_and_one_past_the_limit_a_413(real_server):
    key = real_server.headers["Authorization"].split()[1]
    body = b'{"prompt": "hi", "max_tokens": 1}'
    chunked = b"Transfer-Encoding: chunked\r\n"
    status, err, head = _exchange(real_server.url, _request(
        chunked, b"ffffffffffffffffff\r\n" + body + b"\r\n0\r\n\r\n", key))
    assert status == 400 and err["error"]["code"] == "invalid_chunk_size", err
    assert b"connection: close" in head.lower()
    status, err, _ = _exchange(real_server.url, _request(
        chunked, b"%x\r\n" % (2**40) + body, key))
    assert status == 413 and err["error"]["code"] == "request_too_large", err
    status, _, _ = _exchange(real_server.url, _request(
        chunked + b"Connection: close\r\n", b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body), key))
    assert status == 200  # an honest chunked body is served


def test_content_length_with_transfer_encoding_is_refused(real_server):
    key = real_server.headers["Authorization"].split()[1]
    body = b'{"prompt": "hi", "max_tokens": 1}'
    status, err, head = _exchange(real_server.url, _request(
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(body),
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body), key))
    assert status == 400 and err["error"]["code"] == "ambiguous_framing", err
    assert b"connection: close" in head.lower()


def test_a_malformed_request_is_answered_in_openai_shape(real_server):
    status, err, _ = _exchange(real_server.url, b"GARBAGE\r\n\r\n")
    assert status == 400 and set(err["error"]) == {"message", "type", "param", "code"}


def test_the_server_uses_the_strict_protocol_with_its_body_limit():
    cls = uvicorn_config(object(), ServerSettings(max_request_body_size="4KiB")).http
    assert cls.__name__ == strict_h11_protocol(1).__name__ == "StrictH11Protocol"
