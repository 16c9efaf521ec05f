"""`python -m tool_svc [--config F] [--host H] [--port N] [key=value ...]`: `turnrl serve tool`."""

import sys

from turnrl_cli.cli import main

main(["serve", "tool", *sys.argv[1:]])
