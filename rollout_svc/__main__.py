"""`python -m rollout_svc [--config F] [--host H] [--port N] [rollout.key=value ...]`: serves the rollout
service from the `rollout:` section of F (rollout_svc.server.main)."""

from rollout_svc.server import main

main()
