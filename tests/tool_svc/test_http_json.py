"""The tool service's methods as JSON over HTTP (turnrl.rpc.http_json), beside its gRPC server
on loopback, called with a plain httpx client: the same replies and errors as gRPC, the
server's token, TLS and limits, and the OpenAPI document."""

import asyncio
import contextlib
import json
import re
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import pytest
import referencing
from google.protobuf import json_format

from tests.conftest import serve_in_process
from tests.tool_svc.test_python_sandbox import FAST_OPTIONS
from tests.tool_svc.test_service import PROBES, entry
from tests.turnrl.test_rpc import make_certificates
from tool_svc.config import ToolConfig, ToolEntry
from tool_svc.server import ToolServicer
from tool_svc.service import ToolService
from turnrl import rpc
from turnrl.config import ClientConfig, HttpJsonServerConfig, TlsConfig
from turnrl.errors import ConfigError, RpcNotFoundError
from turnrl.rpc.http_json import serve_http_json
from turnrl.v1 import tool_pb2, tool_pb2_grpc

TOKEN_ENV = "TURNRL_TEST_HTTP_JSON_TOKEN"
TOKEN = "http-json-test-token"
DESCRIPTOR = tool_pb2.DESCRIPTOR.services_by_name["ToolService"]


@dataclass
class ToolEndpoints:
    """One tool service served both ways."""

    http: httpx.AsyncClient
    stub: tool_pb2_grpc.ToolServiceStub
    url: str


@contextlib.asynccontextmanager
async def tool_endpoints(
    *entries: ToolEntry, verify: ssl.SSLContext | bool = True, **server_settings
) -> AsyncIterator[ToolEndpoints]:
    """A real tool service on 127.0.0.1:0 serving `entries` over gRPC and HTTP/JSON; yields an
    httpx client of the HTTP port and a gRPC stub."""
    server = HttpJsonServerConfig(port=0, http_port=0, **server_settings)
    config = ToolConfig(server=server, tools=list(entries))
    service = await ToolService.create(config)
    servicer = ToolServicer(service)
    try:
        async with (
            serve_in_process(
                server,
                DESCRIPTOR,
                lambda s: tool_pb2_grpc.add_ToolServiceServicer_to_server(servicer, s),
            ) as address,
            rpc.open_channel(ClientConfig(address=address)) as channel,
            serve_http_json(server, DESCRIPTOR, servicer) as url,
            httpx.AsyncClient(base_url=url, timeout=30, verify=verify) as http,
        ):
            yield ToolEndpoints(http, tool_pb2_grpc.ToolServiceStub(channel), url)
    finally:
        await service.close()


def execute_body(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"tool_name": tool, "arguments": json.dumps(arguments)}


