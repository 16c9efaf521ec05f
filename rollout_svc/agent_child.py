"""The process a callable agent runs in, one per episode, started by rollout_svc/agent_runner.py
as `python -m rollout_svc.agent_child package.module:function`.

It reads one JSON object {"prompt": {...}, "base_url": str, "api_key": str} from stdin, calls
`function(prompt, base_url, api_key)` (and runs it to the end with `asyncio.run` when it
returns a coroutine), and writes one JSON line on the stdout it started with:
  {"result": <what the function returned>}          exit code 0
  {"unserializable": "<type name>"}                 exit code 0: the result is not JSON
  {"raised": "<the traceback's last line>"}         exit code 1: the function (or its import)
                                                    raised; the whole traceback is on stderr
Before the agent's module is imported, file descriptor 1 is pointed at stderr, so whatever the
agent prints lands in the runner's `stderr_tail`, never in the result; the result's descriptor
is not inherited by the processes the agent starts.
"""

import asyncio
import importlib
import json
import os
import sys
import traceback


def main(target: str) -> int:
    """Runs the agent `target` ("package.module:function") on the request read from stdin;
    returns the exit code."""
    result_fd = os.dup(1)  # a new descriptor is non-inheritable
    os.dup2(2, 1)  # the agent's prints, and its children's, go to stderr
    request = json.load(sys.stdin)
    try:
        module_name, _, name = target.partition(":")
        function = getattr(importlib.import_module(module_name), name)
        result = function(request["prompt"], request["base_url"], request["api_key"])
        if asyncio.iscoroutine(result):
            result = asyncio.run(result)
    except Exception as e:
        traceback.print_exc()
        line, code = json.dumps({"raised": traceback.format_exception_only(e)[-1].strip()}), 1
    else:
        code = 0
        try:
            line = json.dumps({"result": result})
        except (TypeError, ValueError):
            line = json.dumps({"unserializable": type(result).__name__})
    sys.stdout.flush()
    with os.fdopen(result_fd, "w") as out:
        out.write(line + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
