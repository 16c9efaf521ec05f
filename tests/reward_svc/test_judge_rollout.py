"""An LLM judge served by turnrl: the reward service's judge calls a real rollout service on
loopback over gRPC (RolloutService.Generate), which runs a shipped tiny model on the hf engine.

The tests' calculator model writes no verdict, which is the verdict-less path, counted. A parsed
verdict comes from the code example's model, which learned to answer some problems at once
with a guess, `\\boxed{<the problem's first number>}`: asked a problem in the system turn it was
trained on (its prompt and its tool's schema, which a rollout service renders only for a
prompt's tool_names, and a judge has none), it answers greedily with a boxed number, which
`parse: boxed` reads. Whatever it writes, the test compares the judge's raw text with what the
same rollout service generates for the same prompt called directly.
"""

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable

import pytest
from google.protobuf import json_format
from transformers import AutoTokenizer

from reward_svc.config import RewardConfig
from reward_svc.metrics import RewardMetrics
from reward_svc.scorers.base import ScorerUnavailableError, ScoringRequest
from reward_svc.scorers.judge import JudgeOptions, LlmJudge, parse_boxed
from rollout_svc.server import RolloutServicer
from rollout_svc.service import RolloutService
from tests.in_process_services import rollout_service_address
from tests.reward_svc.judge_stand_in import NoVerdictCount
from tests.reward_svc.test_service import serving
from turnrl import code_problems, rpc
from turnrl.config import REPO_ROOT, ClientConfig, HttpJsonServerConfig
from turnrl.v1 import common_pb2, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from turnrl_cli.project_config import load_project_config
from turnrl_demo.tiny_model import build_tiny_model, task_tools

Failure = reward_pb2.ScoringResult.Failure
RUBRIC = "{response}"  # the judge model is asked the response itself (see the docstring)
JUDGE_MAX_TOKENS = 48


