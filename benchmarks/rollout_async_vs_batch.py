"""Request-level vs batch-level multi-turn rollout, and the hf engine against `model.generate`.

Both rollouts run the same calculator word problems through a RolloutService on the same hf
engine (greedy, so both produce the same tokens), calling the real tool service on loopback.
The problems take five or six operations, and the engine runs a tiny calculator model trained
to make one call per operation (built on first use, about 4 minutes, then cached), so a
trajectory has five or six tool rounds, as an agent's often do. The calculator first waits a
heavy-tailed time: lognormal, median 50 ms, p99 1 s, the same wait for the same (prompt, call)
in both modes.

(a) batch level, what verl's original rollout did: every trajectory generates its turn, then
    all the batch's tool calls run, then the next turn. It is the same RolloutService with a
    barrier before and after every generate call, so a turn starts when the batch's slowest
    tool call has answered and tool calls start when the batch's longest turn has ended.
(b) request level: RolloutService as it is, every trajectory its own task.

The ideal bound is max(no tool wait, longest trajectory), both measured apart from (b): no
tool wait is (b) on the same problems with the calculator answering at once (the engine's and
the agent loop's own time for the same tokens, with no wait left to hide; (b)'s own engine
busy time is reported but not used, since it grows when the engine is slowed in (b) and would
lift the efficiency it judges); the longest trajectory is the slowest (by its tool waits) of
the batch, rerun alone (timed inside (b) it would span all of (b), as every trajectory starts
at once). Efficiency is that bound over the wall time of (b); the tool-wait ceiling is
the speedup an infinitely fast engine would give: the sum over rounds of each round's slowest
wait, over the largest sum of one trajectory's waits.

The service's cost: the no-tool-wait run's model turns are sent to the same engine again
directly, each with the tokens before it, all trajectories at once (`direct_engine.replay`);
the service's wall time over the engine's alone is what the agent loop, chat template,
parsing, tool calls and trajectory records add. Tokens/s is the model tokens of a rollout over
the no-tool-wait run's wall time (through the service) and over the replay's (direct). With
the hf engine, its tokens/s is also compared with `model.generate` on one batch of prompts,
every row decoding `--decode-tokens` tokens (EOS is switched off for both).

    .venv/bin/python benchmarks/rollout_async_vs_batch.py [--prompts 64] [--draws 5]  # ~1.5 min

With `--engine vllm` the rollouts run on a vLLM server of the same model that the engine
launches from `--engine-python` (vLLM's environment, `make engine-env ENGINE=vllm`; the CPU
build here, float32, 1 GiB of KV cache); with `--engine sglang` (a GPU) on an SGLang server.
Both leave the decode comparison out.

    .venv/bin/python benchmarks/rollout_async_vs_batch.py --engine vllm \
      --engine-python .venv-vllm/bin/python

The last line printed is one JSON object with the headline figures.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import shlex
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

import smoke_mode
import torch
from clocked_engines import BatchLevelEngine, ClockedEngine
from direct_engine import decode_speed, replay
from pydantic import Field
from transformers import AutoTokenizer

from rollout_svc.agent_loop import AgentLoop, PromptSpec, RolloutLimits
from rollout_svc.config import RolloutConfig
from rollout_svc.engines.base import Engine, SamplingParams
from rollout_svc.engines.hf import HfEngine, HfEngineOptions
from rollout_svc.engines.server_process import LaunchOptions
from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions
from rollout_svc.engines.vllm import VllmEngine, VllmEngineOptions
from rollout_svc.parsers import PARSERS
from rollout_svc.service import RolloutService
from rollout_svc.tool_client import ToolClient
from rollout_svc.tool_schemas import ToolSchemas
from tool_svc.config import ToolConfig, ToolLimits
from tool_svc.server import ToolServicer
from tool_svc.service import ToolService
from tool_svc.tools.base import ToolResult
from tool_svc.tools.calculator import CalculatorOptions, CalculatorTool
from turnrl import rpc
from turnrl.calculator_data import TOOLS, ProblemSettings, generate_problems
from turnrl.chat_tokens import ConversationTokens
from turnrl.config import ClientConfig, HttpJsonServerConfig
from turnrl.trajectory import Trajectory
from turnrl.v1 import tool_pb2, tool_pb2_grpc
from turnrl_demo.settings import TinyModelSettings
from turnrl_demo.tiny_model import build_tiny_model

TOOL_NAME = "calculator"
MEDIAN_TOOL_SECONDS = 0.05
P99_TOOL_SECONDS = 1.0
# The p99 of a lognormal is its median times exp(2.326 * sigma).
TOOL_SIGMA = math.log(P99_TOOL_SECONDS / MEDIAN_TOOL_SECONDS) / 2.326
MODEL_SETTINGS = TinyModelSettings(
    problems=ProblemSettings(min_operations=2, max_operations=6, one_call_per_operation=True)
)
PROBLEMS = ProblemSettings(min_operations=5, max_operations=6, one_call_per_operation=True)
# The engine's context, and so the rollouts' max_model_len.
MAX_MODEL_LEN = 2048


class SlowCalculatorOptions(CalculatorOptions):
    """The calculator's bounds, and the lognormal wait before each answer."""

    median_seconds: float = Field(default=MEDIAN_TOOL_SECONDS, gt=0, description="Median wait.")
    sigma: float = Field(default=TOOL_SIGMA, ge=0, description="Sigma of the log of the wait.")
    seed: int = Field(default=0, description="Seeds the waits.")


