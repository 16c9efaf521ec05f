"""The fixtures test_retool.py defines, shared with test_retool_qwen3.py."""

from .test_retool import qwen3, qwen3_max_length, sft_config, sft_records  # noqa: F401
