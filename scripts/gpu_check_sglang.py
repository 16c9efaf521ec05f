"""Checks the SGLang engine adapter (rollout_svc/engines/sglang.py) against a real SGLang server.

For the GPU machine, not CI. It installs and downloads nothing: it needs a CUDA GPU, this
project installed (`pip install -e .`), `sglang` importable in the same Python (the adapter
runs `python -m sglang.launch_server` with it), and a small chat model on local disk:

    python scripts/gpu_check_sglang.py /models/Qwen2.5-0.5B-Instruct

It launches the server through the adapter, keeps a transformers copy of the model as the
teacher, and prints one JSON summary on stdout (progress and the server's log go to stderr).
Exit code: 0 when every check passed, 1 when one failed, 2 when a prerequisite is missing.

  wire_format        a raw /generate answer: output_ids equal the ids of
                     meta_info.output_token_logprobs; the fields the adapter reads are there
  logprobs           temperature-1 samples: the adapter's logprobs against a teacher-forced
                     forward pass of the same tokens, within bf16 tolerances
  tempered_logprobs  at temperature 0.7: do the logprobs follow the tempered distribution
                     (what importance ratios need) or the raw one? Either passes; see "follows"
  stop_token         a stop token ends the turn, stays the last id, finish reason STOP
  abort              abort() of a running request returns FinishReason.ABORT with its tokens
  weight_sync        the server joins a weight group that turnrl's own rank 0 forms
                     (turnrl.weight_group); pauses with a request in flight; receives every
                     parameter (final norm scaled by 0.7) in buckets; resumes. The request
                     finishes across the push, new samples match the changed teacher (not the
                     old one) and carry policy version 1
  shutdown           close() stops the server: its URL no longer answers

With one GPU the weight group uses gloo (NCCL refuses two ranks on one device); with two or
more the teacher sits on cuda:1 and the group uses NCCL, as in training.
"""

import argparse
import asyncio
import datetime
import importlib.util
import json
import shlex
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import torch

from rollout_svc.engines.base import FinishReason, GenerateOutput, SamplingParams
from rollout_svc.engines.sglang import SglangEngine, SglangEngineOptions
from rollout_svc.engines.sglang_server import SglangLaunchOptions
from turnrl.weight_group import broadcast, form_group, host_store

DEFAULT_SGLANG_ARGS = "--dtype bfloat16 --mem-fraction-static 0.5 --disable-cuda-graph"
GROUP_NAME = "turnrl_gpu_check"
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning, how are you?' into German.",
    "What is 17 times 23? Show your steps.",
    "Name a famous painting by Vermeer and describe it briefly.",
    "Give one tip for writing readable Python code.",
)
LONG_PROMPT = "Tell a very long, detailed story about a lighthouse keeper, chapter by chapter."
BUCKET_BYTES = 256 * 1024 * 1024
# The engine's context (it refuses longer prompts); every prompt here is far shorter.
MAX_MODEL_LEN = 8192


