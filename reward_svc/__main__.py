"""`python -m reward_svc [--config F] [--host H] [--port N] [reward.key=value ...]`: serves the reward
service from the `reward:` section of F (reward_svc.server.main)."""

from reward_svc.server import main

main()
