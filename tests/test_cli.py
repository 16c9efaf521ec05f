"""The `turnrl` command line: version, thin clients against real services, `turnrl run`."""

import asyncio
import json
import signal
import subprocess
import sys

import pytest

import turnrl

from .conftest import EXAMPLE_CONFIG, FREE_PORTS, run_turnrl, serve_subprocess

# Each service's name, and the gRPC service it serves.
SERVICE_CLASSES = {
    "tool": "ToolService",
    "reward": "RewardService",
    "rollout": "RolloutService",
    "trainer": "TrainerService",
}

# These start the rollout service, whose default model is the tiny one: build it before the
# services' start-up timeouts begin.
pytestmark = pytest.mark.usefixtures("tiny_model_dir")


async def test_version():
    code, stdout, _ = await run_turnrl("--version")
    assert code == 0
    assert stdout.strip() == f"turnrl {turnrl.__version__}"


async def test_health_reports_serving_as_json():
    async with serve_subprocess("reward") as served:
        code, stdout, _ = await run_turnrl("health", "--addr", served.address)
    assert code == 0
    assert json.loads(stdout) == {"address": served.address, "service": "", "status": "SERVING"}


async def test_health_fails_for_an_unknown_service_name():
    async with serve_subprocess("reward") as served:
        code, _, stderr = await run_turnrl(
            "health", "--addr", served.address, "--service", "turnrl.v1.NoSuchService"
        )
    assert code == 1
    assert "NOT_FOUND" in stderr


async def test_tool_list_and_call_print_json():
    async with serve_subprocess("tool", "tool.tools=[{class_name: calculator}]") as tool:
        listed, called, failed = await asyncio.gather(
            run_turnrl("tool", "list", "--addr", tool.address),
            run_turnrl(
                "tool", "call", "calculator", '{"expression": "6*7"}', "--addr", tool.address
            ),
            run_turnrl("tool", "call", "calculator", '{"expression": "x"}', "--addr", tool.address),
        )
    code, stdout, _ = listed
    assert code == 0
    (calculator,) = json.loads(stdout)
    assert calculator["function"]["name"] == "calculator"
    assert calculator["function"]["parameters"]["required"] == ["expression"]
    assert calculator["limits"]["max_concurrency"] == 16
    assert called[0] == 0 and json.loads(called[1]) == {"text": "42"}
    code, stdout, _ = failed
    assert code == 1  # a tool error exits non-zero, with the result still printed
    assert json.loads(stdout)["error"]["kind"] == "KIND_INVALID_ARGUMENTS"


async def test_tool_call_in_a_session():
    async with serve_subprocess("tool", "tool.tools=[{class_name: gsm8k_answer}]") as tool:
        code, stdout, _ = await run_turnrl(
            "tool", "call", "gsm8k_answer", '{"answer": "18"}', "--addr", tool.address,
            "--session-kwargs", '{"ground_truth": "#### 18"}',
        )  # fmt: skip
    assert code == 0
    assert json.loads(stdout)["text"] == "Your answer 18 is correct."


async def test_score_prints_one_json_object_per_item(tmp_path):
    batch = tmp_path / "items.jsonl"
    batch.write_text(
        '{"response": "#### 42", "ground_truth": "42"}\n'
        '{"response": "#### 41", "ground_truth": "42"}\n'
        '{"response": "<answer>Paris</answer>", "ground_truth": ["paris"], "data_source": "nq"}\n'
    )
    async with serve_subprocess("reward") as reward:
        single, many, unknown = await asyncio.gather(
            run_turnrl(
                "score", "--addr", reward.address, "--data-source", "openai/gsm8k",
                "--ground-truth", "42", "--response", "The answer is #### 42",
            ),
            run_turnrl(
                "score", "--addr", reward.address, "--data-source", "openai/gsm8k",
                "--input", str(batch),
            ),
            run_turnrl(
                "score", "--addr", reward.address, "--data-source", "gsm8k_v2", "--response", "1",
            ),
        )  # fmt: skip
    code, stdout, _ = single
    assert code == 0
    result = json.loads(stdout)
    assert result["score"] == 1.0 and result["scorer"] == "gsm8k" and not result["error"]
    assert result["failure"] == "FAILURE_UNSPECIFIED"
    assert result["extras"]["extracted"] == "42"
    code, stdout, _ = many
    assert code == 0
    scores = {item["item_id"]: item["score"] for item in map(json.loads, stdout.splitlines())}
    assert scores == {"1": 1.0, "2": 0.0, "3": 1.0}
    code, _, stderr = unknown
    assert code == 1
    assert "INVALID_ARGUMENT" in stderr and "unknown data_source 'gsm8k_v2'" in stderr


