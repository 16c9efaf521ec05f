"""The OpenAI-compatible gateway end to end: a real rollout service on the tiny calculator model
with its gateway on a free loopback port, driven by the real `openai` client."""

import asyncio
import contextlib
import itertools
import json
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_svc.config import GatewayConfig, RolloutConfig
from rollout_svc.gateway.app import serve_gateway
from rollout_svc.server import RolloutServicer
from rollout_svc.service import RolloutService
from tests.conftest import STARTUP_TIMEOUT_SECONDS, kill_tree, serve_in_process, spawn_turnrl
from tests.rollout_svc.test_rollout_service import teacher_forced_logprobs
from tool_svc.tools.calculator import CalculatorOptions, CalculatorTool, format_value
from turnrl.asgi_server import listening_socket
from turnrl.calculator_data import TOOLS, generate_problems
from turnrl.chat_tokens import ConversationTokens
from turnrl.config import ClientConfig, ServerConfig
from turnrl.v1 import rollout_pb2, rollout_pb2_grpc

# Nothing listens here: the gateway never calls the tool or reward service.
UNUSED_ADDRESS = "127.0.0.1:9"
MAX_TURNS = 5


@dataclass
class Gateway:
    """A served gateway: its rollout service, its base URL, and the clients the test opened."""

    service: RolloutService
    url: str
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    def client(self, session_id: str, api_key: str = "unused", **options) -> openai.AsyncOpenAI:
        """The real `openai` client on a session's base URL (with `options`, as
        `http_client`), closed with the gateway."""
        chat = openai.AsyncOpenAI(
            base_url=f"{self.url}/sessions/{session_id}/v1",
            api_key=api_key,
            max_retries=0,
            **options,
        )
        self.clients.append(chat)
        return chat


@contextlib.asynccontextmanager
async def gateway_server(
    model_dir, server: ServerConfig | None = None, **gateway_settings
) -> AsyncIterator[Gateway]:
    """A rollout service (gRPC on a free port, or as `server` says) with its gateway on
    another."""
    config = RolloutConfig(
        server=server or ServerConfig(port=0),
        model_path=str(model_dir),
        tool_service=ClientConfig(address=UNUSED_ADDRESS),
        reward_service=ClientConfig(address=UNUSED_ADDRESS),
        gateway=GatewayConfig(enabled=True, port=0, **gateway_settings),
    )
    service = await RolloutService.create(config)
    try:
        # The gateway first, as rollout_svc.server.serve starts them.
        async with (
            serve_gateway(config.gateway, config.server, service.chat_sessions) as url,
            serve_in_process(
                config.server,
                rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"],
                lambda s: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(
                    RolloutServicer(service), s
                ),
            ),
        ):
            gateway = Gateway(service, url)
            try:
                yield gateway
            finally:
                for chat in gateway.clients:
                    await chat.close()
    finally:
        await service.close()


async def end_session(url: str, session_id: str) -> dict:
    async with httpx.AsyncClient() as http:
        reply = await http.post(f"{url}/sessions/{session_id}/end", timeout=30)
    reply.raise_for_status()
    return reply.json()


def calculate(expression: str) -> str:
    return format_value(CalculatorTool("calculator", CalculatorOptions()).evaluate(expression))


def prompt_messages() -> list[dict]:
    return generate_problems(1, split="test")[0].prompt_messages


async def test_a_plain_completion(tiny_model_dir):
    async with gateway_server(tiny_model_dir) as gateway:
        service, url = gateway.service, gateway.url
        chat = gateway.client("plain")
        model = service.chat_sessions.model_name
        assert [m.id for m in (await chat.models.list()).data] == [model]
        reply = await chat.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is 2 + 3?"}],
            temperature=0,
            max_tokens=16,
            logprobs=True,
        )
        trajectory = await end_session(url, "plain")
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.model == model and reply.created > 0
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    model_ids = [
        i for s in trajectory["segments"] if s["source"] == "model" for i in s["token_ids"]
    ]
    assert reply.usage.completion_tokens == len(model_ids) <= 16
    assert reply.usage.prompt_tokens == len(trajectory["segments"][0]["token_ids"])
    stop_left_out = choice.finish_reason == "stop"
    assert len(choice.logprobs.content) == len(model_ids) - stop_left_out
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [lp for s in trajectory["segments"] for lp in s["logprobs"]][: len(choice.logprobs.content)]
    )


