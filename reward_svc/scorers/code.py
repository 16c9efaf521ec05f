"""`code`: grades a program by running its test cases in the tool service's `python` sandbox.

The reward service never runs candidate code itself: it builds one test program per response
and sends it to the tool service over gRPC (`Execute` of the `python` tool), which runs it in a
fresh bubblewrap sandbox. Two kinds of ground truth (a dict, or the same dict as JSON text):

- HumanEval style, `{"test": "def check(candidate): ...", "entry_point": "name", "prompt"?}`:
  the program is `prompt + completion + test + check(entry_point)`, then a print of a random
  marker. It passes when it exits 0 and the marker was printed, so a completion that calls
  `sys.exit(0)` or `os._exit(0)` before the tests cannot pass. Score 1.0 or 0.0.
- stdin/stdout (APPS, CodeContests), `{"inputs": [...], "outputs": [...]}`: one sandbox call
  runs a harness that starts the solution in a child interpreter once per case, feeding the
  input on real stdin (so `input()`, `sys.stdin.buffer` and `open(0)` all work) and comparing
  stdout with the expected output, ignoring surrounding blank lines and trailing spaces. A case
  passes when its output matches and the child exits 0. The solution cannot print a verdict for
  the harness: the child's output is captured, and the verdict line starts with a random marker.
  Score: the fraction of cases passed. All cases share the sandbox's wall-time limit, so a case
  that hangs makes the whole call a TIMEOUT, scored 0.0.

A sandbox TIMEOUT or EXECUTION_FAILED (a limit hit) is the candidate's fault: score 0.0 with
the message in extras["error"]. Anything else going wrong on the tool service's side (it is
unreachable, refuses the call, stops it at this scorer's deadline, or reports another tool
error) raises ScorerUnavailableError naming its address: the system's failure
(turnrl/failures.py), which the reward service reports without a score.
"""

import asyncio
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from reward_svc.scorers.base import Score, ScorerUnavailableError, ScoringRequest
from turnrl import errors, rpc
from turnrl.config import DEFAULT_PORTS, ClientConfig, StrictModel
from turnrl.failures import CODE_TOOL_ERROR_KINDS
from turnrl.v1 import tool_pb2, tool_pb2_grpc

MAX_ERROR_CHARS = 1000
# A fenced block: its info string (language), then its body up to the closing fence; a reply
# cut off at the length limit may lack the closing fence.
FENCED_BLOCK = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)
PYTHON_FENCE_TAGS = {"python", "python3", "py"}
# Cut from a failing case's expected and actual output in the verdict, in characters.
SHOWN_OUTPUT_CHARS = 200

# Runs in the sandbox after the lines `PROGRAM = ...`, `CASES = ...`, `MARKER = ...`, `SHOWN = ...`.
STDIO_HARNESS = r"""
import json, subprocess, sys


def lines(text):
    return [line.rstrip() for line in text.strip().splitlines()]


def failure(stdin, expected):
    run = subprocess.run(
        [sys.executable, "-I", "-c", PROGRAM], input=stdin.encode(), capture_output=True
    )
    if run.returncode != 0:
        stderr = run.stderr.decode(errors="replace")
        return f"exit code {run.returncode}; stderr: {stderr[-SHOWN:]}"
    actual = run.stdout.decode(errors="replace")
    if lines(actual) != lines(expected):
        return f"expected {expected[:SHOWN]!r}, got {actual[:SHOWN]!r}"
    return None


failures = [failure(stdin, expected) for stdin, expected in CASES]
first = next((i for i, f in enumerate(failures) if f is not None), None)
verdict = {
    "passed": "".join("0" if f else "1" for f in failures),
    "first_failure": None if first is None else f"case {first}: {failures[first]}",
}
print(MARKER + json.dumps(verdict))
"""


def _default_tool_service() -> ClientConfig:
    return ClientConfig(address=f"127.0.0.1:{DEFAULT_PORTS['tool']}")


class CodeScorerOptions(StrictModel):
    """Where the tool service is and how the code scorer calls it."""

    tool_service: ClientConfig = Field(
        default_factory=_default_tool_service,
        description="The tool service whose sandbox runs the tests.",
    )
    tool_name: str = Field(
        default="python", min_length=1, description="Name of the tool service's Python tool."
    )
    timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Deadline of the tool call running one response's tests, in seconds. Keep "
        "it past the sandbox's wall_timeout_seconds (10 by default) and a second: a program "
        "that runs too long is then stopped by the sandbox, a TIMEOUT scored 0.0, rather than "
        "by this deadline, which is the system's failure.",
    )
    max_concurrency: int = Field(
        default=8, ge=1, description="Tool calls this scorer has in flight at once."
    )
    data_sources: list[str] = Field(
        default_factory=lambda: [
            "openai_humaneval",
            "humaneval",
            "codecontests",
            "apps",
            "taco",
            "code",
        ],
        min_length=1,
        description="data_source values this scorer grades.",
    )


