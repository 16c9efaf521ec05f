"""turnrl: reinforcement-learning post-training for tool-using LLM agents, as four gRPC services.

This package is what the services share: generated stubs (`turnrl.v1`), config (`config`,
`project_config`), domain errors (`errors`), gRPC plumbing (`rpc`) and the `turnrl` CLI.
"""

from importlib.metadata import version

__version__ = version("turnrl")