async def test_a_calculator_session_is_token_exact(tiny_model_dir):
    """The tiny model calls the calculator, reads each result and answers; the session's
    trajectory holds the model's own ids, the delta rule's ids for the rest, and logprobs that
    a teacher-forced pass of the model reproduces."""
    messages: list = prompt_messages()
    replies = []
    async with gateway_server(tiny_model_dir) as gateway:
        service, url = gateway.service, gateway.url
        chat = gateway.client("calc")
        model = service.chat_sessions.model_name
        for _ in range(MAX_TURNS):
            reply = await chat.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, temperature=0
            )
            replies.append(reply)
            message = reply.choices[0].message
            messages.append(message)  # as agents do: the SDK's object, sent back
            if reply.choices[0].finish_reason != "tool_calls":
                break
            for call in message.tool_calls:
                assert call.type == "function" and call.function.name == "calculator"
                expression = json.loads(call.function.arguments)["expression"]
                result = calculate(expression)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        trajectory = await end_session(url, "calc")
    assert replies[0].choices[0].finish_reason == "tool_calls"
    assert replies[-1].choices[0].finish_reason == "stop"
    assert "####" in replies[-1].choices[0].message.content
    sources = [s["source"] for s in trajectory["segments"]]
    assert sources == ["prompt", "model", *["tool", "template", "model"] * (len(replies) - 1)]
    # What the agent loop's ConversationTokens makes of this conversation with the model's ids.
    turns = [s["token_ids"] for s in trajectory["segments"] if s["source"] == "model"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = ConversationTokens(tokenizer, None, TOOLS)
    expected = tokens.prompt_ids(prompt_messages())
    later = messages[len(prompt_messages()) :]
    for turn_ids, reply in zip(turns, replies, strict=True):
        assistant = reply.choices[0].message.model_dump(exclude_none=True)
        tokens.append_model_turn(turn_ids, {**assistant, "content": assistant.get("content", "")})
        expected += turn_ids
        later = later[1:]
        results = [m for m in itertools.takewhile(lambda m: isinstance(m, dict), later)]
        later = later[len(results) :]
        if results:
            expected += tokens.append_messages(results)
    assert trajectory["token_ids"] == expected
    assert trajectory["loss_mask"] == [
        s["source"] == "model" for s in trajectory["segments"] for _ in s["token_ids"]
    ]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    forced = teacher_forced_logprobs(model, expected)
    positions = [i - 1 for i, in_loss in enumerate(trajectory["loss_mask"]) if in_loss]
    engine = torch.tensor([lp for s in trajectory["segments"] for lp in s["logprobs"]])
    assert torch.allclose(engine, forced[positions], atol=1e-5)
    assert trajectory["policy_versions"] == [0] * len(replies)
    assert trajectory["finish_reason"] == "stop"


async def test_a_rewritten_history_starts_a_new_part(tiny_model_dir):
    """An agent that truncates its history mid-session: the session goes on in a new part whose
    prompt is the truncated messages rendered afresh, the first part kept as it ran; each
    part's logprobs are the model's over that part alone (the context it sampled in), and the
    part goes on by the prefix rule like any session."""
    messages = prompt_messages()
    request = {"tools": TOOLS, "temperature": 0, "max_tokens": 24}
    async with gateway_server(tiny_model_dir) as gateway:
        service, url = gateway.service, gateway.url
        chat = gateway.client("truncated")
        model = service.chat_sessions.model_name
        first = await chat.chat.completions.create(model=model, messages=messages, **request)
        # The agent drops the system prompt and its first answer, and asks anew.
        truncated = [{"role": "user", "content": messages[-1]["content"] + " Be brief."}]
        second = await chat.chat.completions.create(model=model, messages=truncated, **request)
        answer = second.choices[0].message
        follow = [*truncated, answer, {"role": "user", "content": "Sure?"}]
        await chat.chat.completions.create(model=model, messages=follow, **request)
        fresh = await gateway.client("fresh").chat.completions.create(
            model=model, messages=truncated, **request
        )
        trajectory = await end_session(url, "truncated")
    assert first.choices[0].finish_reason == "tool_calls"
    assert second.choices[0].finish_reason == "stop"  # so the part can go on
    assert second.choices[0].message == fresh.choices[0].message  # as a session of its own
    sources = [s["source"] for s in trajectory["segments"]]
    assert sources == ["prompt", "model", "prompt", "model", "user", "template", "model"]
    assert trajectory["metrics"]["parts"] == 2
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    segments = trajectory["segments"]
    assert segments[2]["token_ids"] == ConversationTokens(tokenizer, None, TOOLS).prompt_ids(
        truncated
    )
    assert segments[0]["token_ids"] == ConversationTokens(tokenizer, None, TOOLS).prompt_ids(
        messages
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for start, end in trajectory["parts"]:
        ids, in_loss = trajectory["token_ids"][start:end], trajectory["loss_mask"][start:end]
        forced = teacher_forced_logprobs(model, ids)
        positions = [i - 1 for i, mask in enumerate(in_loss) if mask]
        engine = torch.tensor(trajectory["logprobs"][start:end])[torch.tensor(in_loss)]
        assert torch.allclose(engine, forced[positions], atol=1e-5)
    assert [m["role"] for m in trajectory["messages"]] == [
        *(m["role"] for m in messages),
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]


async def test_n_choices_and_the_one_the_agent_goes_on_with(tiny_model_dir):
    """A request with n = 3 samples three choices at once; the session goes on with the one
    whose message the agent sends back (here the last), and its trajectory holds that one."""
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    request = {"temperature": 1.0, "seed": 7, "max_tokens": 64}
    async with gateway_server(tiny_model_dir) as gateway:
        service, url = gateway.service, gateway.url
        chat = gateway.client("choices")
        model = service.chat_sessions.model_name
        reply = await chat.chat.completions.create(
            model=model, messages=messages, n=3, logprobs=True, **request
        )
        texts = [choice.message.content for choice in reply.choices]
        chosen = reply.choices[2]
        follow = [*messages, chosen.message, {"role": "user", "content": "Sure?"}]
        await chat.chat.completions.create(model=model, messages=follow, **request)
        trajectory = await end_session(url, "choices")
        # Streamed, the same seeded choices, each under its index.
        streamed: dict[int, str] = {}
        stream = await gateway.client("streamed-choices").chat.completions.create(
            model=model, messages=messages, n=3, stream=True, **request
        )
        async for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + (
                    choice.delta.content or ""
                )
        with pytest.raises(openai.BadRequestError, match="n 0 must be 1 to 128"):
            await gateway.client("none").chat.completions.create(
                model=model, messages=messages, n=0
            )
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    assert len(set(texts)) > 1  # each choice its own seed
    assert [streamed[i] for i in range(3)] == texts
    lengths = [len(choice.logprobs.content) for choice in reply.choices]
    assert reply.usage.completion_tokens == sum(lengths) + sum(
        choice.finish_reason == "stop" for choice in reply.choices
    )  # the stop tokens are not in logprobs.content
    assert trajectory["messages"][1]["content"] == texts[2]
    assert trajectory["metrics"]["turns"] == 2 and trajectory["metrics"]["parts"] == 1
    model_segments = [s for s in trajectory["segments"] if s["source"] == "model"]
    engine_logprobs = [entry.logprob for entry in chosen.logprobs.content]
    assert model_segments[0]["logprobs"][: len(engine_logprobs)] == pytest.approx(engine_logprobs)


async def collect_stream(chat: openai.AsyncOpenAI, **request) -> dict:
    """What a stream gave: content (and its deltas), tool calls (id, name, arguments), finish
    reason, usage, logprobs."""
    got = {"content": "", "deltas": [], "calls": {}, "finish": None, "usage": None, "logprobs": []}
    stream = await chat.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id
        got["usage"] = chunk.usage or got["usage"]
        for choice in chunk.choices:
            got["content"] += choice.delta.content or ""
            got["deltas"] += [choice.delta.content] if choice.delta.content else []
            got["finish"] = choice.finish_reason or got["finish"]
            got["logprobs"] += choice.logprobs.content if choice.logprobs else []
            for delta in choice.delta.tool_calls or []:
                entry = got["calls"].setdefault(delta.index, ["", "", ""])
                entry[0] += delta.id or ""
                entry[1] += delta.function.name or ""
                entry[2] += delta.function.arguments or ""
    assert not chunks[-1].choices and chunks[-1].usage is not None  # the usage chunk comes last
    got["calls"] = [tuple(got["calls"][i]) for i in sorted(got["calls"])]
    return got


async def test_streaming_gives_what_a_plain_request_gives(tiny_model_dir):
    messages = prompt_messages()
    async with gateway_server(tiny_model_dir) as gateway:
        service = gateway.service
        request = {
            "model": service.chat_sessions.model_name,
            "messages": messages,
            "tools": TOOLS,
            "temperature": 0,
            "logprobs": True,
        }
        plain = await gateway.client("plain").chat.completions.create(**request)
        streamed = await collect_stream(gateway.client("streamed"), **request)
        # A session recorded by a stream goes on like any other.
        calls = streamed["calls"]
        message = {"role": "assistant", "content": streamed["content"] or None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls
        ]}  # fmt: skip
        result = {"role": "tool", "tool_call_id": calls[0][0], "content": "7"}
        followed = await gateway.client("streamed").chat.completions.create(
            **{**request, "messages": [*messages, message, result]}
        )
    choice = plain.choices[0]
    assert streamed["finish"] == choice.finish_reason == "tool_calls"
    assert streamed["content"] == (choice.message.content or "")
    assert not any("<tool_call>" in delta for delta in streamed["deltas"])
    assert calls == [
        (c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert streamed["usage"].model_dump() == plain.usage.model_dump()
    assert streamed["logprobs"] == choice.logprobs.content
    assert len(choice.logprobs.content) == plain.usage.completion_tokens - 1  # its stop left out
    assert followed.choices[0].message.content or followed.choices[0].message.tool_calls


async def test_a_streamed_turn_arrives_as_it_is_sampled(tiny_model_dir):
    """Content comes in many deltas, which join into what a plain request of the same seeded
    turn answers."""
    async with gateway_server(tiny_model_dir) as gateway:
        request = {
            "model": gateway.service.chat_sessions.model_name,
            "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            "temperature": 1.0,
            "seed": 3,
            "max_tokens": 40,
        }
        plain = await gateway.client("plain").chat.completions.create(**request)
        streamed = await collect_stream(gateway.client("streamed"), **request)
    assert plain.usage.completion_tokens > 8
    assert len(streamed["deltas"]) > 1
    assert "".join(streamed["deltas"]) == plain.choices[0].message.content


async def test_bad_requests_get_openai_errors(tiny_model_dir):
    messages = prompt_messages()
    settings = {"max_request_bytes": 8192, "history_rewrites": "refuse"}
    async with gateway_server(tiny_model_dir, **settings) as gateway:
        service, url = gateway.service, gateway.url
        model = service.chat_sessions.model_name
        chat = gateway.client("bad")
        with pytest.raises(openai.NotFoundError) as unknown_route:
            await chat.post("/nowhere", cast_to=object, body={})
        assert unknown_route.value.body["type"] == "invalid_request_error"
        with pytest.raises(openai.NotFoundError, match="'gpt-5' is not served here"):
            await chat.chat.completions.create(model="gpt-5", messages=messages)
        with pytest.raises(openai.BadRequestError, match="tool_choice 'required'") as required:
            await chat.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, tool_choice="required"
            )
        assert required.value.param == "tool_choice"
        with pytest.raises(openai.BadRequestError, match="top_logprobs"):
            await chat.chat.completions.create(
                model=model, messages=messages, logprobs=True, top_logprobs=2
            )
        with pytest.raises(openai.APIStatusError) as too_large:
            big = [{"role": "user", "content": "x" * 10_000}]
            await chat.chat.completions.create(model=model, messages=big)
        assert too_large.value.status_code == 413

        first = await chat.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, temperature=0
        )
        answer = first.choices[0].message
        rewritten = {"role": "assistant", "content": "#### 12"}
        with pytest.raises(openai.BadRequestError, match=r"messages\[2\] differs") as history:
            await chat.chat.completions.create(
                model=model,
                messages=[*messages, rewritten, {"role": "user", "content": "ok?"}],
                tools=TOOLS,
            )
        assert history.value.param == "messages.2"
        with pytest.raises(openai.BadRequestError, match="send the whole history back"):
            await chat.chat.completions.create(model=model, messages=messages[:1], tools=TOOLS)
        result = {"role": "tool", "tool_call_id": "call_0_0", "content": "12"}
        with pytest.raises(openai.BadRequestError, match="tools differ"):
            await chat.chat.completions.create(model=model, messages=[*messages, answer, result])

        await end_session(url, "bad")
        with pytest.raises(openai.ConflictError, match="has ended"):
            await chat.chat.completions.create(model=model, messages=messages)
        async with httpx.AsyncClient() as http:
            unknown = await http.post(f"{url}/sessions/never-seen/end")
        assert unknown.status_code == 404
        assert unknown.json()["error"]["type"] == "invalid_request_error"


async def test_tool_choice_stop_and_length_as_openai_defines_them(tiny_model_dir):
    messages = prompt_messages()
    async with gateway_server(tiny_model_dir, max_sessions=3) as gateway:
        service, url = gateway.service, gateway.url
        model = service.chat_sessions.model_name
        request = {"model": model, "messages": messages, "tools": TOOLS, "temperature": 0}
        # "none": the model's text as it wrote it, its call markup included, no tool_calls.
        untouched = await gateway.client("none").chat.completions.create(
            **request, tool_choice="none"
        )
        assert untouched.choices[0].finish_reason == "stop"
        assert untouched.choices[0].message.tool_calls is None
        assert "<tool_call>" in untouched.choices[0].message.content
        # A stop ends the turn before the model's own end, and is left out of the text.
        stopped = await gateway.client("stop").chat.completions.create(**request, stop=["\n"])
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].message.content == "<tool_call>"
        # A turn cut by max_tokens ends "length", and its session cannot go on after it.
        chat = gateway.client("cut")
        cut = await chat.chat.completions.create(**request, max_tokens=3)
        assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
        follow = [*messages, cut.choices[0].message, {"role": "user", "content": "go on"}]
        with pytest.raises(openai.ConflictError, match="not on a stop token"):
            await chat.chat.completions.create(**{**request, "messages": follow})
        with pytest.raises(openai.BadRequestError, match=r"tools\.0\.function\.name") as schema:
            bad_tools = [{"type": "function", "function": {"description": "no name"}}]
            await chat.chat.completions.create(**{**request, "tools": bad_tools})
        assert schema.value.param == "tools.0.function.name"
        # Three sessions are open; a fourth waits until one ends.
        with pytest.raises(openai.RateLimitError, match=r"gateway\.max_sessions"):
            await gateway.client("fourth").chat.completions.create(**request)
        trajectory = await end_session(url, "cut")
        assert trajectory["finish_reason"] == "max_new_tokens"
        await gateway.client("fourth").chat.completions.create(**request)


