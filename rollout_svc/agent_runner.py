"""Runs a user's agent (issue 31: agents written elsewhere, trained unchanged) as a process of
its own for one prompt, and turns how it ended into an `AgentOutcome`.

The caller gives each episode the base URL of its gateway session
(`http://HOST:PORT/sessions/<id>/v1`) and an API key; the agent talks to the policy there and
ends with a result. Each episode runs in a process in a session (process group) of its own, tied
to this process's life, so a user's agent can neither crash nor block the rollout service, and a
timeout or a cancellation kills the agent and every process it started (one that left the group
with setsid escapes, and holds up nothing). At most `max_concurrent` episodes run at once; the
others wait for a slot before their process starts, and `timeout_seconds` counts from then.

The two forms of an agent (`AgentConfig`), both started with OPENAI_BASE_URL and
OPENAI_API_KEY (so `openai.OpenAI()` without arguments reaches the session) and `env` added to
this process's environment (the session's variables win over `env`):
- `callable: "package.module:function"`, called as `function(prompt, base_url, api_key)` (sync,
  or async: run with `asyncio.run`) in a fork of the agent's fork server: one process per
  runner (`python -m rollout_svc.agent_zygote` with this service's interpreter; the package
  must be importable there) that imports the module once, at the first episode, so an episode
  costs a fork instead of a Python start-up and the agent's imports. It is restarted at the
  next episode when it dies, and stopped by `close`. What the agent prints lands in
  `stderr_tail` (rollout_svc/agent_zygote.py has the wire format and what forks share,
  rollout_svc/agent_fork_server.py this side of it).
- `command: [...]`: any program, run as given per episode (rollout_svc/agent_process.py) with
  TURNRL_PROMPT (the prompt as JSON; Linux caps one environment variable at 128 KiB) in its
  environment and no stdin. It prints its result as JSON on the last non-empty line of its
  stdout; earlier lines are ignored.
A result is a str (the final answer), a number (the reward), or an object with "answer" (str)
and/or "reward" (number).

How an episode ends (failure kinds: turnrl/failures.py `AgentFailure`, all of them the
system's: the episode is excluded from the loss and counted, never rewarded 0):
| it ...                                               | answer/reward | failure         |
| returned a result                                    | set           | None            |
| could not be started (command not found, no fork)    | None          | COULD_NOT_START |
| raised (its traceback's last line in error_message;  | None          | RAISED          |
|   a callable's module failing to import, every time) |               |                 |
| exited non-zero, or was killed by a signal; for a    | None          | CRASHED         |
|   callable, also: its fork server died meanwhile     |               |                 |
| ran past `timeout_seconds` (its group is killed)     | None          | TIMED_OUT       |
| printed no result, or one off the contract above     | None          | BAD_RESULT      |
A cancelled `run` (the Generate call aborted) kills the group and raises CancelledError.

The rollout service runs episodes with it in its agent mode (`rollout.agent`:
rollout_svc/agent_episodes.py).
"""

import asyncio
import dataclasses
import json
import math
import os
import time
from typing import Any

from pydantic import Field, model_validator

from rollout_svc.agent_fork_server import AgentForkServer, ForkServerDied
from rollout_svc.agent_process import describe_exit, run_in_group
from turnrl.config import StrictModel
from turnrl.failures import AgentFailure

# The lines of the end of an agent's stderr (rollout_svc/agent_process.py keeps its last
# MAX_OUTPUT_BYTES[2] bytes) kept in `stderr_tail`.
STDERR_TAIL_LINES = 20
_NOT_JSON = object()  # the value of a last stdout line that is not JSON
EXPECTED_RESULT = (
    "a str (the answer), a number (the reward) or an object with 'answer' (str) and/or "
    "'reward' (number)"
)


class AgentConfig(StrictModel):
    """A user's agent and how many of its episodes run at once, for how long."""

    callable: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="'package.module:function', called as function(prompt, base_url, api_key) "
        "in a forked process; returns the answer (str), a reward (number), or a dict with "
        "'answer' and/or 'reward'. Exactly one of `callable` and `command`.",
    )
    command: list[str] | None = Field(
        default=None,
        min_length=1,
        description="Argv of a program run per episode with OPENAI_BASE_URL, OPENAI_API_KEY and "
        "TURNRL_PROMPT (JSON) in its environment; it prints its result as JSON on its last "
        "stdout line. Exactly one of `callable` and `command`.",
    )
    max_concurrent: int = Field(
        default=8, ge=1, description="Episodes running at once; more wait for a slot."
    )
    timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        description="Longest episode, in seconds from its process's start (a callable's: from "
        "its request to the fork server, so the first episodes include the module's import); "
        "past it the agent and the processes it started are killed.",
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables set for the agent's process."
    )

    @model_validator(mode="after")
    def _one_agent(self) -> "AgentConfig":
        if (self.callable is None) == (self.command is None):
            raise ValueError(
                f"set exactly one of `callable` and `command`; got "
                f"callable={self.callable!r}, command={self.command!r}"
            )
        return self


@dataclasses.dataclass(frozen=True)
class AgentOutcome:
    """How one episode of an agent ended. With `failure` set, answer and reward are None."""

    answer: str | None = None  # the agent's final answer, when it gave one
    reward: float | None = None  # the reward the agent computed itself, when it gave one
    failure: AgentFailure | None = None  # None: the agent returned a result
    error_message: str = ""  # what went wrong, for the logs; "" without a failure
    seconds: float = 0.0  # from the process's start to its end (waiting for a slot excluded)
    stderr_tail: str = ""  # the last lines the agent wrote to stderr (its prints, for a callable)