def tool_wait_seconds(options: SlowCalculatorOptions, latency_key: str, call_index: int) -> float:
    """The wait of a trajectory's `call_index`-th call: fixed by the seed, key and index."""
    draw = random.Random(f"{options.seed}/{latency_key}/{call_index}").gauss(0.0, 1.0)
    return options.median_seconds * math.exp(options.sigma * draw)


class SlowCalculator(CalculatorTool):
    """The calculator behind a heavy-tailed wait, as a remote tool would be. A session (one
    per trajectory, opened with `latency_key`) counts its calls, so the k-th call of a
    trajectory waits the same in every run."""

    Options = SlowCalculatorOptions
    requires_session: ClassVar[bool] = True

    async def create(self, **session_kwargs: Any) -> dict[str, Any]:
        # Without a latency_key the calculator answers at once (the engine-bound run).
        return {"latency_key": session_kwargs.get("latency_key"), "calls": 0}

    async def execute(self, session: dict[str, Any], args: dict[str, Any]) -> ToolResult:
        if session["latency_key"] is not None:
            wait = tool_wait_seconds(self.options, session["latency_key"], session["calls"])
            await asyncio.sleep(wait)
        session["calls"] += 1
        return await super().execute(session, args)


@contextlib.asynccontextmanager
async def slow_tool_service() -> AsyncIterator[tuple[str, SlowCalculatorOptions]]:
    """The tool service on loopback, serving only the slow calculator, without a concurrency
    limit (the waits stand for remote work); yields its address and the tool's options."""
    config = ToolConfig(server=HttpJsonServerConfig(port=0), tools=[])
    options = SlowCalculatorOptions()
    service = ToolService(
        config,
        {TOOL_NAME: SlowCalculator(TOOL_NAME, options)},
        {TOOL_NAME: ToolLimits(max_concurrency=0)},
    )
    running = await rpc.start_server(
        config.server,
        tool_pb2.DESCRIPTOR.services_by_name["ToolService"],
        lambda server: tool_pb2_grpc.add_ToolServiceServicer_to_server(
            ToolServicer(service), server
        ),
    )
    try:
        yield f"127.0.0.1:{running.port}", options
    finally:
        await running.server.stop(None)
        await service.close()


def calculator_prompts(count: int, draw: int | None) -> list[PromptSpec]:
    """The first `count` test problems; `draw` picks which tool waits their calls get (None:
    the calculator answers at once)."""
    return [
        PromptSpec(
            prompt_id=f"p{index}",
            messages=problem.prompt_messages,
            tool_names=[TOOL_NAME],
            tools_kwargs={
                TOOL_NAME: {
                    "create_kwargs": {} if draw is None else {"latency_key": f"{draw}/p{index}"}
                }
            },
            data_source="openai/gsm8k",
        )
        for index, problem in enumerate(generate_problems(count, split="test", settings=PROBLEMS))
    ]


