"""The tool service's Prometheus endpoint, scraped from a real `turnrl serve tool` process."""

from tests.conftest import scrape_metrics, serve_subprocess
from turnrl import rpc
from turnrl.config import ClientConfig
from turnrl.v1 import tool_pb2, tool_pb2_grpc


async def test_metrics_count_calls_errors_and_sessions():
    tools = "tool.tools=[{class_name: calculator}, {class_name: gsm8k_answer}]"
    async with serve_subprocess("tool", tools, "tool.server.metrics_port=0") as served:
        assert served.metrics_url is not None
        async with rpc.open_channel(ClientConfig(address=served.address)) as channel:
            stub = tool_pb2_grpc.ToolServiceStub(channel)
            for arguments in ['{"expression": "1+1"}', '{"expression": "2*3"}', "{bad"]:
                await stub.Execute(
                    tool_pb2.ExecuteRequest(tool_name="calculator", arguments=arguments), timeout=5
                )
            await stub.CreateSession(
                tool_pb2.CreateSessionRequest(
                    tool_name="gsm8k_answer", session_kwargs={"ground_truth": "1"}
                ),
                timeout=5,
            )
        scraped = await scrape_metrics(served.metrics_url)
    calculator = (("tool", "calculator"),)
    assert scraped[("turnrl_tool_calls_total", calculator)] == 3
    assert (
        scraped[
            ("turnrl_tool_errors_total", (("kind", "INVALID_ARGUMENTS"), ("tool", "calculator")))
        ]
        == 1
    )
    assert scraped[("turnrl_tool_call_seconds_count", calculator)] == 3
    assert scraped[("turnrl_tool_live_sessions", (("tool", "gsm8k_answer"),))] == 1
    assert scraped[("turnrl_tool_queue_depth", calculator)] == 0