async def test_a_stop_string_of_several_tokens_ends_the_turn_and_the_session_goes_on(
    tiny_model_dir,
):
    """A ReAct-style stop string (three tokens, the last spelling past it) ends the turn; the
    content stops before it, the trajectory keeps every sampled id, and the template's end of
    the assistant turn, which the model never sampled, opens the next (masked) segment."""
    stop = '"arguments"'  # the model writes ' "', 'arguments', '":'
    messages = prompt_messages()
    async with gateway_server(tiny_model_dir) as gateway:
        service, url = gateway.service, gateway.url
        tokenizer = service.chat_sessions.tokenizer
        request = {
            "model": service.chat_sessions.model_name,
            "tools": TOOLS,
            "tool_choice": "none",
            "temperature": 0,
        }
        chat = gateway.client("react")
        whole = await gateway.client("whole").chat.completions.create(**request, messages=messages)
        reply = await chat.chat.completions.create(
            **request, messages=messages, stop=[stop], logprobs=True
        )
        whole_ids = (await end_session(url, "whole"))["segments"][1]["token_ids"]
        content = whole.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop"
        assert reply.choices[0].message.content == content[: content.index(stop)]
        spelled = "".join(t.token for t in reply.choices[0].logprobs.content)
        assert reply.choices[0].message.content.startswith(spelled) and stop not in spelled
        follow = [
            *messages,
            reply.choices[0].message,
            {"role": "user", "content": "Observation: 42"},
        ]
        with pytest.raises(openai.BadRequestError, match="keeps its stop") as other_stop:
            await chat.chat.completions.create(**request, messages=follow, stop=["Thought:"])
        assert other_stop.value.param == "stop"
        await chat.chat.completions.create(**request, messages=follow, stop=[stop])
        trajectory = await end_session(url, "react")
    segments = trajectory["segments"]
    assert [s["source"] for s in segments] == ["prompt", "model", "user", "template", "model"]
    stop_at = next(i for i in range(len(whole_ids)) if stop in tokenizer.decode(whole_ids[: i + 1]))
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > 1
    assert segments[1]["token_ids"] == whole_ids[: stop_at + 1]  # as sampled, no EOS added
    appended = tokenizer.decode(segments[2]["token_ids"] + segments[3]["token_ids"])
    assert appended == (
        "<|im_end|>\n<|im_start|>user\nObservation: 42<|im_end|>\n<|im_start|>assistant\n"
    )
    assert trajectory["messages"][len(messages)]["content"] == reply.choices[0].message.content