async def test_calculator_and_python_calls_answer_as_grpc_does():
    python = ToolEntry(class_name="python", config=FAST_OPTIONS)
    async with tool_endpoints(entry("calculator"), python) as served:
        calculated = await served.http.post(
            "/v1/ToolService/Execute", json=execute_body("calculator", {"expression": "6*7"})
        )
        ran = await served.http.post(
            "/v1/ToolService/Execute", json=execute_body("python", {"code": "print(2 ** 10)"})
        )
        over_grpc = await served.stub.Execute(
            tool_pb2.ExecuteRequest(tool_name="calculator", arguments='{"expression": "6*7"}'),
            timeout=10,
        )
    assert calculated.status_code == 200, calculated.text
    assert calculated.headers["content-type"] == "application/json"
    assert calculated.json()["result"]["text"] == "42"
    assert calculated.json() == json_format.MessageToDict(
        over_grpc, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
    assert ran.status_code == 200, ran.text
    assert ran.json()["result"]["text"].strip() == "1024"
    assert "error" not in ran.json()["result"]


async def test_an_unknown_tool_is_the_grpc_paths_error():
    async with tool_endpoints(entry("calculator")) as served:
        # Execute answers an unknown tool as the model's error, not the call's.
        executed = await served.http.post("/v1/ToolService/Execute", json=execute_body("nope", {}))
        created = await served.http.post(
            "/v1/ToolService/CreateSession", json={"tool_name": "nope"}
        )
        with pytest.raises(RpcNotFoundError) as over_grpc:
            await served.stub.CreateSession(
                tool_pb2.CreateSessionRequest(tool_name="nope"), timeout=10
            )
    assert executed.status_code == 200
    assert executed.json()["result"]["error"]["kind"] == "KIND_UNKNOWN_TOOL"
    assert "unknown tool 'nope'" in executed.json()["result"]["text"]
    assert created.status_code == 404
    assert created.json() == {
        "code": 5,
        "status": "NOT_FOUND",
        "message": over_grpc.value.details,
        "details": [],
    }
    assert "'nope'" in created.json()["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{broken", "does not parse as turnrl.v1.ExecuteRequest"),
        (b'{"tool_name": "calculator", "bogus": 1}', 'no field named "bogus"'),
        (b'{"tool_name": 7}', "tool_name"),
        (b"\xff\xfe", "does not parse as turnrl.v1.ExecuteRequest"),
        (b"{}", "tool_name is required"),
    ],
)
async def test_a_bad_request_is_400_invalid_argument(body, message):
    async with tool_endpoints(entry("calculator")) as served:
        reply = await served.http.post("/v1/ToolService/Execute", content=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["status"] == "INVALID_ARGUMENT" and reply.json()["code"] == 3
    assert message in reply.json()["message"]


async def test_the_bearer_token_is_required(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    async with tool_endpoints(entry("calculator"), auth_token_env=TOKEN_ENV) as served:
        missing = await served.http.post("/v1/ToolService/ListTools", json={})
        wrong = await served.http.post(
            "/v1/ToolService/ListTools", json={}, headers={"Authorization": "Bearer nope"}
        )
        document = await served.http.get("/openapi.json")
        allowed = await served.http.post(
            "/v1/ToolService/ListTools", json={}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
    for refused, reason in [(missing, "missing bearer token"), (wrong, "invalid bearer token")]:
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["status"] == "UNAUTHENTICATED" and reason in refused.json()["message"]
    assert document.status_code == 401
    assert allowed.status_code == 200
    assert [t["schema"]["name"] for t in allowed.json()["tools"]] == ["calculator"]


async def test_a_body_over_the_message_limit_is_413():
    async with tool_endpoints(entry(f"{PROBES}:EchoTool"), max_message_bytes=1000) as served:
        body = execute_body("echo", {"text": "x" * 2000})
        declared = await served.http.post("/v1/ToolService/Execute", json=body)

        async def chunks():  # no Content-Length: counted as it arrives
            yield json.dumps(body).encode()

        streamed = await served.http.post("/v1/ToolService/Execute", content=chunks())
        fits = await served.http.post(
            "/v1/ToolService/Execute", json=execute_body("echo", {"text": "x" * 100})
        )
    for refused in (declared, streamed):
        assert refused.status_code == 413
        assert refused.json()["status"] == "RESOURCE_EXHAUSTED"
        assert "1000 (server.max_message_bytes)" in refused.json()["message"].replace(" bytes", "")
    assert fits.status_code == 200 and fits.json()["result"]["text"] == "x" * 100


async def test_the_timeout_header_is_the_calls_deadline():
    sleep = entry(f"{PROBES}:SleepTool", call_timeout_seconds=30)
    async with tool_endpoints(sleep) as served:
        cut = await served.http.post(
            "/v1/ToolService/Execute",
            json=execute_body("sleep", {"seconds": 30}),
            headers={"X-Request-Timeout": "0.5"},
        )
        bad = await served.http.post(
            "/v1/ToolService/Execute",
            json=execute_body("sleep", {"seconds": 0}),
            headers={"X-Request-Timeout": "soon"},
        )
    # As over gRPC: answered before the caller gives up, as the system's failure.
    assert cut.status_code == 200
    assert cut.json()["result"]["error"]["kind"] == "KIND_DEADLINE_EXCEEDED"
    assert bad.status_code == 400 and "X-Request-Timeout 'soon'" in bad.json()["message"]


async def test_calls_past_max_concurrent_rpcs_are_429():
    sleep = entry(f"{PROBES}:SleepTool", call_timeout_seconds=30)
    async with tool_endpoints(sleep, max_concurrent_rpcs=1) as served:
        running = asyncio.create_task(
            served.http.post("/v1/ToolService/Execute", json=execute_body("sleep", {"seconds": 3}))
        )
        # The sleeping call holds the only slot for 3 s once it arrives.
        refused = None
        while not running.done():
            reply = await served.http.post("/v1/ToolService/ListTools", json={})
            if reply.status_code != 200:
                refused = reply
                break
        slept = await running
        after = await served.http.post("/v1/ToolService/ListTools", json={})
    assert refused is not None and refused.status_code == 429
    assert refused.json()["status"] == "RESOURCE_EXHAUSTED"
    assert "server.max_concurrent_rpcs" in refused.json()["message"]
    assert slept.json()["result"]["text"] == "slept 3s"
    assert after.status_code == 200


async def test_unknown_routes_answer_json_errors():
    async with tool_endpoints(entry("calculator")) as served:
        unknown = await served.http.post("/v1/ToolService/Nope", json={})
        wrong_method = await served.http.get("/v1/ToolService/ListTools")
    assert unknown.status_code == 404 and unknown.json()["status"] == "NOT_FOUND"
    assert "/openapi.json" in unknown.json()["message"]
    assert wrong_method.status_code == 405 and wrong_method.json()["status"] == "UNIMPLEMENTED"


async def test_the_openapi_document_lists_every_method_and_describes_the_replies():
    async with tool_endpoints(entry("calculator"), entry("gsm8k_answer")) as served:
        document = (await served.http.get("/openapi.json")).json()
        listed = (await served.http.post("/v1/ToolService/ListTools", json={})).json()
        created = await served.http.post(
            "/v1/ToolService/CreateSession",
            json={"tool_name": "gsm8k_answer", "session_kwargs": {"ground_truth": "18"}},
        )
    assert document["openapi"] == "3.1.0"
    assert "security" not in document  # no token on this server
    assert sorted(document["paths"]) == sorted(
        f"/v1/ToolService/{method.name}" for method in DESCRIPTOR.methods
    )
    execute = document["paths"]["/v1/ToolService/Execute"]["post"]
    assert execute["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/turnrl.v1.ExecuteRequest"
    }
    schemas = document["components"]["schemas"]
    assert schemas["turnrl.v1.ToolError"]["properties"]["kind"]["enum"][0] == "KIND_UNSPECIFIED"
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(document))
    assert set(refs) <= set(schemas) and "turnrl.v1.ExecuteResponse" in refs
    operations = [path["post"] for path in document["paths"].values()]
    assert len({op["operationId"] for op in operations}) == len(operations)
    assert all({"200", "default"} == set(op["responses"]) for op in operations)
    assert_matches(document, "turnrl.v1.ListToolsResponse", listed)
    assert created.status_code == 200
    assert_matches(document, "turnrl.v1.CreateSessionResponse", created.json())


def assert_matches(document: dict[str, Any], schema_name: str, value: Any) -> None:
    """Validates `value` against a schema of the OpenAPI document (JSON Schema 2020-12)."""
    resource = referencing.Resource.from_contents(
        document, default_specification=referencing.jsonschema.DRAFT202012
    )
    registry = referencing.Registry().with_resource("urn:openapi", resource)
    schema = {"$ref": f"urn:openapi#/components/schemas/{schema_name}"}
    jsonschema.Draft202012Validator(schema, registry=registry).validate(value)


async def test_https_with_the_servers_certificate(tmp_path):
    certs = make_certificates(tmp_path)
    tls = TlsConfig(cert_file=certs["server_cert"], key_file=certs["server_key"])
    trusted = ssl.create_default_context(cafile=certs["ca"])
    async with tool_endpoints(entry("calculator"), tls=tls, verify=trusted) as served:
        assert served.url.startswith("https://127.0.0.1:")
        listed = await served.http.post("/v1/ToolService/ListTools", json={})
        async with httpx.AsyncClient(verify=False) as plaintext:
            with pytest.raises(httpx.HTTPError):
                await plaintext.post(
                    served.url.replace("https", "http") + "/v1/ToolService/ListTools"
                )
    assert listed.status_code == 200


async def test_an_exposed_port_needs_tls_or_a_token():
    exposed = HttpJsonServerConfig(host="0.0.0.0", port=0, http_port=0)
    with pytest.raises(ConfigError, match=r"server\.host '0\.0\.0\.0' is reachable"):
        async with serve_http_json(exposed, DESCRIPTOR, tool_pb2_grpc.ToolServiceServicer()):
            pass