@dataclass(frozen=True)
class Rollouts:
    """What both modes share: the engine, tokenizer, tool service, sampling and limits."""

    engine: Engine
    tokenizer: Any
    tool_client: ToolClient
    tool_options: SlowCalculatorOptions
    sampling: SamplingParams
    limits: RolloutLimits

    def service(self, engine: ClockedEngine, size: int) -> RolloutService:
        """RolloutService on `engine`; scoring stays off, so it needs no reward service."""
        loop = AgentLoop(
            engine=engine,
            tokenizer=self.tokenizer,
            chat_template=None,
            parser=PARSERS["hermes"],
            tool_client=self.tool_client,
            reward_replicas=None,
            interactions={},
            tool_call_timeout_seconds=60.0,
            reward_timeout_seconds=60.0,
        )
        config = RolloutConfig(max_concurrent_trajectories=size)
        return RolloutService(config, engine, loop, ToolSchemas(self.tool_client))

    async def run(
        self, service: RolloutService, prompts: list[PromptSpec]
    ) -> tuple[float, list[Trajectory]]:
        """Rolls out every prompt once: (wall seconds, trajectories)."""
        started = time.perf_counter()
        generating = service.generate(prompts, 1, self.sampling, self.limits, enable_scoring=False)
        trajectories = [trajectory async for trajectory in generating]
        return time.perf_counter() - started, trajectories

    async def compare_modes(self, prompts: list[PromptSpec], alone: int) -> dict[str, Any]:
        """One draw of tool waits: (a), then (b), then (b) with the calculator answering at
        once, then (b)'s slowest trajectories alone."""
        batch_engine = BatchLevelEngine(self.engine, len(prompts))
        batch = await self.run(self.service(batch_engine, len(prompts)), prompts)
        request_engine = ClockedEngine(self.engine)
        request_service = self.service(request_engine, len(prompts))
        request = await self.run(request_service, prompts)
        request_busy_seconds = request_engine.busy_seconds
        # The bound's engine part, measured apart from the run it bounds: the same work with
        # no tool wait to hide. (b)'s own busy time would grow with any slowdown of the
        # engine in (b), and raise the efficiency it is meant to judge.
        no_waits = calculator_prompts(len(prompts), None)
        no_wait = await self.run(self.service(ClockedEngine(self.engine), len(prompts)), no_waits)
        direct_seconds, direct_same_tokens = await replay(self.engine, no_wait[1])
        by_id = {prompt.prompt_id: prompt for prompt in prompts}
        waits = {t.group_id: self._drawn_waits(t, by_id[t.group_id]) for t in request[1]}
        # Tool waits only: (a) waits for each round's slowest call, (b) for the trajectory
        # whose waits add up to most. Their ratio caps the speedup of an infinitely fast engine.
        rounds = max(len(w) for w in waits.values())
        batch_wait = sum(max(w[k] for w in waits.values() if len(w) > k) for k in range(rounds))
        request_wait = max(sum(w) for w in waits.values())
        slowest = sorted(waits, key=lambda prompt_id: sum(waits[prompt_id]), reverse=True)
        alone_seconds = [
            (await self.run(request_service, [by_id[prompt_id]]))[0]
            for prompt_id in slowest[:alone]
        ]
        return {
            "batch_level_seconds": batch[0],
            "request_level_seconds": request[0],
            "engine_busy_batch_level_seconds": batch_engine.busy_seconds,
            "engine_busy_request_level_seconds": request_busy_seconds,
            "no_tool_wait_seconds": no_wait[0],
            "direct_engine_seconds": direct_seconds,
            "direct_same_tokens": direct_same_tokens,
            "longest_trajectory_alone_seconds": max(alone_seconds),
            "tool_wait_speedup_ceiling": batch_wait / request_wait,
            "tool_calls": sum(t.metrics["tool_calls"] for t in request[1]),
            "model_tokens": sum(t.metrics["model_tokens"] for t in request[1]),
            "same_tokens": _token_ids(batch[1]) == _token_ids(request[1]) == _token_ids(no_wait[1]),
        }

    def _drawn_waits(self, trajectory: Trajectory, prompt: PromptSpec) -> list[float]:
        """The waits the trajectory's tool calls drew, in order: one per round, as the tiny
        model makes one call per turn."""
        latency_key = prompt.tools_kwargs[TOOL_NAME]["create_kwargs"]["latency_key"]
        calls = int(trajectory.metrics["tool_calls"])
        return [tool_wait_seconds(self.tool_options, latency_key, i) for i in range(calls)]


