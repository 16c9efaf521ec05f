"""What the hf engine tests share: a tiny random Qwen3 saved to disk and loaded for reference,
an engine on it, and helpers that drive the engine and check it against transformers.

The fixtures are taken by importing them into a test module (`from ... import engine as
engine`: the redundant alias tells ruff the import is used).
"""

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from rollout_svc.engines.base import GenerateOutput, SamplingParams
from rollout_svc.engines.hf import HfEngine
from rollout_svc.engines.hf_options import HfEngineOptions

VOCAB_SIZE = 512
MAX_MODEL_LEN = 512
# Long enough that a batch mate finishes and the test reacts while this one still runs.
LONG_TOKENS = 480
LOGPROB_TOLERANCE = 1e-4


def tiny_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; OpenMP's threads crawl when another process is
    busy on the same cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A random tiny Qwen3 with no EOS id, so greedy runs go to max_new_tokens, and the tiny
    calculator model's tokenizer (its vocabulary holds the model's), for stop strings."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-qwen3")
    Qwen3ForCausalLM(tiny_config()).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Qwen3ForCausalLM:
    """The same model, loaded directly, to check the engine against."""
    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


async def start_engine(model_dir: Path, **options: object) -> HfEngine:
    return await HfEngine.create(HfEngineOptions(**options), str(model_dir), MAX_MODEL_LEN)


@pytest.fixture
async def engine(model_dir: Path) -> AsyncIterator[HfEngine]:
    engine = await start_engine(model_dir)
    yield engine
    await engine.close()


def random_ids(length: int, seed: int) -> list[int]:
    return torch.randint(
        0, VOCAB_SIZE, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def greedy(max_new_tokens: int, **sampling: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **sampling)


@torch.no_grad()
def generate_reference(
    model: Qwen3ForCausalLM, prompt: list[int], max_new_tokens: int, **kwargs: object
) -> list[int]:
    output = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, **kwargs
    )
    return output[0, len(prompt) :].tolist()


@torch.no_grad()
def teacher_forced_logprobs(
    model: Qwen3ForCausalLM, prompt: list[int], output_ids: list[int]
) -> list[float]:
    logits = model(torch.tensor([prompt + output_ids])).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(output_ids)[:, None])[:, 0].tolist()


def assert_logprobs_match(model: Qwen3ForCausalLM, prompt: list[int], out: GenerateOutput) -> None:
    expected = teacher_forced_logprobs(model, prompt, out.output_ids)
    assert out.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


async def submitted(
    engine: HfEngine, call: Coroutine[None, None, GenerateOutput]
) -> asyncio.Task[GenerateOutput]:
    """Starts a generate() call as a task and returns once the engine holds its request. The
    check below needs the engine paused or no other request about to finish."""
    before = engine.stats()
    task = asyncio.create_task(call)
    # generate() submits before its first await, so one pass of the loop runs it that far.
    await asyncio.sleep(0)
    after = engine.stats()
    assert after["waiting"] + after["running"] == before["waiting"] + before["running"] + 1
    return task


async def start_long(
    engine: HfEngine, model: Qwen3ForCausalLM, prompt: list[int], request_id: str
) -> asyncio.Task[GenerateOutput]:
    """Starts a greedy LONG_TOKENS request and returns once it has sampled at least 2 tokens:
    a 2-token probe queued behind it has finished (admission is first come, first served)."""
    task = await submitted(engine, engine.generate(prompt, greedy(LONG_TOKENS), request_id))
    probe_prompt = random_ids(3, seed=99)
    probe = await engine.generate(probe_prompt, greedy(2), f"{request_id}-probe")
    assert probe.output_ids == generate_reference(model, probe_prompt, 2)
    return task
