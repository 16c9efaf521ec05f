"""The tool service: calculator, Python sandbox, search, MCP and Sandbox Fusion behind one API."""