async def test_score_ground_truth_is_json_or_a_bare_string():
    # A list of gold answers reaches the scorer as a list, not as the text '["paris", ...]'; a
    # bare word that is not JSON is the string it spells.
    def score_nq(ground_truth: str, answer: str):
        return run_turnrl(
            "score", "--addr", reward.address, "--data-source", "nq",
            "--ground-truth", ground_truth, "--response", f"<answer>{answer}</answer>",
        )  # fmt: skip

    async with serve_subprocess("reward") as reward:
        results = await asyncio.gather(
            score_nq('["paris", "france"]', "France"),
            score_nq('{"target": ["Paris"]}', "paris"),
            score_nq("Paris", "paris"),
            score_nq('"Paris"', "paris"),
        )
    for code, stdout, stderr in results:
        assert code == 0, stderr
        assert json.loads(stdout)["score"] == 1.0


async def test_score_refuses_a_ground_truth_that_is_broken_json():
    # Text that opens like a JSON list, object or string but does not parse is a typo, not a
    # gold answer spelled '["paris"'; the command fails before calling the service.
    code, stdout, stderr = await run_turnrl(
        "score", "--data-source", "nq", "--ground-truth", '["paris"', "--response", "x",
        "--addr", "127.0.0.1:1",
    )  # fmt: skip
    assert code == 2 and stdout == ""
    assert "--ground-truth" in stderr and "'[\"paris\"'" in stderr


async def test_score_input_with_invalid_utf8_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"response": "ok"}\n{"response": "caf\xe9"}\n')
    code, _, stderr = await run_turnrl(
        "score", "--data-source", "openai/gsm8k", "--input", str(bad), "--addr", "127.0.0.1:1"
    )
    assert code == 2
    assert f"{bad}:2: not valid UTF-8" in stderr


async def test_score_reads_a_jsonl_input_and_rejects_bad_lines(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"response": "#### 1", "ground_truth": "1"}\n{"no_response": true}\n')
    code, _, stderr = await run_turnrl(
        "score", "--data-source", "openai/gsm8k", "--input", str(bad), "--addr", "127.0.0.1:1"
    )
    assert code == 2
    assert f"{bad}:2" in stderr and "'response'" in stderr


async def test_tool_call_rejects_session_kwargs_that_are_not_an_object():
    code, _, stderr = await run_turnrl(
        "tool", "call", "calculator", "{}", "--session-kwargs", "[1, 2]", "--addr", "127.0.0.1:1"
    )
    assert code == 2
    assert "--session-kwargs must be a JSON object" in stderr


async def test_client_reports_an_unreachable_service():
    code, _, stderr = await run_turnrl("tool", "list", "--addr", "127.0.0.1:1", "--timeout", "2")
    assert code == 1
    assert "ListTools at 127.0.0.1:1 failed" in stderr


async def test_unknown_arguments_are_refused():
    code, _, stderr = await run_turnrl("tool", "list", "tool.server.port=1")
    assert code == 2
    assert "unrecognized arguments: tool.server.port=1" in stderr


async def test_run_reports_a_refused_run_and_stops_the_services(tmp_path, example_on_tiny_model):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "metrics.jsonl").write_text("")
    code, _, stderr = await run_turnrl(
        "run", "--config", str(EXAMPLE_CONFIG), *FREE_PORTS, *example_on_tiny_model,
        f"trainer.output_dir={tmp_path}", "trainer.run_name=taken",
    )  # fmt: skip
    assert code == 1
    assert "StartRun failed: ALREADY_EXISTS" in stderr
    assert "[trainer]" in stderr and "shutting down" in stderr
    # Each service's output is in the run's folder too, from its start to its stop.
    for name, service in SERVICE_CLASSES.items():
        log = (tmp_path / "taken" / "logs" / f"{name}.log").read_text()
        assert log.startswith(f"turnrl: start of the {name} service at ")
        assert f"serving {service} on 127.0.0.1:" in log and "shutting down" in log


@pytest.mark.parametrize(
    ("package", "service"), [(f"{name}_svc", service) for name, service in SERVICE_CLASSES.items()]
)
async def test_each_service_package_runs_as_a_module(package, service, tiny_model_dir):
    # A service started alone reads its own section and resolves no null model_path.
    model = [f"rollout.model_path={tiny_model_dir}"] if package == "rollout_svc" else []
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", package, "--port", "0", *model,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(60):
        line = (await process.stdout.readline()).decode()
        process.send_signal(signal.SIGTERM)
        await process.communicate()
    assert line.startswith(f"serving {service} on 127.0.0.1:")
    assert process.returncode == 0


def test_the_cli_and_config_load_without_torch():
    # Thin clients (`turnrl tool list`, `turnrl score`) and config loading stay quick: torch and
    # transformers load only in the services that use them.
    code = (
        "import sys, turnrl_cli.cli, turnrl_cli.project_config; "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert loaded.strip() == "[]"
