"""The OpenAI-compatible gateway: agents written elsewhere (the `openai` SDK, LangGraph, any HTTP
loop) call the rollout service's engine at `/sessions/<id>/v1/chat/completions`, and each
session is recorded as a token-exact `Trajectory`. `app.py` serves HTTP, `sessions.py` holds the
sessions, `history.py` states the prefix rule a session's requests follow (and the part rule for a
history an agent rewrote), `requests.py` and
`replies.py` are OpenAI's wire format."""

# What `turnrl serve rollout` prints once the gateway listens, before the URL; `turnrl up`
# reads it (turnrl_cli/processes.py).
GATEWAY_LINE = "gateway of RolloutService on "