async def test_a_session_takes_one_request_at_a_time(tiny_model_dir):
    """A second request while the first waits in the (paused) engine is refused with 409."""
    messages = prompt_messages()
    async with gateway_server(tiny_model_dir) as gateway:
        service = gateway.service
        model = service.chat_sessions.model_name
        chat = gateway.client("busy")
        await service.pause()
        stream = await chat.chat.completions.create(model=model, messages=messages, stream=True)
        events = aiter(stream)
        await anext(events)  # the role chunk: the request holds the session
        with pytest.raises(openai.ConflictError, match="has a request running"):
            await chat.chat.completions.create(model=model, messages=messages)
        await service.resume()
        rest = [chunk async for chunk in events]
        assert rest[-1].choices[0].finish_reason in ("stop", "length")
        # The session is free again: the same request once more is a retry, not a conflict.
        await chat.chat.completions.create(model=model, messages=messages)


async def test_a_repeated_request_replaces_the_answer_it_repeats(tiny_model_dir):
    """An agent that never received an answer (a timeout) sends the same request again: the
    session keeps only the answer it did receive."""
    messages = prompt_messages()
    async with gateway_server(tiny_model_dir) as gateway:
        service, url = gateway.service, gateway.url
        chat = gateway.client("retry")
        request = {"model": service.chat_sessions.model_name, "messages": messages}
        await chat.chat.completions.create(**request, temperature=1.0, seed=1)
        kept = await chat.chat.completions.create(**request, temperature=1.0, seed=2)
        trajectory = await end_session(url, "retry")
    assert [s["source"] for s in trajectory["segments"]] == ["prompt", "model"]
    assert trajectory["messages"][-1]["content"] == (kept.choices[0].message.content or "")
    assert len(trajectory["messages"]) == len(messages) + 1


