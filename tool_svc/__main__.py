"""`python -m tool_svc [--config F] [--host H] [--port N] [tool.key=value ...]`: serves the tool
service from the `tool:` section of F (tool_svc.server.main)."""

from tool_svc.server import main

main()