class AgentRunner:
    """Runs episodes of one agent, at most `config.max_concurrent` at once."""

    def __init__(self, config: AgentConfig):
        self._config = config
        self._slots = asyncio.Semaphore(config.max_concurrent)
        self._forks = (
            None
            if config.callable is None
            else AgentForkServer(config.callable, {**os.environ, **config.env})
        )

    async def run(self, prompt: dict[str, Any], base_url: str, api_key: str) -> AgentOutcome:
        """Runs the agent on `prompt` against the session at `base_url` until it ends, waiting
        for a slot first. Never raises for the agent's failures (they are the outcome's);
        cancelled, it kills the agent's process group and raises CancelledError."""
        async with self._slots:
            started = time.monotonic()
            outcome = await self._run(prompt, base_url, api_key)
            return dataclasses.replace(outcome, seconds=time.monotonic() - started)

    async def close(self) -> None:
        """Stops the callable agent's fork server, killing the episodes it still runs."""
        if self._forks is not None:
            await self._forks.close()

    async def _run(self, prompt: dict[str, Any], base_url: str, api_key: str) -> AgentOutcome:
        config = self._config
        if self._forks is not None:
            request = {"prompt": prompt, "base_url": base_url, "api_key": api_key}
            try:
                end = await self._forks.run(request, config.timeout_seconds)
            except OSError as e:
                message = f"could not start the agent's fork server or fork it: {e}"
                return _failed(AgentFailure.COULD_NOT_START, message)
            except ForkServerDied as e:
                return _failed(AgentFailure.CRASHED, str(e))
        else:
            env = {**os.environ, **config.env}
            env.update(
                OPENAI_BASE_URL=base_url, OPENAI_API_KEY=api_key, TURNRL_PROMPT=json.dumps(prompt)
            )
            try:
                end = await run_in_group(config.command, env, None, config.timeout_seconds)
            except OSError as e:
                message = f"could not start {config.command[0]!r}: {e}"
                return _failed(AgentFailure.COULD_NOT_START, message)
        stderr_lines = end.stderr.splitlines()[-STDERR_TAIL_LINES:]
        outcome = self._outcome(end.returncode, end.timed_out, end.stdout, stderr_lines)
        return dataclasses.replace(outcome, stderr_tail="\n".join(stderr_lines))

    def _outcome(
        self, returncode: int | None, timed_out: bool, stdout: str, stderr_lines: list[str]
    ) -> AgentOutcome:
        if timed_out:
            return _failed(
                AgentFailure.TIMED_OUT,
                f"the agent ran past timeout_seconds={self._config.timeout_seconds}; "
                f"its process group was killed",
            )
        last = next((line for line in reversed(stdout.splitlines()) if line.strip()), "")
        try:
            value = json.loads(last)
        except ValueError:
            value = _NOT_JSON
        is_callable = self._config.callable is not None
        if is_callable and isinstance(value, dict) and "raised" in value:
            # The agent's own code broke: a failure of its process, not a turn the model took
            # (DESIGN.md "Failures"); whether some exceptions are the model's is an open question.
            return _failed(AgentFailure.RAISED, f"the agent raised {value['raised']}")
        if returncode != 0:
            message = f"the agent process {describe_exit(returncode)}"
            if stderr_lines and stderr_lines[-1].strip():
                message += f"; its stderr ends with {stderr_lines[-1].strip()[:200]!r}"
            return _failed(AgentFailure.CRASHED, message)
        if not last:
            return _failed(
                AgentFailure.BAD_RESULT, "the agent printed no result: its stdout is empty"
            )
        if value is _NOT_JSON:
            message = f"the agent's last stdout line is not JSON: {last[:200]!r}"
            return _failed(AgentFailure.BAD_RESULT, message)
        if not is_callable:
            return _result(value)
        if isinstance(value, dict) and "unserializable" in value:
            return _failed(
                AgentFailure.BAD_RESULT,
                f"the agent returned a {value['unserializable']}, which is not JSON; "
                f"expected {EXPECTED_RESULT}",
            )
        if not (isinstance(value, dict) and "result" in value):  # not rollout_svc/agent_zygote.py's
            return _failed(AgentFailure.BAD_RESULT, f"the agent's reply is garbled: {last[:200]!r}")
        return _result(value["result"])


def _result(value: Any) -> AgentOutcome:
    """The outcome of an agent's result `value`, or BAD_RESULT naming what it was."""
    fields = value if isinstance(value, dict) else {_key_of(value): value}
    answer, reward = fields.get("answer"), fields.get("reward")
    if (
        fields.keys() <= {"answer", "reward"}
        and (answer, reward) != (None, None)
        and (answer is None or isinstance(answer, str))
        and (reward is None or _is_number(reward))
    ):
        return AgentOutcome(answer=answer, reward=None if reward is None else float(reward))
    described = f"a {type(value).__name__}: {repr(value)[:200]}"
    return _failed(
        AgentFailure.BAD_RESULT, f"the agent returned {described}; expected {EXPECTED_RESULT}"
    )


def _key_of(value: Any) -> str:
    """What a bare result is: a str is the answer; anything else is read as the reward."""
    return "answer" if isinstance(value, str) else "reward"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _failed(failure: AgentFailure, message: str) -> AgentOutcome:
    return AgentOutcome(failure=failure, error_message=message)