async def test_a_stream_the_client_leaves_frees_the_session(tiny_model_dir):
    """A client that goes away mid-stream cancels its request; the session takes the next."""
    messages = prompt_messages()
    async with gateway_server(tiny_model_dir) as gateway:
        service, url = gateway.service, gateway.url
        model = service.chat_sessions.model_name
        chat = gateway.client("left")
        await service.pause()
        stream = await chat.chat.completions.create(model=model, messages=messages, stream=True)
        await anext(aiter(stream))
        await stream.close()
        await service.resume()
        async with asyncio.timeout(30):
            reply = (
                await gateway.client("left")
                .with_options(max_retries=5)
                .chat.completions.create(model=model, messages=messages, temperature=0)
            )
        trajectory = await end_session(url, "left")
    assert [s["source"] for s in trajectory["segments"]] == ["prompt", "model"]
    assert reply.choices[0].message.content == trajectory["messages"][-1]["content"]


async def test_a_stream_left_mid_turn_aborts_it(tiny_model_dir):
    """A client that goes away after the first content delta, while the turn is still in the
    engine, has its engine request aborted; the session takes the next request."""
    messages = prompt_messages()
    async with gateway_server(tiny_model_dir) as gateway:
        service, url = gateway.service, gateway.url
        request = {"model": service.chat_sessions.model_name, "messages": messages}
        stream = await gateway.client("left").chat.completions.create(
            **request, temperature=0, stream=True
        )
        events = aiter(stream)
        await anext(events)  # the role
        assert (await anext(events)).choices[0].delta.content
        await service.pause()
        assert service.stats()["metrics"]["running"] == 1  # the turn goes on after its content
        await stream.close()
        await service.resume()
        async with asyncio.timeout(30):
            reply = (
                await gateway.client("left")
                .with_options(max_retries=5)
                .chat.completions.create(**request, temperature=0)
            )
        assert service.stats()["metrics"]["running"] == 0
        trajectory = await end_session(url, "left")
    assert [s["source"] for s in trajectory["segments"]] == ["prompt", "model"]
    assert reply.choices[0].message.content == trajectory["messages"][-1]["content"]


