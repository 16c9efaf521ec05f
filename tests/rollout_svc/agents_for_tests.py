"""Agent functions that tests/rollout_svc/test_agent_runner.py runs in real forked processes,
each by its name ("tests.rollout_svc.agents_for_tests:answer"); each does one thing.

Agents that must tell the test something while they run (their pid, that they started) connect
to the test's beacon, a TCP server on 127.0.0.1 whose port is the prompt's "beacon", and send
one JSON line; `held` then waits for the test's reply before it goes on.
"""

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO


def answer(prompt: dict, base_url: str, api_key: str) -> str:
    print("a line an agent prints is not its result")
    return f"answer to {prompt['question']}"


def reward(prompt: dict, base_url: str, api_key: str) -> float:
    return 0.75


async def async_answer(prompt: dict, base_url: str, api_key: str) -> dict:
    await asyncio.sleep(0)
    return {"answer": f"async answer to {prompt['question']}", "reward": 1}


def raises(prompt: dict, base_url: str, api_key: str) -> str:
    raise ValueError(f"the agent broke on {prompt['question']!r}")


def exits(prompt: dict, base_url: str, api_key: str) -> str:
    print("exiting with code 3", file=sys.stderr, flush=True)
    os._exit(3)


def killed(prompt: dict, base_url: str, api_key: str) -> str:
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


def family(prompt: dict, base_url: str, api_key: str) -> str:
    """Answers with its pid and its parent's (the zygote's)."""
    return f"{os.getpid()} {os.getppid()}"


def returns_list(prompt: dict, base_url: str, api_key: str) -> list:
    return [1, 2]


def returns_object(prompt: dict, base_url: str, api_key: str) -> object:
    return object()


def returns_nothing(prompt: dict, base_url: str, api_key: str) -> None:
    return None


def hangs(prompt: dict, base_url: str, api_key: str) -> str:
    """Starts a grandchild (a sleeping process of its own), reports both pids, and hangs."""
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with _beacon(prompt) as (_, send):
        send({"pid": os.getpid(), "grandchild_pid": grandchild.pid})
        time.sleep(3600)
    return "unreachable"


def escapes(prompt: dict, base_url: str, api_key: str) -> str:
    """Starts a process that leaves the agent's process group (holding its stderr), reports its
    pid and returns."""
    command = [sys.executable, "-c", "import time; time.sleep(3600)"]
    escaped = subprocess.Popen(command, start_new_session=True)
    with _beacon(prompt) as (_, send):
        send({"escaped_pid": escaped.pid})
    return "returned while a process it started runs on"


def held(prompt: dict, base_url: str, api_key: str) -> str:
    """Writes its start time, reports it started, waits for the test's go, writes its end time."""
    times = f"{prompt['times_dir']}/{prompt['index']}"
    with open(f"{times}.start", "w") as f:
        f.write(repr(time.monotonic()))
    with _beacon(prompt) as (reader, send):
        send({"index": prompt["index"], "pid": os.getpid()})
        assert reader.readline().strip() == "go"
    with open(f"{times}.end", "w") as f:
        f.write(repr(time.monotonic()))
    return f"episode {prompt['index']}"


def calls_http(prompt: dict, base_url: str, api_key: str) -> str:
    """Posts a chat completion to `base_url` with `api_key`, as an OpenAI client would."""
    import httpx  # here: the other agents start without it

    response = httpx.post(
        f"{base_url}/chat/completions",
        headers={"Authorization": f"Bearer {api_key}"},
        json={"model": "policy", "messages": [{"role": "user", "content": prompt["question"]}]},
        timeout=30,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


@contextlib.contextmanager
def _beacon(prompt: dict) -> Iterator[tuple[TextIO, Callable[[dict], None]]]:
    """A connection to the test's beacon: yields a line reader and a function sending a JSON
    line."""
    with (
        socket.create_connection(("127.0.0.1", prompt["beacon"]), timeout=60) as connection,
        connection.makefile("rw") as file,
    ):
        connection.settimeout(None)

        def send(message: dict) -> None:
            file.write(json.dumps(message) + "\n")
            file.flush()

        yield file, send


# Agents of tests/rollout_svc/test_agent_episodes.py, which call the policy through their
# episode's gateway session with the real `openai` client.


def _chat(base_url: str, api_key: str):
    import openai  # here: the other agents start without it

    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    return client, client.models.list().data[0].id


def asks_then_rewards(prompt: dict, base_url: str, api_key: str) -> dict:
    """One request, then the reward the agent computed itself."""
    client, model = _chat(base_url, api_key)
    client.chat.completions.create(model=model, messages=prompt["messages"], max_tokens=8)
    return {"reward": 0.25}


def asks_until_refused(prompt: dict, base_url: str, api_key: str) -> str:
    """Asks, answers "Go on." and asks again until the gateway refuses (a limit); raises then."""
    client, model = _chat(base_url, api_key)
    messages = list(prompt["messages"])
    while True:
        reply = client.chat.completions.create(model=model, messages=messages)
        messages += [reply.choices[0].message, {"role": "user", "content": "Go on."}]


def summarises(prompt: dict, base_url: str, api_key: str) -> dict:
    """Asks, then replaces its history by a summary of it and asks again (a new part of the
    session), then goes on from there; rewards itself 0.5."""
    client, model = _chat(base_url, api_key)
    messages = list(prompt["messages"])
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    summary = f"Earlier you said: {first.choices[0].message.content[:24]!r}. Answer again."
    messages = [*messages[:-1], {"role": "user", "content": summary}]
    second = client.chat.completions.create(model=model, messages=messages)
    messages += [second.choices[0].message, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    return {"reward": 0.5}


def asks_across_a_push(prompt: dict, base_url: str, api_key: str) -> dict:
    """Asks, reports to the test's beacon and waits for its go (the test pushes weights
    meanwhile), then asks again; rewards itself 1."""
    client, model = _chat(base_url, api_key)
    messages = list(prompt["messages"])
    first = client.chat.completions.create(model=model, messages=messages)
    with _beacon(prompt["extra_info"]) as (reader, send):
        send({"pid": os.getpid()})
        assert reader.readline().strip() == "go"
    messages += [first.choices[0].message, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    return {"reward": 1.0}


def asks_then_hangs(prompt: dict, base_url: str, api_key: str) -> str:
    """One request, then reports its pid to the test's beacon (the prompt's extra_info) and
    hangs."""
    client, model = _chat(base_url, api_key)
    client.chat.completions.create(model=model, messages=prompt["messages"], max_tokens=8)
    with _beacon(prompt["extra_info"]) as (_, send):
        send({"pid": os.getpid()})
        time.sleep(3600)
    return "unreachable"


def ends_its_session(prompt: dict, base_url: str, api_key: str) -> dict:
    """One request, then tries to end its session itself; returns the HTTP status as reward."""
    import httpx

    client, model = _chat(base_url, api_key)
    client.chat.completions.create(model=model, messages=prompt["messages"], max_tokens=8)
    ended = httpx.post(f"{base_url.removesuffix('/v1')}/end", timeout=30)
    return {"reward": ended.status_code}
