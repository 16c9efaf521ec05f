"""Fixtures of the trainer tests: a tiny random Qwen3 for the policy and critic back ends."""

from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Qwen3 with tied embeddings, saved in HF format."""
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder
