"""The bearer token of one launch (`launcher.auth_token`): made by `turnrl up` or `run`, given
to every service it starts that has no token of its own. The launcher hands each caller it
wires to a started service that service's token (`processes.peer_addresses` for the rollout
service's tool and reward clients, the run config for the trainer's rollout client) and uses
it itself.

The token travels in the environment variable LAUNCH_TOKEN_ENV, never on a command line:
`ps` shows other users a process's arguments, not its environment.
"""

import os
import secrets

from turnrl.config import is_loopback
from turnrl_cli.project_config import ProjectConfig

LAUNCH_TOKEN_ENV = "TURNRL_LAUNCH_TOKEN"


def needs_launch_token(project: ProjectConfig) -> bool:
    """Whether this launch makes a token: as `launcher.auth_token` says; for `auto`, when a
    service it starts would listen where other machines reach it (any Ray launch: services
    bind their node's address) with neither TLS nor a token of its own."""
    mode = project.launcher.auth_token
    if mode != "auto":
        return mode == "generate"
    for name in project.services_to_start():
        server = project.server(name)
        exposed = project.launcher.kind == "ray" or not is_loopback(server.host)
        if exposed and not (server.tls or server.auth_token_env or server.allow_insecure):
            return True
    return False


def launch_token_overrides(project: ProjectConfig) -> list[str]:
    """Makes this launch's token, when it needs one, into this process's environment (its
    children inherit it; Ray actors are handed it), and returns the overrides that make each
    service it starts without a token of its own require it."""
    if not needs_launch_token(project):
        return []
    os.environ[LAUNCH_TOKEN_ENV] = secrets.token_urlsafe(32)
    return [
        f"{name}.server.auth_token_env={LAUNCH_TOKEN_ENV}"
        for name in project.services_to_start()
        if not project.server(name).auth_token_env
    ]
