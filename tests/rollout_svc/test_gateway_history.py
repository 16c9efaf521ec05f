"""The gateway's prefix rule (rollout_svc/gateway/history.py) on plain messages."""

import re

import pytest

from rollout_svc.gateway.history import HistoryRewrittenError, new_messages
from rollout_svc.gateway.requests import RequestFieldError
from turnrl.messages import openai_tool_call

PROMPT = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "2+3?"}]
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [openai_tool_call("call_0_0", "calculator", '{"expression": "2 + 3"}')],
}
RESULT = {"role": "tool", "content": "5", "tool_call_id": "call_0_0"}


def test_the_history_sent_back_as_generated_leaves_the_new_messages():
    # The SDKs may re-serialize arguments and rename call ids: the calls are what count.
    echoed = {**CALL, "tool_calls": [openai_tool_call("x", "calculator", '{"expression":"2 + 3"}')]}
    assert new_messages([*PROMPT, CALL], [*PROMPT, echoed, RESULT]) == [RESULT]
    user = {"role": "user", "content": "And 4+4?"}
    history = [*PROMPT, CALL, RESULT, {"role": "assistant", "content": "#### 5"}]
    assert new_messages(history, [*history, user]) == [user]


@pytest.mark.parametrize(
    ("sent", "message", "param", "rewritten"),
    [
        (
            [*PROMPT, {**CALL, "tool_calls": [openai_tool_call("c", "calculator", '{"expression": "2*3"}')]}, RESULT],
            "messages[2] differs from the session's history",
            "messages.2",
            True,
        ),
        (
            [PROMPT[0], {"role": "user", "content": "2+4?"}, CALL, RESULT],
            "messages[1] differs",
            "messages.1",
            True,
        ),
        ([*PROMPT, {"role": "assistant", "content": "(summary)"}, RESULT], "messages[2] differs", "messages.2", True),
        (PROMPT, "send the whole history back", "messages", True),
        ([*PROMPT, CALL], "no new messages", "messages", False),
        ([*PROMPT, CALL, {"role": "assistant", "content": "#### 5"}], "role 'assistant'", "messages.3.role", True),
        ([*PROMPT, CALL, {"role": "system", "content": "Be brief."}], "role 'system'", "messages.3.role", True),
    ],
)  # fmt: skip
def test_a_history_that_is_not_the_prefix_names_the_message(sent, message, param, rewritten):
    """A rewritten history (a new part, or refused) names the first message that differs;
    the history with nothing new is no rewrite, and always refused."""
    with pytest.raises(RequestFieldError, match=re.escape(message)) as info:
        new_messages([*PROMPT, CALL], sent)
    assert info.value.param == param
    assert isinstance(info.value, HistoryRewrittenError) == rewritten