@dataclass(frozen=True)
class FunctionTests:
    """HumanEval-style tests: `check(candidate)` asserts on the function `entry_point`."""

    test: str
    entry_point: str
    prompt: str


@dataclass(frozen=True)
class StdioTests:
    """Input/expected-output pairs for a program that reads stdin and writes stdout."""

    inputs: list[str]
    outputs: list[str]


class CodeScorer:
    """Grades code responses by running their tests in the tool service's Python sandbox.

    Build it inside the event loop that calls `score`; it owns one channel, closed by `close`.
    """

    def __init__(self, options: CodeScorerOptions) -> None:
        self.options = options
        self._channel = rpc.open_channel(options.tool_service)
        self._stub = tool_pb2_grpc.ToolServiceStub(self._channel)
        self._slots = asyncio.Semaphore(options.max_concurrency)

    async def score(self, request: ScoringRequest) -> Score:
        """Runs the response's code against the ground truth's tests.

        Raises ValueError for a ground truth of neither shape, ScorerUnavailableError when
        the tool service cannot run the tests.
        """
        tests = parse_tests(request.ground_truth)
        code = extract_code(request.response_text)
        marker = f"<<tests-done-{secrets.token_hex(16)}>>"
        if isinstance(tests, FunctionTests):
            return _function_score(await self._run(function_program(code, tests, marker)), marker)
        result = await self._run(stdio_program(code, tests, marker))
        return _stdio_score(result, marker, len(tests.inputs))

    async def close(self) -> None:
        """Closes the channel to the tool service."""
        await self._channel.close()

    async def _run(self, program: str) -> tool_pb2.ToolResult:
        """The tool's result for one program; ScorerUnavailableError when the service cannot
        give one."""
        address = self.options.tool_service.address
        request = tool_pb2.ExecuteRequest(
            tool_name=self.options.tool_name, arguments=json.dumps({"code": program})
        )
        async with self._slots:
            try:
                reply = await rpc.call_idempotent(
                    self._stub.Execute,
                    request,
                    timeout_seconds=self.options.timeout_seconds,
                    max_attempts=self.options.tool_service.max_attempts,
                )
            except errors.RpcError as e:
                raise ScorerUnavailableError(
                    f"tool service at {address} failed the {self.options.tool_name!r} call: "
                    f"{e.status}: {e.details}"
                ) from e
        result = reply.result
        if result.HasField("error") and result.error.kind not in CODE_TOOL_ERROR_KINDS:
            kind = tool_pb2.ToolError.Kind.Name(result.error.kind)
            raise ScorerUnavailableError(
                f"tool service at {address} could not run the tests with tool "
                f"{self.options.tool_name!r}: {kind}: {result.error.message}"
            )
        return result


def parse_tests(ground_truth: Any) -> FunctionTests | StdioTests:
    """The tests a ground truth describes (a dict, or a dict as JSON text); ValueError when it
    is neither HumanEval style nor stdin/stdout cases."""
    expected = (
        'a dict {"test", "entry_point", "prompt"?} or {"inputs": [...], "outputs": [...]}, '
        "or that dict as JSON text"
    )
    data = ground_truth
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"code ground truth {_short(ground_truth)} is not JSON ({e}); expected {expected}"
            ) from e
    if not isinstance(data, dict):
        raise ValueError(
            f"code ground truth {_short(ground_truth)} is not a dict; expected {expected}"
        )
    if "test" in data or "entry_point" in data:
        return _function_tests(data)
    if "inputs" in data or "outputs" in data:
        return _stdio_tests(data)
    raise ValueError(
        f"code ground truth has keys {sorted(data)!r}, neither test/entry_point nor "
        f"inputs/outputs; expected {expected}"
    )


def extract_code(response_text: str) -> str:
    """The last ```python fenced block of a response, else its last untagged ``` block, else
    the whole text."""
    blocks = FENCED_BLOCK.findall(response_text)
    python = [body for tag, body in blocks if tag.strip().lower() in PYTHON_FENCE_TAGS]
    untagged = [body for tag, body in blocks if not tag.strip()]
    chosen = python or untagged
    return chosen[-1] if chosen else response_text


