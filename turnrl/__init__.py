"""turnrl: reinforcement-learning post-training for tool-using LLM agents, as four gRPC services.

This package is what the services share: generated stubs (`turnrl.v1`), the config base
(`config`), domain errors (`errors`), gRPC plumbing (`rpc`), the trajectory, chat-template
tokenization and the weight layout. It imports no service; the layer above the services (the
`turnrl` command line, the whole config file, the launcher) is `turnrl_cli`.
"""

import os
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# gRPC's fork handlers restart its poller in a forked child, which crashes (epoll EBADF) a child
# that closes its file descriptors before exec: how `turnrl up` starts a service while its own
# channels are busy (grpc/grpc#43055, from grpcio 1.80). No turnrl child uses gRPC without exec,
# so the handlers have nothing to do here. Read by gRPC at its first channel or server.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def _version() -> str:
    try:
        return version("turnrl")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed (the GPU machine)
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


__version__ = _version()
