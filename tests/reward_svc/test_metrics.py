"""The reward service's Prometheus endpoint, scraped from a real `turnrl serve reward` process."""

from tests.conftest import scrape_metrics, serve_subprocess
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.v1 import reward_pb2, reward_pb2_grpc


async def test_metrics_count_items_latency_and_errors_by_kind():
    async with serve_subprocess("reward", "reward.server.metrics_port=0") as served:
        assert served.metrics_url is not None
        async with rpc.open_channel(ClientConfig(address=served.address)) as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            for response in ("#### 4", "#### 5", "no answer"):
                item = reward_pb2.ScoringInput(data_source="openai/gsm8k", response_text=response)
                item.ground_truth.string_value = "4"
                await stub.Score(reward_pb2.ScoreRequest(input=item), timeout=30)
            unknown = reward_pb2.ScoringInput(data_source="no/such/source", response_text="x")
            replies = stub.ScoreBatch(
                iter([reward_pb2.ScoreBatchRequest(item_id="u", input=unknown)]), timeout=30
            )
            assert [reply.item_id async for reply in replies] == ["u"]
        scraped = await scrape_metrics(served.metrics_url)
    gsm8k = (("scorer", "gsm8k"),)
    assert scraped[("turnrl_reward_items_total", gsm8k)] == 3
    assert scraped[("turnrl_reward_item_seconds_count", gsm8k)] == 3
    assert scraped[("turnrl_reward_item_seconds_sum", gsm8k)] > 0
    assert scraped[("turnrl_reward_items_total", (("scorer", "none"),))] == 1
    unknown_kind = (("kind", "UNKNOWN_DATA_SOURCE"), ("scorer", "none"))
    assert scraped[("turnrl_reward_errors_total", unknown_kind)] == 1
    assert scraped[("process_resident_memory_bytes", ())] > 0
