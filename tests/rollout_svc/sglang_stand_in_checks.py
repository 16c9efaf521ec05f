"""What the stand-in SGLang server (`sglang_stand_in`) refuses as SGLang 0.5.23 refuses it: a
launch flag its server arguments do not define, and the /generate requests it answers with HTTP
400 (a body its API contract rejects, a prompt too long for its context, sampling values out
of range, a duplicate rid). Paths below are the 0.5.23 wheel's, under `sglang/`."""

import argparse
import json
from pathlib import Path

from starlette.responses import JSONResponse

# The flags of 0.5.23's `srt/server_args.py` (aliases included), generated from the release.
FLAGS_FILE = Path(__file__).with_name("sglang_0_5_23_flags.txt")
# What the scheduler keeps back from the context (`srt/managers/tp_worker.py`: max_req_len =
# context - 1, max_req_input_len = max_req_len - 5).
RESERVED_TOKENS = 6
# The sampling keys the API contract takes; it rejects others (`api/v1/api_types.py`
# _FIELDS_SamplingParams), in its order.
SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip


def server_arguments(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed as 0.5.23's `prepare_server_args` parses it (prog "sglang serve"): a flag
    it does not define ends the process with argparse's "unrecognized arguments" and exit code
    2. The stand-in reads the model, address, context and tensor-parallel size; other flags
    are taken, whatever their values, and ignored."""
    parser = argparse.ArgumentParser(prog="sglang serve")
    used = {
        ("--model-path", "--model"): {"required": True},
        ("--host",): {"default": "127.0.0.1"},
        ("--port",): {"type": int, "default": 30000},
        ("--context-length",): {"type": int, "default": None},
        ("--tp-size", "--tensor-parallel-size"): {"type": int, "default": 1},
    }
    for names, options in used.items():
        parser.add_argument(*names, **options)
    taken = {name for names in used for name in names}
    for line in FLAGS_FILE.read_text().splitlines():
        if line.startswith("--") and line not in taken:
            parser.add_argument(line, nargs="*")
    return parser.parse_args(argv)


def generate_refusal(body: dict, context_length: int, running: set[str]) -> JSONResponse | None:
    """0.5.23's HTTP 400 answer to a /generate request of `body`, in the order it checks; None
    for one it admits. `running`: the rids of requests running now."""
    params = body.get("sampling_params") or {}
    # The API contract (`srt/entrypoints/api_contract.py`): its error is the body's string.
    if unknown := [key for key in params if key not in SAMPLING_KEYS]:
        listed = ", ".join(f"`{key}`" for key in SAMPLING_KEYS)
        error = f"unknown field `{unknown[0]}`, expected one of {listed}"
        return JSONResponse({"error": error}, status_code=400)
    message = _tokenizer_refusal(body, params, context_length, running)
    if message is None and len(body["input_ids"]) >= context_length - RESERVED_TOKENS:
        # The scheduler (`srt/managers/utils.py` validate_input_length) ends the request with
        # an abort of status 400, which the tokenizer manager raises as ValueError.
        message = (
            f"Input length ({len(body['input_ids'])} tokens) exceeds the maximum allowed "
            f"length ({context_length - RESERVED_TOKENS} tokens). Use a shorter input or "
            "enable --allow-auto-truncate."
        )
    if message is None:
        return None
    # `srt/entrypoints/http_server.py` _create_error_response.
    return JSONResponse({"error": {"message": message}}, status_code=400)


def _tokenizer_refusal(
    body: dict, params: dict, context_length: int, running: set[str]
) -> str | None:
    """The ValueError `srt/managers/tokenizer_manager.py` raises: its context checks
    (_validate_one_request), then the sampling values (`srt/sampling/sampling_params.py`
    verify), then a rid already running."""
    input_count, max_new_tokens = len(body["input_ids"]), params.get("max_new_tokens", 128)
    if input_count >= context_length:
        return (
            f"The input ({input_count} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    if max_new_tokens is not None and input_count + max_new_tokens > context_length:
        return (
            "Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {input_count + max_new_tokens} "
            f"tokens: {input_count} tokens from the input messages and {max_new_tokens} tokens "
            "for the completion. Please reduce the number of tokens in the input messages or "
            "the completion to fit within the limit."
        )
    temperature, top_p = params.get("temperature", 1.0), params.get("top_p", 1.0)
    top_k, min_p = params.get("top_k", 1 << 30), params.get("min_p", 0.0)
    repetition_penalty = params.get("repetition_penalty", 1.0)
    if temperature < 0:
        return f"temperature must be a non-negative finite number, got {temperature}."
    if not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    if not 0.0 <= min_p <= 1.0:
        return f"min_p must be in [0, 1], got {min_p}."
    if top_k < 1 and top_k != -1 and not temperature < 1e-6:  # greedy sets top_k = 1 first
        return f"top_k must be -1 (disable) or at least 1, got {top_k}."
    if not 0.0 < repetition_penalty <= 2.0:
        return f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition_penalty}."
    if max_new_tokens is not None and max_new_tokens < 0:
        return f"max_new_tokens must be at least 0, got {max_new_tokens}."
    if body.get("rid") in running:
        return f"Duplicate request ID detected: {body['rid']}"
    return None


def lora_load_refusal(body: dict, argv: list[str], loaded: dict) -> str | None:
    """Why 0.5.23 refuses to load the adapter `body` names (`srt/lora/lora_manager.py`
    load_lora_adapter, `lora_config.py`): LoRA off, a name taken, no peft LoRA folder, a rank
    over --max-lora-rank or a target module outside --lora-target-modules; None when it
    loads."""
    if "--enable-lora" not in argv:
        return "LoRA is not enabled; start the server with --enable-lora"
    if body["lora_name"] in loaded:
        return f"LoRA adapter {body['lora_name']!r} is already loaded"
    folder = Path(body["lora_path"])
    if not (folder / "adapter_model.safetensors").is_file():
        return f"no adapter_model.safetensors in {folder}"
    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        return f"{folder} holds no LoRA adapter: peft_type {config.get('peft_type')!r}"
    max_rank = int(_flag_values(argv, "--max-lora-rank")[0])
    targets = set(_flag_values(argv, "--lora-target-modules"))
    if config["r"] > max_rank or not set(config["target_modules"]) <= targets:
        return f"adapter of rank {config['r']} on {config['target_modules']} is incompatible"
    return None


def lora_reply(error: str | None, loaded: dict) -> JSONResponse:
    """0.5.23's answer to a LoRA load or unload (`LoadLoRAAdapterReqOutput`)."""
    body = {"success": error is None, "error_message": error, "loaded_adapters": list(loaded)}
    return JSONResponse(body, status_code=200 if error is None else 400)


def _flag_values(argv: list[str], flag: str) -> list[str]:
    """The values after `flag` in `argv`, up to the next flag."""
    values = argv[argv.index(flag) + 1 :]
    return values[: next((i for i, v in enumerate(values) if v.startswith("--")), len(values))]
