"""A plain Python function as a tool, as TRL takes them: type hints and a Google-style docstring
give its schema (transformers' `get_json_schema`), its return value is the observation.

A sync function runs in a worker thread so that it never blocks the event loop; an async one is
awaited. The service's concurrency cap, rate limit and timeout hold as for any tool. A thread
cannot be stopped: a sync function that runs past its timeout is reported TIMEOUT at once and
frees its `max_concurrency` slot, but runs on in its thread of the loop's default executor, so
one that hangs for good holds that thread for good.
"""

import asyncio
import inspect
import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import (
    DocstringParsingException,
    TypeHintParsingException,
)

from tool_svc.tools.base import NoOptions, Tool, ToolCallError, ToolErrorKind, ToolResult


class FunctionTool(Tool):
    """A tool whose `execute` calls a plain function with the model's arguments as keywords."""

    def __init__(
        self,
        name: str,
        options: BaseModel,
        schema: dict[str, Any] | None,
        function: Callable[..., Any],
    ) -> None:
        super().__init__(name, options, schema)
        self._function = function
        self._parameters = inspect.signature(function)

    @classmethod
    def from_function(
        cls,
        function: Callable[..., Any],
        name: str | None,
        options: dict[str, Any],
        schema: dict[str, Any] | None,
    ) -> "FunctionTool":
        """A tool of `function`, named `name` (default: the function's), with `schema` in place
        of the generated one when given.

        Raises ValueError when no schema can be made from the function's type hints and
        docstring, pydantic.ValidationError for any `options` (a function takes none).
        """
        if schema is None:
            try:
                schema = get_json_schema(function)["function"]
            except (DocstringParsingException, TypeHintParsingException) as e:
                raise ValueError(
                    f"function {function.__qualname__} cannot be a tool: {e} (a function tool "
                    "needs a type hint on every parameter and a Google-style docstring with an "
                    "Args: line for each)"
                ) from None
        return cls(name or schema["name"], NoOptions.model_validate(options), schema, function)

    def parse_args(self, raw: str) -> dict[str, Any]:
        """The schema's checks, then the function's own: a replaced schema may allow
        arguments the function does not take."""
        args = super().parse_args(raw)
        try:
            self._parameters.bind(**args)
        except TypeError as e:
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS, f"invalid arguments for {self.name}: {e}"
            ) from None
        return args

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        """Calls the function; whatever it raises is the model's call failing, as a tool's
        own errors are (the model chose the arguments)."""
        try:
            if inspect.iscoroutinefunction(self._function):
                value = await self._function(**args)
            else:
                value = await asyncio.to_thread(self._function, **args)
        except Exception as e:
            raise ToolCallError(ToolErrorKind.EXECUTION_FAILED, f"{type(e).__name__}: {e}") from e
        # A value JSON cannot hold is the function's bug, reported as INTERNAL by the service.
        return ToolResult(text=value if isinstance(value, str) else json.dumps(value))
