"""`sandbox_fusion`: runs the model's code on a Sandbox Fusion server, for users who run one.

Sandbox Fusion (github.com/bytedance/SandboxFusion) executes code in isolated sandboxes behind
`POST {url}/run_code`. The model calls this tool as `code_interpreter(code)`, the function
verl's sandbox-fusion tool declares. The request carries
`{code, language, run_timeout, compile_timeout, memory_limit_MB, stdin, files}`; the answer is
`{status: Success|Failed|SandboxError, message, compile_result, run_result}`, each result being
`{status: Finished|TimeLimitExceeded|Error, execution_time, return_code, stdout, stderr}`.
"""

from typing import Any, ClassVar, Literal, Self

import httpx
from pydantic import BaseModel, Field, model_validator

from tool_svc.tools.base import Tool, ToolCallError, ToolErrorKind, ToolResult
from turnrl.config import StrictModel
from turnrl.http_json import HttpJsonError, post_json

# Sandbox Fusion's `memory_limit_MB` for "no limit".
NO_MEMORY_LIMIT = -1


class SandboxFusionOptions(StrictModel):
    """Where the Sandbox Fusion server is and the limits each run gets."""

    url: str = Field(
        description="Base URL of the Sandbox Fusion server; calls POST {url}/run_code."
    )
    language: str = Field(
        default="python",
        description="Sandbox Fusion language of the code, e.g. 'python', 'cpp', 'bash'.",
    )
    run_timeout_seconds: float = Field(
        default=10.0, gt=0, description="Run time the sandbox allows the code, in seconds."
    )
    compile_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Compile time the sandbox allows, in seconds (compiled languages only).",
    )
    memory_limit_mb: int | None = Field(
        default=1024,
        gt=0,
        description="Memory the sandbox allows the code, in MiB; None: no limit.",
    )
    request_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Limit of one HTTP call to the server, in seconds; must exceed "
        "run_timeout_seconds + compile_timeout_seconds so the sandbox can report a timeout.",
    )
    max_output_bytes: int = Field(
        default=8192,
        gt=0,
        description="Longest stdout, and longest stderr, shown to the model, in UTF-8 bytes; "
        "the rest is cut with a note.",
    )

    @model_validator(mode="after")
    def _request_outlasts_sandbox(self) -> Self:
        sandbox_seconds = self.run_timeout_seconds + self.compile_timeout_seconds
        if self.request_timeout_seconds <= sandbox_seconds:
            raise ValueError(
                f"request_timeout_seconds {self.request_timeout_seconds} must exceed "
                f"run_timeout_seconds + compile_timeout_seconds = {sandbox_seconds}"
            )
        return self


class _CommandRunResult(BaseModel):
    status: Literal["Finished", "TimeLimitExceeded", "Error"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class _RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    compile_result: _CommandRunResult | None = None
    run_result: _CommandRunResult | None = None


class SandboxFusionTool(Tool):
    """Runs code on a Sandbox Fusion server and returns what it printed.

    The observation is stdout, then stderr under a `stderr:` label; metrics hold `exit_code`
    and `runtime_seconds`. A failed compilation returns the compiler's output. A run or
    compilation past its time limit is a TIMEOUT error; a SandboxError answer, a server that
    is down, silent, answers non-200 or malformed JSON is an UNAVAILABLE error naming the URL.
    """

    schema: ClassVar[dict[str, Any]] = {
        "name": "code_interpreter",
        "description": "Run a code snippet and return what it prints to stdout and stderr.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to run."}},
            "required": ["code"],
            "additionalProperties": False,
        },
    }
    Options = SandboxFusionOptions

    def __init__(
        self, name: str, options: SandboxFusionOptions, schema: dict[str, Any] | None = None
    ):
        super().__init__(name, options, schema)
        self.url = options.url.rstrip("/") + "/run_code"
        # trust_env=False: no proxy or netrc from the environment.
        self._client = httpx.AsyncClient(timeout=options.request_timeout_seconds, trust_env=False)

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        options: SandboxFusionOptions = self.options
        request = {
            "code": args["code"],
            "language": options.language,
            "run_timeout": options.run_timeout_seconds,
            "compile_timeout": options.compile_timeout_seconds,
            "memory_limit_MB": options.memory_limit_mb or NO_MEMORY_LIMIT,
            "stdin": "",
            "files": {},
        }
        return self._observation(await self._run_code(request))

    async def _run_code(self, request: dict[str, Any]) -> _RunCodeResponse:
        # No retries: a second try would run the candidate's code again.
        try:
            return await post_json(
                self._client,
                self.url,
                request,
                _RunCodeResponse,
                timeout_seconds=self.options.request_timeout_seconds,
            )
        except HttpJsonError as e:
            raise self._unavailable(str(e)) from None

    def _observation(self, response: _RunCodeResponse) -> ToolResult:
        options: SandboxFusionOptions = self.options
        if response.status == "SandboxError":
            raise self._unavailable(f"reported a sandbox error: {response.message!r}")
        compiled = response.compile_result
        if compiled is not None and compiled.status == "TimeLimitExceeded":
            raise ToolCallError(
                ToolErrorKind.TIMEOUT,
                f"compilation ran past compile_timeout_seconds={options.compile_timeout_seconds}",
            )
        if compiled is not None and compiled.return_code != 0:
            output = self._clip(compiled.stdout) + self._clip(compiled.stderr)
            return ToolResult(
                text=f"Compilation failed:\n{output}",
                metrics=_metrics(compiled),
            )
        run = response.run_result
        if run is not None and run.status == "TimeLimitExceeded":
            message = f"the code ran past run_timeout_seconds={options.run_timeout_seconds}"
            if run.stdout:
                message += f"; its output until then:\n{self._clip(run.stdout)}"
            raise ToolCallError(ToolErrorKind.TIMEOUT, message)
        if run is None or run.status != "Finished":
            run_status = None if run is None else run.status
            raise self._unavailable(
                f"answered status {response.status!r} with run status {run_status!r}"
            )
        text = self._clip(run.stdout)
        if run.stderr:
            separator = "" if not text or text.endswith("\n") else "\n"
            text += f"{separator}stderr:\n{self._clip(run.stderr)}"
        return ToolResult(text=text, metrics=_metrics(run))

    def _clip(self, output: str | None) -> str:
        data = (output or "").encode()
        limit = self.options.max_output_bytes
        if len(data) <= limit:
            return output or ""
        kept = data[:limit].decode(errors="ignore")
        return f"{kept}\n[... {len(data) - limit} more bytes cut]\n"

    def _unavailable(self, what: str) -> ToolCallError:
        return ToolCallError(ToolErrorKind.UNAVAILABLE, f"Sandbox Fusion at {self.url!r} {what}")

    async def close(self) -> None:
        await self._client.aclose()


def _metrics(result: _CommandRunResult) -> dict[str, float]:
    metrics = {}
    if result.return_code is not None:
        metrics["exit_code"] = float(result.return_code)
    if result.execution_time is not None:
        metrics["runtime_seconds"] = result.execution_time
    return metrics