def _token_ids(trajectories: list[Trajectory]) -> dict[str, list[int]]:
    return {
        t.trajectory_id: [token for segment in t.segments for token in segment.token_ids]
        for t in trajectories
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="trajectories per rollout")
    parser.add_argument("--max-turns", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens of one turn")
    parser.add_argument(
        "--draws", type=int, default=5, help="tool-wait draws, each run in both modes"
    )
    parser.add_argument("--alone", type=int, default=3, help="slowest trajectories rerun alone")
    parser.add_argument("--decode-prompts", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--decode-repeats", type=int, default=5)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--engine",
        choices=["hf", "vllm", "sglang"],
        default="hf",
        help="vllm, sglang: the rollouts on a vLLM (CPU here) or SGLang (a GPU) server the "
        "engine launches from --engine-python, with no decode comparison",
    )
    parser.add_argument(
        "--engine-python",
        default=sys.executable,
        help="the interpreter of the engine's environment (make engine-env)",
    )
    parser.add_argument("--sglang-args", default="--dtype bfloat16 --disable-cuda-graph")
    parser.add_argument("--vllm-args", default="--dtype float32")
    parser.add_argument(
        "--model",
        choices=["multi-call", "demo"],
        default="multi-call",
        help="multi-call: trained to call once per operation (built on first use); demo: the "
        "shipped demo model, which calls once and answers (for --smoke)",
    )
    smoke = {"prompts": 4, "draws": 1, "alone": 1, "max_turns": 3, "max_new_tokens": 32}
    smoke |= {"decode_prompts": 2, "decode_tokens": 4, "decode_repeats": 1, "model": "demo"}
    args = smoke_mode.parse_args(parser, smoke)
    logging.basicConfig(level=logging.WARNING)
    # The tiny model runs fastest on one thread, which leaves the other core to the event loop.
    torch.set_num_threads(args.torch_threads)
    settings = MODEL_SETTINGS if args.model == "multi-call" else TinyModelSettings()
    model_path = str(await asyncio.to_thread(build_tiny_model, settings=settings))
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_path)
    engine = await start_engine(args, model_path)
    draws = []
    try:
        async with slow_tool_service() as (tool_address, tool_options):
            rollouts = Rollouts(
                engine=engine,
                tokenizer=tokenizer,
                tool_client=ToolClient(ClientConfig(address=tool_address)),
                tool_options=tool_options,
                sampling=SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0),
                limits=RolloutLimits(
                    max_model_len=MAX_MODEL_LEN,
                    max_response_length=2 * args.max_turns * args.max_new_tokens,
                    max_new_tokens=args.max_new_tokens,
                    max_turns=args.max_turns,
                ),
            )
            try:
                # Warm-up: the first forward passes and chat-template renders are slow.
                await rollouts.run(
                    rollouts.service(ClockedEngine(engine), 1), calculator_prompts(1, -1)
                )
                for draw in range(args.draws):
                    prompts = calculator_prompts(args.prompts, draw)
                    draws.append(await rollouts.compare_modes(prompts, args.alone))
            finally:
                await rollouts.tool_client.close()
    finally:
        await engine.close()
    if args.engine != "hf":  # the decode comparison is the hf engine's
        print_report(args, draws, {})
        return
    decode_prompts = await asyncio.to_thread(
        lambda: [
            ConversationTokens(tokenizer, None, TOOLS).prompt_ids(prompt.messages)
            for prompt in calculator_prompts(args.decode_prompts, 0)
        ]
    )
    decode = await decode_speed(
        model_path,
        MAX_MODEL_LEN,
        decode_prompts,
        tokenizer.pad_token_id,
        args.decode_tokens,
        args.decode_repeats,
    )
    print_report(args, draws, decode)


async def start_engine(args: argparse.Namespace, model_path: str) -> Engine:
    """The hf engine, batching every trajectory, or a vLLM or SGLang server of the model."""
    if args.engine == "hf":
        options = HfEngineOptions(max_batch_size=args.prompts)
        return await HfEngine.create(options, model_path, MAX_MODEL_LEN)
    if args.engine == "vllm":
        launch = LaunchOptions(
            port=0, python=args.engine_python, extra_args=tuple(shlex.split(args.vllm_args))
        )
        options = VllmEngineOptions(launch=launch, cpu_kv_cache_space_gib=1)
        return await VllmEngine.create(options, model_path, MAX_MODEL_LEN)
    launch = LaunchOptions(
        port=0,
        python=args.engine_python,
        extra_args=tuple(shlex.split(args.sglang_args)),
    )
    options = SglangEngineOptions(launch=launch, startup_timeout_seconds=900)
    return await SglangEngine.create(options, model_path, MAX_MODEL_LEN)


