"""The reward service's methods as JSON over HTTP (turnrl.rpc.http_json) on loopback, called
with a plain httpx client: Score, ScoreBatch as NDJSON both ways, ListScorers, deadlines and
errors as over gRPC."""

import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from reward_svc.config import RewardConfig
from reward_svc.server import RewardServicer
from reward_svc.service import RewardService
from tests.reward_svc.test_service import PROBE_PLUGINS
from tests.tool_svc.test_http_json import assert_matches
from turnrl.config import HttpJsonServerConfig, validate_config
from turnrl.errors import ConfigError
from turnrl.rpc.http_json import serve_http_json
from turnrl.v1 import reward_pb2

DESCRIPTOR = reward_pb2.DESCRIPTOR.services_by_name["RewardService"]
GSM8K_ANSWER = "Natalia sold 48/2 = 24 clips in May, 48 + 24 = 72 in all. #### 72"


@contextlib.asynccontextmanager
async def reward_http(**settings) -> AsyncIterator[httpx.AsyncClient]:
    """A real reward service's HTTP/JSON port on 127.0.0.1:0; yields an httpx client of it."""
    server = HttpJsonServerConfig(port=0, http_port=0, **settings.pop("server", {}))
    settings.setdefault("workers", 1)
    config = RewardConfig(server=server, plugins=PROBE_PLUGINS, **settings)
    service = await RewardService.create(config)
    try:
        async with (
            serve_http_json(server, DESCRIPTOR, RewardServicer(service)) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as http,
        ):
            yield http
    finally:
        await service.close()


def scoring_input(data_source: str, response: str, ground_truth: str) -> dict:
    return {"data_source": data_source, "response_text": response, "ground_truth": ground_truth}


async def test_score_list_scorers_and_their_errors():
    async with reward_http(item_timeout_seconds=30) as http:
        right = await http.post(
            "/v1/RewardService/Score",
            json={"input": scoring_input("openai/gsm8k", GSM8K_ANSWER, "72")},
        )
        wrong = await http.post(
            "/v1/RewardService/Score", json={"input": scoring_input("openai/gsm8k", "71", "72")}
        )
        listed = await http.post("/v1/RewardService/ListScorers", json={})
        document = (await http.get("/openapi.json")).json()
        unknown = await http.post(
            "/v1/RewardService/Score", json={"input": scoring_input("gsm8k_v2", "1", "1")}
        )
        # Last: the hung scorer holds the only worker until it is recycled.
        cut = await http.post(
            "/v1/RewardService/Score",
            json={"input": scoring_input("hangs", "x", "x")},
            headers={"X-Request-Timeout": "0.5"},
        )
    assert right.status_code == 200, right.text
    result = right.json()["result"]
    assert result["reward"]["score"] == 1.0 and result["reward"]["error"] is False
    assert result["scorer"] == "gsm8k"
    # Every field, defaults included: a zero score is there, not left out.
    assert wrong.json()["result"]["reward"]["score"] == 0.0
    names = {s["name"]: s["data_sources"] for s in listed.json()["scorers"]}
    assert "openai/gsm8k" in names["gsm8k"] and names["plugin:compute_score"] == ["echo"]
    assert_matches(document, "turnrl.v1.ScoreResponse", right.json())
    assert_matches(document, "turnrl.v1.ListScorersResponse", listed.json())
    assert sorted(document["paths"]) == [
        "/v1/RewardService/ListScorers",
        "/v1/RewardService/Score",
        "/v1/RewardService/ScoreBatch",
    ]
    assert unknown.status_code == 400 and unknown.json()["status"] == "INVALID_ARGUMENT"
    assert "unknown data_source 'gsm8k_v2'; known:" in unknown.json()["message"]
    assert cut.status_code == 504
    assert cut.json()["status"] == "DEADLINE_EXCEEDED" and cut.json()["code"] == 4


async def test_a_scorers_turn_rewards_show_in_the_json():
    item = scoring_input("per_turn", "72", "72")
    item["messages"] = [{"role": "ROLE_ASSISTANT", "content": [{"text": "72"}]}]
    async with reward_http(item_timeout_seconds=30) as http:
        reply = await http.post("/v1/RewardService/Score", json={"input": item})
    assert reply.status_code == 200, reply.text
    assert reply.json()["result"]["reward"]["turn_rewards"] == [
        {"turn": 0, "value": 0.1, "source": "TURN_REWARD_SOURCE_SCORER",
         "name": "plugin:rewards_each_turn"}
    ]  # fmt: skip


async def test_score_batch_streams_ndjson_results_and_refuses_a_bad_line():
    kinds = ["openai/gsm8k", "echo", "nope", "raises"]
    items = [
        {
            "item_id": f"item-{i}",
            "input": scoring_input(kind, GSM8K_ANSWER if kind == "openai/gsm8k" else "72", "72"),
        }
        for i, kind in enumerate(kinds)
    ]
    body = "".join(json.dumps(item) + "\n" for item in items)
    async with (
        reward_http(item_timeout_seconds=5) as http,
        http.stream(
            "POST",
            "/v1/RewardService/ScoreBatch",
            content=body,
            headers={"Content-Type": "application/x-ndjson"},
        ) as reply,
    ):
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) async for line in reply.aiter_lines() if line]
        bad_body = json.dumps(items[1]) + "\n{oops\n"
        refused = await http.post("/v1/RewardService/ScoreBatch", content=bad_body)
    results = {line["item_id"]: line["result"] for line in lines}
    assert sorted(results) == [item["item_id"] for item in items]
    assert results["item-0"]["reward"]["score"] == 1.0
    assert results["item-1"]["reward"]["score"] == 1.0
    assert results["item-2"]["failure"] == "FAILURE_UNKNOWN_DATA_SOURCE"
    assert "unknown data_source 'nope'" in results["item-2"]["reward"]["error_message"]
    assert results["item-3"]["reward"]["error"] is True
    # A bad line is INVALID_ARGUMENT: the status, or the stream's last line when the first
    # result was ready before it was read.
    if refused.status_code == 200:
        error = json.loads(refused.text.splitlines()[-1])["error"]
    else:
        assert refused.status_code == 400
        error = refused.json()
    assert error["status"] == "INVALID_ARGUMENT"
    assert "does not parse as turnrl.v1.ScoreBatchRequest" in error["message"]


@pytest.mark.parametrize("section", ["rollout", "trainer"])
def test_http_port_is_refused_where_it_does_nothing(section):
    from turnrl_cli.project_config import ProjectConfig

    with pytest.raises(ConfigError, match=rf"unknown key '{section}\.server\.http_port'"):
        validate_config(
            ProjectConfig, {section: {"server": {"http_port": 8080}}}, path=None, overrides={}
        )
