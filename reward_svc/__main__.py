"""`python -m reward_svc [--config F] [--host H] [--port N] [key=value ...]`: `turnrl serve reward`."""

import sys

from turnrl_cli.cli import main

main(["serve", "reward", *sys.argv[1:]])