def function_program(code: str, tests: FunctionTests, marker: str) -> str:
    """A HumanEval program: the prompt when given, the completion, the tests, then a print of
    `marker` that only a run reaching the end makes."""
    # A completion that defines the entry point replaces the prompt's stub, but still needs the
    # prompt's imports and helpers; one that does not is the body that continues the prompt.
    defines_entry = re.search(rf"^(async\s+)?def\s+{tests.entry_point}\s*\(", code, re.MULTILINE)
    prefix = tests.prompt + "\n" if defines_entry and tests.prompt else tests.prompt
    return f"{prefix}{code}\n\n{tests.test}\ncheck({tests.entry_point})\nprint({marker!r})\n"


def stdio_program(code: str, tests: StdioTests, marker: str) -> str:
    """The harness that runs `code` once per case and prints `marker` + a JSON verdict."""
    cases = list(zip(tests.inputs, tests.outputs, strict=True))
    return (
        f"PROGRAM = {code!r}\nCASES = {cases!r}\nMARKER = {marker!r}\n"
        f"SHOWN = {SHOWN_OUTPUT_CHARS}\n{STDIO_HARNESS}"
    )


def _function_score(result: tool_pb2.ToolResult, marker: str) -> Score:
    extras = _run_extras(result)
    passed = not result.HasField("error") and extras.get("exit_code") == 0
    if passed and marker not in result.text:
        passed = False
        extras["error"] = "the program ended before its tests finished: " + _truncated(result.text)
    elif not passed:
        extras["error"] = _truncated(result.text)
    return Score(score=float(passed), extras={"passed": int(passed), "total": 1, **extras})


def _stdio_score(result: tool_pb2.ToolResult, marker: str, total: int) -> Score:
    extras = _run_extras(result)
    verdict_line = next(
        (line for line in result.text.splitlines() if line.startswith(marker)), None
    )
    if result.HasField("error") or verdict_line is None:
        extras["error"] = _truncated(result.text)
        return Score(score=0.0, extras={"passed": 0, "total": total, **extras})
    verdict = json.loads(verdict_line[len(marker) :])
    passed = verdict["passed"].count("1")
    if verdict["first_failure"] is not None:
        extras["error"] = _truncated(verdict["first_failure"])
    return Score(score=passed / total, extras={"passed": passed, "total": total, **extras})


def _run_extras(result: tool_pb2.ToolResult) -> dict[str, Any]:
    """exit_code of the sandboxed run, when it got as far as exiting."""
    if "exit_code" in result.metrics:
        return {"exit_code": int(result.metrics["exit_code"])}
    return {}


def _function_tests(data: dict[str, Any]) -> FunctionTests:
    test, entry_point, prompt = data.get("test"), data.get("entry_point"), data.get("prompt", "")
    if not isinstance(test, str) or "def check(" not in test:
        raise ValueError(
            f"code ground truth 'test' is {_short(test)}; expected Python text defining "
            "check(candidate)"
        )
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise ValueError(
            f"code ground truth 'entry_point' is {entry_point!r}; expected a function name"
        )
    if not isinstance(prompt, str):
        raise ValueError(f"code ground truth 'prompt' is {_short(prompt)}; expected text")
    return FunctionTests(test=test, entry_point=entry_point, prompt=prompt)


def _stdio_tests(data: dict[str, Any]) -> StdioTests:
    if "fn_name" in data:
        raise ValueError(
            f"code ground truth calls function {data['fn_name']!r} (APPS call-based tests); "
            "only stdin/stdout cases are supported"
        )
    inputs, outputs = (_case_texts(data.get(name), name) for name in ("inputs", "outputs"))
    if len(inputs) != len(outputs):
        raise ValueError(
            f"code ground truth has {len(inputs)} inputs but {len(outputs)} outputs; "
            "expected one output per input"
        )
    return StdioTests(inputs=inputs, outputs=outputs)


def _case_texts(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"code ground truth {name!r} is {_short(value)}; expected a non-empty list"
        )
    return [_case_text(case, name) for case in value]


def _case_text(value: Any, name: str) -> str:
    """A case's text; APPS stores some as a list of lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise ValueError(
        f"code ground truth {name!r} holds {_short(value)}; expected text or a list of lines"
    )


def _truncated(text: str) -> str:
    """At most MAX_ERROR_CHARS of `text`: its start and its end, where a traceback's last line is."""
    if len(text) <= MAX_ERROR_CHARS:
        return text
    gap = "\n...\n"
    half = (MAX_ERROR_CHARS - len(gap)) // 2
    return text[:half] + gap + text[-half:]


def _short(value: Any) -> str:
    """`value!r`, cut to a readable length for an error message."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