def print_report(args: argparse.Namespace, draws: list[dict], decode: dict[str, float]) -> None:
    """A row per draw, then the figures over all draws; the last line is the JSON summary."""

    def bound(draw: dict) -> float:
        return max(draw["no_tool_wait_seconds"], draw["longest_trajectory_alone_seconds"])

    def mean(name: str) -> float:
        return sum(draw[name] for draw in draws) / len(draws)

    print(
        f"{args.prompts} trajectories, max_turns {args.max_turns}; tool waits lognormal, median "
        f"{MEDIAN_TOOL_SECONDS * 1000:.0f} ms, p99 {P99_TOOL_SECONDS:.1f} s; seconds per rollout"
    )
    columns = "(a) (b) speedup busy(a) busy(b) no-wait alone bound effic. ceiling"
    print("draw" + "".join(f"{column:>10}" for column in columns.split()))
    speedups, efficiencies = [], []
    for index, draw in enumerate(draws):
        speedups.append(draw["batch_level_seconds"] / draw["request_level_seconds"])
        efficiencies.append(bound(draw) / draw["request_level_seconds"])
        row = (
            draw["batch_level_seconds"],
            draw["request_level_seconds"],
            speedups[-1],
            draw["engine_busy_batch_level_seconds"],
            draw["engine_busy_request_level_seconds"],
            draw["no_tool_wait_seconds"],
            draw["longest_trajectory_alone_seconds"],
            bound(draw),
            efficiencies[-1],
            draw["tool_wait_speedup_ceiling"],
        )
        print(f"{index:>4}" + "".join(f"{value:>10.2f}" for value in row))
    request_seconds = mean("request_level_seconds")
    model_tokens = mean("model_tokens")
    figures = {
        "engine": args.engine,
        "speedup": mean("batch_level_seconds") / request_seconds,
        "efficiency_vs_bound": sum(map(bound, draws)) / len(draws) / request_seconds,
        "batch_level_seconds": mean("batch_level_seconds"),
        "request_level_seconds": request_seconds,
        "speedup_range": [min(speedups), max(speedups)],
        "efficiency_range": [min(efficiencies), max(efficiencies)],
        "engine_busy_batch_level_seconds": mean("engine_busy_batch_level_seconds"),
        "engine_busy_request_level_seconds": mean("engine_busy_request_level_seconds"),
        "no_tool_wait_seconds": mean("no_tool_wait_seconds"),
        "longest_trajectory_alone_seconds": mean("longest_trajectory_alone_seconds"),
        "tool_wait_speedup_ceiling": mean("tool_wait_speedup_ceiling"),
        "rollout_tokens_per_s": model_tokens / mean("no_tool_wait_seconds"),
        "direct_tokens_per_s": model_tokens / mean("direct_engine_seconds"),
        "service_cost": mean("no_tool_wait_seconds") / mean("direct_engine_seconds"),
        "direct_same_tokens": all(draw["direct_same_tokens"] for draw in draws),
        "tool_calls_per_rollout": mean("tool_calls"),
        "model_tokens_per_rollout": model_tokens,
        "same_tokens_both_modes": all(draw["same_tokens"] for draw in draws),
        **decode,
    }
    print(
        f"all draws: speedup {figures['speedup']:.2f}x, efficiency vs bound "
        f"{figures['efficiency_vs_bound']:.2f}, same tokens in both modes "
        f"{figures['same_tokens_both_modes']}"
    )
    print(
        f"{args.engine} engine, no tool wait: {figures['rollout_tokens_per_s']:.0f} tokens/s "
        f"through the service, {figures['direct_tokens_per_s']:.0f} tokens/s driven directly "
        f"(service cost {figures['service_cost']:.2f}x, same tokens "
        f"{figures['direct_same_tokens']})"
    )
    if decode:
        print(
            f"decode, {args.decode_prompts} rows x {args.decode_tokens} tokens: hf engine "
            f"{decode['hf_engine_tokens_per_s']:.0f} tokens/s, model.generate "
            f"{decode['model_generate_tokens_per_s']:.0f} tokens/s"
        )
    print(json.dumps({name: _rounded(value) for name, value in figures.items()}))


def _rounded(value: Any) -> Any:
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return round(value, 4) if isinstance(value, float) else value


if __name__ == "__main__":
    asyncio.run(main())