class GenerateRecorder(RolloutServicer):
    """The rollout service's servicer, keeping each Generate request it answers."""

    def __init__(self, service: RolloutService) -> None:
        super().__init__(service)
        self.requests: list[rollout_pb2.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        async for reply in super().Generate(request, context):
            yield reply


def recording(recorders: list[GenerateRecorder]) -> Callable[[RolloutService], RolloutServicer]:
    def servicer(service: RolloutService) -> RolloutServicer:
        recorders.append(GenerateRecorder(service))
        return recorders[-1]

    return servicer


@contextlib.asynccontextmanager
async def reward_service_with(
    judge: JudgeOptions,
) -> AsyncIterator[tuple[reward_pb2_grpc.RewardServiceStub, RewardMetrics]]:
    """A real reward service on loopback grading with `judge`; yields a stub and its metrics."""
    config = RewardConfig(server=HttpJsonServerConfig(port=0), workers=1, judges=[judge])
    async with serving(config) as (stub, service):
        yield stub, service.metrics


def rollout_judge(address: str, **changes) -> JudgeOptions:
    fields = {
        "name": "turnrl-judge",
        "data_sources": ["judged"],
        "rollout": ClientConfig(address=address),
        "rubric": RUBRIC,
        "max_tokens": JUDGE_MAX_TOKENS,
        "request_timeout_seconds": 120,
    }
    return JudgeOptions(**(fields | changes))


async def score(stub: reward_pb2_grpc.RewardServiceStub, response: str) -> reward_pb2.ScoringResult:
    item = reward_pb2.ScoringInput(data_source="judged", response_text=response)
    return (await stub.Score(reward_pb2.ScoreRequest(input=item), timeout=180)).result


def metric(metrics: RewardMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def code_model_and_system_turn() -> tuple[str, str]:
    """The code example's model folder, and its system turn as it was trained: the task's
    prompt and the `python` tool's schema, rendered by the model's own chat template."""
    settings = load_project_config(REPO_ROOT / "examples" / "code" / "config.yaml").tiny_model
    model_dir = build_tiny_model(settings=settings)  # shipped: returns at once
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": code_problems.SYSTEM_PROMPT}],
        tools=task_tools(settings),
        tokenize=False,
    )
    opening, closing = "<|im_start|>system\n", "<|im_end|>\n"
    assert rendered.startswith(opening) and rendered.endswith(closing), rendered
    return str(model_dir), rendered[len(opening) : -len(closing)]


async def test_judge_on_a_rollout_service_scores_the_models_verdict():
    model_dir, system_turn = code_model_and_system_turn()
    problem = code_problems.generate_problems(1, split="test")[0]
    recorders: list[GenerateRecorder] = []
    async with rollout_service_address(model_dir, recording(recorders)) as address:
        judge = rollout_judge(
            address, system_prompt=system_turn, parse="boxed", max_score=1000, temperature=0.0
        )
        async with reward_service_with(judge) as (stub, metrics):
            result = await score(stub, problem.question)
        # The same prompt, asked of the same service directly: the text the judge must have read.
        [sent] = recorders[0].requests
        async with rpc.open_channel(ClientConfig(address=address)) as channel:
            direct = rollout_pb2_grpc.RolloutServiceStub(channel).Generate(sent, timeout=120)
            [expected] = [reply.trajectory async for reply in direct]
    expected_text = expected.messages[-1].content[0].text
    extras = json_format.MessageToDict(result.reward.extras)
    assert result.scorer == "judge:turnrl-judge" and not result.reward.error
    assert extras["raw"] == [expected_text]
    assert expected_text.startswith("\\boxed{"), expected_text  # the model's guess
    assert extras["parsed"] == 1 and "error" not in extras
    assert result.reward.score == pytest.approx(parse_boxed(expected_text, 1000))
    assert metric(metrics, "turnrl_reward_judge_no_verdict_total", scorer="judge:turnrl-judge") == 0
    # What the judge asked: its system turn and the rubric, one greedy turn, no tools, no scoring.
    assert [m.role for m in sent.prompts[0].messages] == [
        common_pb2.Message.ROLE_SYSTEM,
        common_pb2.Message.ROLE_USER,
    ]
    assert sent.prompts[0].messages[1].content[0].text == problem.question
    assert not sent.prompts[0].tool_names and not sent.enable_scoring
    assert (sent.n, sent.max_turns, sent.sampling.temperature) == (1, 1, 0.0)
    assert sent.limits.max_new_tokens == JUDGE_MAX_TOKENS


async def test_verdict_less_samples_from_a_rollout_service_are_counted(tiny_model_dir):
    recorders: list[GenerateRecorder] = []
    async with rollout_service_address(tiny_model_dir, recording(recorders)) as address:
        judge = rollout_judge(
            address,
            rubric="Grade this answer: {response}\nEnd with 'Score: N/10'.",
            samples=3,
            temperature=1.0,
            default_score=-1.0,
            max_tokens=16,
        )
        async with reward_service_with(judge) as (stub, metrics):
            result = await score(stub, "The answer is 72.")
    [sent] = recorders[0].requests  # k samples are one request with n = k
    assert (sent.n, sent.max_turns, sent.sampling.temperature) == (3, 1, 1.0)
    extras = json_format.MessageToDict(result.reward.extras)
    # The calculator model cannot grade: a score, default_score, the model's; said and counted.
    assert result.reward.score == -1.0 and not result.reward.error
    assert extras["error"] == "none of the judge's 3 answers held a verdict"
    assert len(extras["raw"]) == 3 and extras["parsed"] == 0
    assert metric(metrics, "turnrl_reward_judge_no_verdict_total", scorer="judge:turnrl-judge") == 1
    assert metric(metrics, "turnrl_reward_items_total", scorer="judge:turnrl-judge") == 1


async def test_rollout_service_down_is_the_systems_failure_not_a_score():
    with socket.socket() as reserved:  # bound, never listening: connections are refused
        reserved.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{reserved.getsockname()[1]}"
        judge = rollout_judge(address, request_timeout_seconds=5)
        async with reward_service_with(judge) as (stub, metrics):
            result = await score(stub, "The answer is 72.")
    assert result.reward.error and result.failure == Failure.FAILURE_SCORER_UNAVAILABLE
    message = result.reward.error_message
    assert f"judge 'turnrl-judge' at rollout service {address} failed: " in message
    assert "UNAVAILABLE" in message
    scorer = "judge:turnrl-judge"
    assert (
        metric(metrics, "turnrl_reward_errors_total", scorer=scorer, kind="SCORER_UNAVAILABLE") == 1
    )
    assert metric(metrics, "turnrl_reward_judge_no_verdict_total", scorer=scorer) == 0


async def test_an_error_status_or_an_aborted_judge_trajectory_is_unavailable(tiny_model_dir):
    async with (
        rollout_service_address(tiny_model_dir) as address,
        rpc.open_channel(ClientConfig(address=address)) as channel,
    ):
        rollout = rollout_pb2_grpc.RolloutServiceStub(channel)
        # A turn longer than the rollout service's context: it answers INVALID_ARGUMENT.
        too_long = LlmJudge(rollout_judge(address, max_tokens=4096), NoVerdictCount())
        judge = LlmJudge(rollout_judge(address), NoVerdictCount())
        try:
            with pytest.raises(ScorerUnavailableError) as refused:
                await too_long.score(ScoringRequest("judged", "72"))
            # Paused, the engine holds the judge's turn until the abort ends it unwritten.
            await rollout.Pause(rollout_pb2.PauseRequest(), timeout=10)
            scoring = asyncio.create_task(judge.score(ScoringRequest("judged", "72")))
            stats = rollout_pb2.GetStatsRequest()
            async with asyncio.timeout(60):
                while (await rollout.GetStats(stats, timeout=10)).running_trajectories < 1:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            await rollout.Abort(rollout_pb2.AbortRequest(), timeout=10)
            with pytest.raises(ScorerUnavailableError) as aborted:
                await scoring
            await rollout.Resume(rollout_pb2.ResumeRequest(), timeout=10)
        finally:
            await too_long.close()
            await judge.close()
    where = f"judge 'turnrl-judge' at rollout service {address}"
    assert f"{where} failed: " in str(refused.value)
    assert "INVALID_ARGUMENT" in str(refused.value)
    assert "max_response_length 4096 leaves no room for a prompt" in str(refused.value)
    assert f"{where} ended a judge trajectory with ABORTED" in str(aborted.value)
