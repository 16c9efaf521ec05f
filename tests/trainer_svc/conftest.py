"""Fixtures of the trainer tests: a tiny random Qwen3 for the policy and critic back ends, and
the four services started by `turnrl up` for the end-to-end runs."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from turnrl_cli.up_table import UP_READY_LINE, UP_TABLE_ROW

from ..conftest import EXAMPLE_CONFIG, FREE_PORTS, SERVICE_NAMES, free_port


def tiny_qwen3_config(**changes) -> Qwen3Config:
    """A 2-layer Qwen3 of width 64 with tied embeddings and a 256-token vocabulary, but for
    `changes`."""
    sizes = {
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
    }
    return Qwen3Config(**{**sizes, **changes})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A randomly initialised `tiny_qwen3_config()` Qwen3, saved in HF format."""
    config = tiny_qwen3_config()
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def trainer_metrics_port() -> int:
    """Where the trainer of `services` serves its Prometheus metrics."""
    return free_port()


@pytest.fixture(scope="session")
def services(example_on_tiny_model, trainer_metrics_port, tmp_path_factory) -> dict[str, str]:
    """`turnrl up` with the example config on free ports; yields each service's address."""
    log = (tmp_path_factory.mktemp("up") / "up.log").open("w")
    # Each test's run folder is under pytest's base folder, the trainer's runs root here.
    runs_root = f"trainer.runs_root={tmp_path_factory.getbasetemp()}"
    metrics = f"trainer.server.metrics_port={trainer_metrics_port}"
    up = ["up", "--config", str(EXAMPLE_CONFIG), *FREE_PORTS, *example_on_tiny_model]
    up += [runs_root, metrics]
    process = subprocess.Popen(
        [sys.executable, "-m", "turnrl_cli", *up],
        stdout=subprocess.PIPE,
        stderr=log,  # a file, so the services' logs never fill a pipe nobody reads
        text=True,
    )
    addresses = {}
    for line in process.stdout:
        if match := UP_TABLE_ROW.search(line):
            addresses[match.group(1)] = match.group(2)
        if UP_READY_LINE in line:
            break
    assert set(addresses) == set(SERVICE_NAMES), Path(log.name).read_text()[-3000:]
    yield addresses
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    log.close()