async def test_turnrl_serve_starts_the_gateway_beside_grpc(tiny_model_dir):
    process = await spawn_turnrl(
        "serve",
        "rollout",
        "--port",
        "0",
        f"rollout.model_path={tiny_model_dir}",
        "rollout.gateway.enabled=true",
    )
    try:
        async with asyncio.timeout(STARTUP_TIMEOUT_SECONDS):
            gateway = (await process.stdout.readline()).decode()
            serving = (await process.stdout.readline()).decode()
        assert gateway.startswith("gateway of RolloutService on http://127.0.0.1:"), gateway
        assert serving.startswith("serving RolloutService on 127.0.0.1:"), serving
        url = gateway.split()[-1]
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as chat:
            listed = await chat.models.list()
        assert [m.id for m in listed.data] == [tiny_model_dir.name]
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            kill_tree(process.pid)
        await process.communicate()


async def test_gateway_connections_send_without_waiting_for_acks():
    """asyncio sets TCP_NODELAY on the gateway's connections (it does only on a socket that
    names IPPROTO_TCP): with Nagle's algorithm on, each reply's second write waited ~40 ms for
    the client's delayed ACK."""
    sock = listening_socket("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    accepted: asyncio.Future[asyncio.BaseTransport] = loop.create_future()

    class Accepting(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.set_result(transport)

    server = await loop.create_server(Accepting, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname())
        connection = (await accepted).get_extra_info("socket")
        assert connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
