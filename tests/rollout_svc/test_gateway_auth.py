"""The gateway's security, which is the rollout service's gRPC server's (`rollout.server`): its
bearer token, its TLS certificate (and client certificates with mTLS), and the refusal of an
address other machines reach with neither. A real rollout service on the tiny model, driven
by the real `openai` client."""

import ssl

import httpx
import openai
import pytest

from tests.rollout_svc.test_gateway import gateway_server
from tests.turnrl.test_rpc import make_certificates
from turnrl.config import ServerConfig, TlsConfig
from turnrl.errors import ConfigError

TOKEN_ENV = "TURNRL_TEST_GATEWAY_TOKEN"
TOKEN = "gateway-test-token"
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


async def ask(chat: openai.AsyncOpenAI, model: str):
    return await chat.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=4
    )


async def test_a_token_is_required_on_every_route(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    server = ServerConfig(port=0, auth_token_env=TOKEN_ENV)
    async with gateway_server(tiny_model_dir, server=server) as gateway:
        model = gateway.service.chat_sessions.model_name
        wrong = gateway.client("refused", api_key="not-the-token")
        with pytest.raises(openai.AuthenticationError) as refused:
            await ask(wrong, model)
        assert refused.value.status_code == 401
        assert refused.value.code == "invalid_api_key"
        assert refused.value.type == "invalid_request_error"
        assert "invalid bearer token" in refused.value.message
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()

        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            missing = await http.post(
                "/sessions/refused/v1/chat/completions", json={"model": model, "messages": QUESTION}
            )
            assert missing.status_code == 401
            assert missing.json()["error"]["code"] == "invalid_api_key"
            assert "missing bearer token" in missing.json()["error"]["message"]
            assert (await http.post("/sessions/refused/end")).status_code == 401

            reply = await ask(gateway.client("allowed", api_key=TOKEN), model)
            assert reply.choices[0].message.role == "assistant"
            authorized = {"Authorization": f"Bearer {TOKEN}"}
            # The refused requests opened no session; the allowed one recorded its turn.
            never_opened = await http.post("/sessions/refused/end", headers=authorized)
            assert never_opened.status_code == 404
            ended = await http.post("/sessions/allowed/end", headers=authorized)
    assert ended.status_code == 200
    assert [s["source"] for s in ended.json()["segments"]] == ["prompt", "model"]


async def test_tls_serves_https_with_the_server_certificate(tiny_model_dir, tmp_path):
    certs = make_certificates(tmp_path)
    tls = TlsConfig(cert_file=certs["server_cert"], key_file=certs["server_key"])
    async with gateway_server(tiny_model_dir, server=ServerConfig(port=0, tls=tls)) as gateway:
        assert gateway.url.startswith("https://127.0.0.1:")
        model = gateway.service.chat_sessions.model_name
        trusting = httpx.AsyncClient(verify=ssl.create_default_context(cafile=certs["ca"]))
        reply = await ask(gateway.client("tls", http_client=trusting), model)
        assert reply.choices[0].message.role == "assistant"
        # The system's CAs do not know this one.
        with pytest.raises(openai.APIConnectionError) as untrusted:
            await ask(gateway.client("untrusted"), model)
        assert "CERTIFICATE_VERIFY_FAILED" in str(untrusted.value.__cause__)
        plain_url = gateway.url.replace("https://", "http://")
        async with httpx.AsyncClient() as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get(f"{plain_url}/v1/models", timeout=10)


async def test_mutual_tls_requires_a_client_certificate(tiny_model_dir, tmp_path):
    certs = make_certificates(tmp_path)
    tls = TlsConfig(
        cert_file=certs["server_cert"], key_file=certs["server_key"], client_ca_file=certs["ca"]
    )
    async with gateway_server(tiny_model_dir, server=ServerConfig(port=0, tls=tls)) as gateway:
        without_certificate = ssl.create_default_context(cafile=certs["ca"])
        with_certificate = ssl.create_default_context(cafile=certs["ca"])
        with_certificate.load_cert_chain(certs["client_cert"], certs["client_key"])
        anonymous = gateway.client(
            "mtls", http_client=httpx.AsyncClient(verify=without_certificate)
        )
        with pytest.raises(openai.APIConnectionError):
            await anonymous.models.list()
        known = gateway.client("mtls", http_client=httpx.AsyncClient(verify=with_certificate))
        listed = await known.models.list()
    assert [m.id for m in listed.data] == [gateway.service.chat_sessions.model_name]


async def test_an_exposed_gateway_needs_tls_or_a_token(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"gateway\.host '0\.0\.0\.0' is reachable") as refused:
        async with gateway_server(tiny_model_dir, host="0.0.0.0"):
            pass
    assert "server.allow_insecure: true" in str(refused.value)


async def test_a_missing_tls_file_fails_the_start(tiny_model_dir, tmp_path):
    tls = TlsConfig(cert_file=tmp_path / "absent.pem", key_file=tmp_path / "absent.key")
    with pytest.raises(ConfigError, match=r"the gateway cannot load .*absent\.pem"):
        async with gateway_server(tiny_model_dir, server=ServerConfig(port=0, tls=tls)):
            pass
