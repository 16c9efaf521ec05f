"""`python -m trainer_svc [--config F] [--host H] [--port N] [key=value ...]`: `turnrl serve trainer`."""

import sys

from turnrl_cli.cli import main

main(["serve", "trainer", *sys.argv[1:]])