@dataclass
class Context:
    args: argparse.Namespace
    engine: SglangEngine
    tokenizer: object
    teacher: torch.nn.Module
    prompts: list[list[int]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_path", help="local model directory (HF format)")
    parser.add_argument("--port", type=int, default=0, help="server port; 0 picks a free one")
    parser.add_argument(
        "--sglang-args",
        default=DEFAULT_SGLANG_ARGS,
        help=f"extra sglang.launch_server arguments (default: {DEFAULT_SGLANG_ARGS!r}); keep "
        "--mem-fraction-static low enough for the teacher copy on the same GPU",
    )
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts")
    parser.add_argument("--mean-abs-tolerance", type=float, default=0.05)
    parser.add_argument("--max-abs-tolerance", type=float, default=0.5)
    parser.add_argument("--weight-sync-backend", choices=("nccl", "gloo"), default=None)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--check-timeout", type=float, default=300.0, help="seconds per check")
    return parser.parse_args()


def progress(message: str) -> None:
    print(f"[gpu_check_sglang] {message}", file=sys.stderr, flush=True)


def encode(tokenizer, prompt: str) -> list[int]:
    if not tokenizer.chat_template:
        return tokenizer.encode(prompt)
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def load_teacher(model_path: str, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    return model.to(device).eval()


@torch.inference_mode()
def teacher_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0
) -> list[float]:
    """Logprob of each output token given everything before it, from one forward pass."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + output_ids], device=device)
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    targets = torch.tensor(output_ids, device=device)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1).tolist()


def compare(engine_logprobs: list[list[float]], teacher: list[list[float]]) -> dict:
    diffs = [
        abs(a - b)
        for e, t in zip(engine_logprobs, teacher, strict=True)
        for a, b in zip(e, t, strict=True)
    ]
    if not diffs:
        return {"tokens": 0, "mean_abs_diff": float("nan"), "max_abs_diff": float("nan")}
    return {
        "tokens": len(diffs),
        "mean_abs_diff": sum(diffs) / len(diffs),
        "max_abs_diff": max(diffs),
        "share_over_0.1": sum(d > 0.1 for d in diffs) / len(diffs),
    }


def within(stats: dict, args: argparse.Namespace) -> bool:
    return stats["tokens"] > 0 and (
        stats["mean_abs_diff"] <= args.mean_abs_tolerance
        and stats["max_abs_diff"] <= args.max_abs_tolerance
    )


async def sample_all(ctx: Context, tag: str, temperature: float) -> list[GenerateOutput]:
    return list(
        await asyncio.gather(
            *(
                ctx.engine.generate(
                    prompt,
                    SamplingParams(max_new_tokens=ctx.args.max_new_tokens, temperature=temperature),
                    request_id=f"check-{tag}-{index}",
                )
                for index, prompt in enumerate(ctx.prompts)
            )
        )
    )


async def teacher_all(ctx: Context, outputs: list[GenerateOutput], temperature: float = 1.0):
    return [
        await asyncio.to_thread(teacher_logprobs, ctx.teacher, prompt, out.output_ids, temperature)
        for prompt, out in zip(ctx.prompts, outputs, strict=True)
    ]


async def check_wire_format(ctx: Context) -> dict:
    body = {
        "rid": "check-wire",
        "input_ids": ctx.prompts[0],
        "sampling_params": {
            "max_new_tokens": 16,
            "temperature": 1.0,
            "no_stop_trim": True,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    async with httpx.AsyncClient(trust_env=False, timeout=ctx.args.check_timeout) as client:
        reply = (
            (await client.post(f"{ctx.engine.url}/generate", json=body)).raise_for_status().json()
        )
    meta = reply["meta_info"]
    triple_ids = [token_id for _, token_id, _ in meta["output_token_logprobs"]]
    return {
        "ok": reply.get("output_ids") == triple_ids and isinstance(meta.get("finish_reason"), dict),
        "output_ids_match_logprob_ids": reply.get("output_ids") == triple_ids,
        "finish_reason": meta.get("finish_reason"),
        "meta_info_keys": sorted(meta),
        "weight_version": meta.get("weight_version"),
        "weight_versions": meta.get("weight_versions"),
    }


async def check_logprobs(ctx: Context) -> dict:
    outputs = await sample_all(ctx, "logprobs", temperature=1.0)
    stats = compare([o.logprobs for o in outputs], await teacher_all(ctx, outputs))
    finish_reasons = [o.finish_reason.value for o in outputs]
    return {"ok": within(stats, ctx.args), **stats, "finish_reasons": finish_reasons}


async def check_tempered_logprobs(ctx: Context) -> dict:
    outputs = await sample_all(ctx, "tempered", temperature=0.7)
    engine = [o.logprobs for o in outputs]
    tempered = compare(engine, await teacher_all(ctx, outputs, temperature=0.7))
    raw = compare(engine, await teacher_all(ctx, outputs, temperature=1.0))
    follows = "tempered" if tempered["mean_abs_diff"] <= raw["mean_abs_diff"] else "raw"
    best = tempered if follows == "tempered" else raw
    return {"ok": within(best, ctx.args), "follows": follows, "tempered": tempered, "raw": raw}


async def check_stop_token(ctx: Context) -> dict:
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    first = await ctx.engine.generate(ctx.prompts[0], greedy, "check-stop-free")
    if len(first.output_ids) < 2:
        return {"ok": False, "error": f"greedy output too short: {first.output_ids}"}
    stop_id = first.output_ids[min(3, len(first.output_ids) - 1)]
    expected = first.output_ids[: first.output_ids.index(stop_id) + 1]
    stopped = await ctx.engine.generate(
        ctx.prompts[0],
        SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(stop_id,)),
        "check-stop",
    )
    return {
        "ok": stopped.finish_reason is FinishReason.STOP and stopped.output_ids == expected,
        "stop_id": stop_id,
        "output_ids": stopped.output_ids,
        "expected": expected,
        "finish_reason": stopped.finish_reason.value,
    }


async def check_abort(ctx: Context) -> dict:
    prompt = encode(ctx.tokenizer, LONG_PROMPT)
    sampling = SamplingParams(max_new_tokens=4096, temperature=1.0)
    task = asyncio.create_task(ctx.engine.generate(prompt, sampling, "check-abort"))
    await asyncio.sleep(1.0)  # a script, not a test: let it decode for a while
    await ctx.engine.abort("check-abort")
    output = await task
    return {
        "ok": output.finish_reason is FinishReason.ABORT and 0 < len(output.output_ids) < 4096,
        "finish_reason": output.finish_reason.value,
        "tokens_before_abort": len(output.output_ids),
        "logprobs_match_ids": len(output.logprobs) == len(output.output_ids),
    }


def final_norm(model: torch.nn.Module) -> tuple[str, torch.nn.Parameter]:
    """The final norm's scale: the last one-dimensional weight (model.norm, transformer.ln_f)."""
    scales = [(n, p) for n, p in model.named_parameters() if p.dim() == 1 and n.endswith("weight")]
    if not scales:
        raise RuntimeError("the model has no one-dimensional weight to change")
    return scales[-1]


def buckets(model: torch.nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    result, size = [[]], 0
    for name, param in model.named_parameters():
        if size > BUCKET_BYTES:
            result.append([])
            size = 0
        result[-1].append((name, param.detach()))
        size += param.numel() * param.element_size()
    return result


def broadcast_bucket(bucket: list[tuple[str, torch.Tensor]], group) -> None:
    for _, tensor in bucket:
        broadcast(group, tensor.contiguous())


async def check_weight_sync(ctx: Context) -> dict:
    backend = ctx.args.weight_sync_backend or ("nccl" if torch.cuda.device_count() > 1 else "gloo")
    timeout = datetime.timedelta(seconds=120)
    # turnrl's own rank 0 (turnrl.weight_group), as the trainer forms the group.
    store = host_store("127.0.0.1", 0, 2, timeout)
    progress(f"weight sync: joining group {GROUP_NAME!r} over {backend} on port {store.port}")
    _, group = await asyncio.gather(
        ctx.engine.join_weight_sync("127.0.0.1", store.port, 2, 1, backend, GROUP_NAME, 120),
        asyncio.to_thread(form_group, store, 0, 2, backend, GROUP_NAME, timeout),
    )
    norm_name, norm = final_norm(ctx.teacher)
    original = norm.detach().clone()
    with torch.no_grad():
        norm.mul_(0.7)

    long_prompt = encode(ctx.tokenizer, LONG_PROMPT)
    in_flight = asyncio.create_task(
        ctx.engine.generate(long_prompt, SamplingParams(max_new_tokens=512), "check-in-flight")
    )
    await asyncio.sleep(1.0)  # let it decode under version 0 first
    await ctx.engine.pause()
    started = time.monotonic()
    parts = buckets(ctx.teacher)
    for index, bucket in enumerate(parts):
        await asyncio.gather(
            ctx.engine.update_weights_from_distributed(
                [name for name, _ in bucket],
                [tensor.dtype for _, tensor in bucket],
                [list(tensor.shape) for _, tensor in bucket],
                policy_version=1,
                group_name=GROUP_NAME,
                flush_cache=index == len(parts) - 1,
            ),
            asyncio.to_thread(broadcast_bucket, bucket, group),
        )
    push_seconds = time.monotonic() - started
    await ctx.engine.resume()
    spanning = await in_flight

    outputs = await sample_all(ctx, "after-push", temperature=1.0)
    engine_logprobs = [o.logprobs for o in outputs]
    changed = compare(engine_logprobs, await teacher_all(ctx, outputs))
    spanning_changed = await asyncio.to_thread(
        teacher_logprobs, ctx.teacher, long_prompt, spanning.output_ids
    )
    with torch.no_grad():
        norm.copy_(original)
    unchanged = compare(engine_logprobs, await teacher_all(ctx, outputs))
    spanning_original = await asyncio.to_thread(
        teacher_logprobs, ctx.teacher, long_prompt, spanning.output_ids
    )

    # Each token of the request that spanned the push, against the weights that sampled it.
    def of_version(values: list[float], version: int) -> list[list[float]]:
        return [[x for x, v in zip(values, spanning.policy_versions, strict=True) if v == version]]

    segments = {
        version: compare(of_version(spanning.logprobs, version), of_version(teacher, version))
        for version, teacher in ((0, spanning_original), (1, spanning_changed))
    }
    # Servers without per-token weight_versions label every token 1: nothing to judge then.
    spans_reported = all(segment["tokens"] > 0 for segment in segments.values())
    versions = [v for o in outputs for v in o.policy_versions]
    return {
        "ok": within(changed, ctx.args)
        and unchanged["mean_abs_diff"] > 2 * changed["mean_abs_diff"]
        and set(versions) == {1}
        and ctx.engine.policy_version == 1
        and spanning.finish_reason is not FinishReason.ABORT
        and (not spans_reported or all(within(s, ctx.args) for s in segments.values())),
        "backend": backend,
        "changed_parameter": norm_name,
        "buckets": len(parts),
        "push_seconds": push_seconds,
        "vs_changed_teacher": changed,
        "vs_original_teacher": unchanged,
        "in_flight_finish_reason": spanning.finish_reason.value,
        "in_flight_versions_reported": spans_reported,
        "in_flight_vs_sampling_weights": {str(v): s for v, s in segments.items()},
    }


async def check_shutdown(url: str) -> dict:
    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
        try:
            await client.get(f"{url}/health_generate")
        except httpx.TransportError:
            return {"ok": True}
    return {"ok": False, "error": f"{url} still answers after close()"}


async def run_check(name: str, check: Callable[[], Awaitable[dict]], limit_seconds: float) -> dict:
    progress(f"check {name} ...")
    started = time.monotonic()
    try:
        async with asyncio.timeout(limit_seconds):
            result = await check()
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    result["seconds"] = round(time.monotonic() - started, 2)
    progress(f"check {name}: {'passed' if result['ok'] else 'FAILED'}")
    return result


async def run(args: argparse.Namespace) -> dict:
    import sglang
    from transformers import AutoTokenizer

    summary: dict = {
        "model_path": args.model_path,
        "sglang_version": getattr(sglang, "__version__", "unknown"),
        "torch_version": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "checks": {},
    }
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    prompts = [encode(tokenizer, prompt) for prompt in PROMPTS[: args.prompts]]
    launch = SglangLaunchOptions(port=args.port, extra_args=tuple(shlex.split(args.sglang_args)))
    options = SglangEngineOptions(launch=launch, startup_timeout_seconds=args.startup_timeout)
    progress(f"launching SGLang for {args.model_path} (this takes a minute or more)")
    started = time.monotonic()
    engine = await SglangEngine.create(options, args.model_path, MAX_MODEL_LEN)
    summary["startup_seconds"] = round(time.monotonic() - started, 1)
    try:
        teacher_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
        teacher = await asyncio.to_thread(load_teacher, args.model_path, teacher_device)
        ctx = Context(args, engine, tokenizer, teacher, prompts)
        checks = {
            "wire_format": check_wire_format,
            "logprobs": check_logprobs,
            "tempered_logprobs": check_tempered_logprobs,
            "stop_token": check_stop_token,
            "abort": check_abort,
            "weight_sync": check_weight_sync,  # last: it leaves changed weights in the server
        }
        for name, check in checks.items():
            summary["checks"][name] = await run_check(
                name, lambda c=check: c(ctx), args.check_timeout
            )
        summary["engine_stats"] = engine.stats()
    finally:
        await engine.close()
    summary["checks"]["shutdown"] = await run_check(
        "shutdown", lambda: check_shutdown(engine.url), 30
    )
    summary["ok"] = all(check["ok"] for check in summary["checks"].values())
    return summary


def main() -> int:
    args = parse_args()
    missing = []
    if importlib.util.find_spec("sglang") is None:
        missing.append("sglang is not importable in this Python (pip install 'sglang[srt]')")
    if not torch.cuda.is_available():
        missing.append("no CUDA device is visible")
    if missing:
        print(json.dumps({"ok": False, "missing": missing}, indent=2))
        return 2
    summary = asyncio.run(run(args))
    print(json.dumps(summary, indent=2, default=str))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
