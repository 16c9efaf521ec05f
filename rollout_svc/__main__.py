"""`python -m rollout_svc [--config F] [--host H] [--port N] [key=value ...]`: `turnrl serve rollout`."""

import sys

from turnrl_cli.cli import main

main(["serve", "rollout", *sys.argv[1:]])
