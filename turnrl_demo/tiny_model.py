"""A tiny Qwen3 model that has learned one tool's call format, built locally and cached: the
demos' policies and the tests' model. An example of a model, not part of the core.

A model learns one task (`TinyModelSettings.task`): the calculator (arithmetic word problems,
`turnrl.calculator_data`), search (questions about a generated world answered from its corpus
through the `search` tool, `turnrl.search_world`) or code (large-number word problems computed by
the `python` tool, `turnrl.code_problems`).

Tests and the CPU demo need a real transformers model that writes tool calls, and nothing may
be downloaded. `build_tiny_model` makes one from scratch in 10-15 minutes on two CPU cores:

1. a byte-level BPE tokenizer trained on the task's rendered conversations, with Qwen2.5's chat
   tokens and turnrl's own ChatML template (`turnrl/chat_template.jinja`);
2. a randomly initialised Qwen3 model of about 0.4M parameters (2 layers, width 128);
3. supervised fine-tuning on those conversations by the trainer's own SFT
   (`trainer_svc.sft.sft_in_process`: the loss on the assistant's tokens only, batches, AdamW
   and LR schedule of the settings' `sft` and `optim`), so that greedy decoding writes
   the task's tool call (`<tool_call>{"name": "calculator", ...}</tool_call>`) and, after the
   tool's response, the answer it gives (`#### <the tool's number>`).

The result is saved with `save_pretrained` into a folder named by a hash of the settings, the
template and FORMAT_VERSION; the folder appears by an atomic rename, so a folder that exists is
complete and later calls return it at once.

A build is not reproducible: two containers of one image built tokenizers of 667 and 668
tokens from the same settings, and float rounding differs between CPUs, and the demo's outcome
depends on the model it starts from (a build on another machine plateaued at 0.69-0.75
held-out accuracy). So the models of the default settings (the tests') and of
`examples/calculator/config.yaml` (the demo's) ship with the package, in `SHIPPED_MODELS_DIR`
under the folder names a build would get: every machine and every service of a run loads the
same bytes, and nothing is built. `scripts/ship_tiny_models.py` rebuilds them.
"""

import copy
import hashlib
import json
import logging
import random
import re
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils.chat_template_utils import render_jinja_template

from tool_svc.tools.calculator import CalculatorOptions, CalculatorTool, format_value
from tool_svc.tools.image_zoom import ImageZoomTool
from tool_svc.tools.python import PythonTool
from tool_svc.tools.search import (
    DEFAULT_MAX_TOPK,
    Bm25Index,
    SearchOptions,
    format_passages,
    search_schema,
)
from trainer_svc.config import DEFAULT_JUDGE_RUBRIC
from trainer_svc.data import ConversationRecord
from trainer_svc.judge_training import judge_prompt
from trainer_svc.sft import sft_in_process, tokenize_conversations
from turnrl import calculator_data, code_problems, search_world, zoom_digits
from turnrl.chat_tokens import CHAT_TEMPLATE
from turnrl.config import cache_dir
from turnrl.vision import VisionProcessor
from turnrl_demo import tiny_vlm
from turnrl_demo.settings import TinyModelSettings

logger = logging.getLogger(__name__)

# Bump when the build's code changes: settings, seed, template and training data are in the
# cache key already. Folders of other versions are ignored. 4: fine-tuned by trainer_svc.sft.
FORMAT_VERSION = 4
# Built models shipped with the package, in folders named as the cache names them.
SHIPPED_MODELS_DIR = Path(__file__).with_name("models")
# What the judge's SFT conversations judge, and each one's share: the solved conversation; the
# guess; the call with its first number miscopied from the question (the tool's result of that
# copied into the answer: the mistake a policy rewarded for calling the tool makes first); the
# right call with a miscopied answer.
JUDGED_TRANSCRIPTS = {"solved": 0.5, "guess": 0.2, "miscopied_call": 0.15, "miscopied_answer": 0.15}
CALCULATOR = CalculatorTool("calculator", CalculatorOptions())
# Qwen2.5's chat tokens: the special ones, then the tool-call markers it has as plain added tokens.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Qwen2's pre-tokenization: words, single digits (so numbers are copied digit by digit),
# punctuation runs, whitespace.
PRE_TOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tiny_model(
    models_dir: Path | None = None, seed: int = 0, settings: TinyModelSettings | None = None
) -> Path:
    """The folder of the tiny calculator model for `seed` and `settings`: the one shipped in
    `SHIPPED_MODELS_DIR`, or else one built on first use into `models_dir` (default
    `turnrl.config.cache_dir()`/tiny_models).

    The folder loads with `AutoModelForCausalLM.from_pretrained` and
    `AutoTokenizer.from_pretrained`. A build blocks for 10-15 minutes of two cores (call it from
    a worker thread in async code); a shipped or cached folder returns at once. A failed build
    leaves no folder behind.
    """
    settings = settings or TinyModelSettings()
    models_dir = models_dir or cache_dir() / "tiny_models"
    vision = settings.task == "zoom"
    chat_template = (tiny_vlm.CHAT_TEMPLATE if vision else CHAT_TEMPLATE).read_text()
    conversations = training_conversations(settings, seed)
    judges = judge_conversations(settings, seed)
    key = _cache_key(settings, seed, chat_template, conversations + judges)
    name = f"{'qwen2.5-vl' if vision else 'qwen3'}-{settings.task}-{key}"
    if (SHIPPED_MODELS_DIR / name).is_dir():
        return SHIPPED_MODELS_DIR / name
    target = models_dir / name
    if target.is_dir():
        logger.info("tiny model: reusing %s", target)
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=models_dir))
    try:
        _build(building, settings, seed, chat_template, conversations, judges)
        try:
            building.rename(target)
        except OSError:
            # Another process finished the same build first; its folder is just as good.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    logger.info("tiny model: saved %s", target)
    return target


def training_conversations(settings: TinyModelSettings, seed: int) -> list[list[dict[str, Any]]]:
    """The SFT conversations: solved training problems of the task, `guess_share` of them
    answering at once with a guess, without the tool (which ones is drawn from the seed)."""
    count, guesses = settings.train_problems, random.Random(f"guesses:{seed}")
    if settings.task == "search":
        questions = search_world.generate_questions(count, seed=seed, split="train")
        answers = _world_search_answers([question.town for question in questions])
        return [
            question.guess_messages
            if guesses.random() < settings.guess_share
            else question.messages(answers.__getitem__)
            for question in questions
        ]
    if settings.task == "zoom":
        images = zoom_digits.generate_problems(count, seed=seed, split="train")
        zoomed = tiny_vlm.zoomed_tool_messages(images)
        return [
            image.guess_messages
            if guesses.random() < settings.guess_share
            else image.messages(zoomed.__getitem__)
            for image in images
        ]
    problems = (
        calculator_data.generate_problems(
            count, seed=seed, split="train", settings=settings.problems
        )
        if settings.task == "calculator"
        else code_problems.generate_problems(count, seed=seed, split="train")
    )
    # A stream of its own, so that the guesses of the models built before calls_shown stay.
    cut_short = random.Random(f"cut short:{seed}")

    def conversation(
        problem: calculator_data.CalculatorProblem | code_problems.CodeProblem,
    ) -> list[dict[str, Any]]:
        if guesses.random() < settings.guess_share:
            return problem.guess_messages
        if cut_short.random() < settings.calls_shown_share:
            return _shown_calls(problem.messages, settings.calls_shown)
        return problem.messages

    return [conversation(problem) for problem in problems]


def _shown_calls(messages: list[dict[str, Any]], calls_shown: int) -> list[dict[str, Any]]:
    """`messages` up to the result of its `calls_shown`-th call, then an answer with that
    result; all of `messages` when it makes no more calls, or `calls_shown` is 0."""
    results = [i for i, message in enumerate(messages) if message["role"] == "tool"]
    if not calls_shown or len(results) <= calls_shown:
        return messages
    last = results[calls_shown - 1]
    answer = {"role": "assistant", "content": f"#### {messages[last]['content']}"}
    return [*messages[: last + 1], answer]


def judge_conversations(settings: TinyModelSettings, seed: int) -> list[list[dict[str, Any]]]:
    """The judge's SFT conversations (`judge_share`; the calculator task only): for that share
    of the training problems, the prompt a co-trained judge gets (`trainer_svc.judge_training`,
    its default rubric) on one of JUDGED_TRANSCRIPTS, and the verdict the task's answer gives,
    `judge_noise` of them flipped."""
    if not settings.judge_share:
        return []
    draws = random.Random(f"judges:{seed}")
    problems = calculator_data.generate_problems(
        settings.train_problems, seed=seed, split="train", settings=settings.problems
    )
    kinds, shares = zip(*JUDGED_TRANSCRIPTS.items(), strict=True)
    conversations = []
    for problem in problems:
        if draws.random() >= settings.judge_share:
            continue
        judged = _judged_transcript(problem, draws.choices(kinds, shares)[0], draws)
        right = calculator_data.final_answer(judged[-1]["content"]) == str(problem.answer)
        if draws.random() < settings.judge_noise:
            right = not right
        prompt = judge_prompt(judged, DEFAULT_JUDGE_RUBRIC)
        verdict = f"Verdict: {'yes' if right else 'no'}"
        conversations.append(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": verdict}]
        )
    return conversations


def _judged_transcript(
    problem: calculator_data.CalculatorProblem, kind: str, draws: random.Random
) -> list[dict[str, Any]]:
    """The policy's messages of one JUDGED_TRANSCRIPTS kind on `problem`."""
    if kind == "solved":
        return problem.messages
    if kind == "guess":
        return problem.guess_messages
    messages = copy.deepcopy(problem.messages)
    *_, call, result, answer = messages
    if kind == "miscopied_call":
        arguments = call["tool_calls"][0]["function"]["arguments"]
        first = re.search(r"\d+", arguments["expression"])
        miscopied = _another_number(int(first[0]), draws)
        expression = f"{arguments['expression'][: first.start()]}{miscopied}"
        arguments["expression"] = expression + arguments["expression"][first.end() :]
        result["content"] = format_value(CALCULATOR.evaluate(arguments["expression"]))
        answer["content"] = f"#### {result['content']}"
    else:  # miscopied_answer
        answer["content"] = f"#### {_another_number(int(result['content']), draws)}"
    return messages


def _another_number(number: int, draws: random.Random) -> int:
    """A number near `number` and not it, never negative."""
    offset = draws.randint(1, 9)
    below = number - offset
    return below if below >= 0 and draws.random() < 0.5 else number + offset


def task_tools(settings: TinyModelSettings) -> list[dict[str, Any]]:
    """The schemas of the task's tool as the tool service serves them: what the conversations
    render, so the model learns the schema it is shown."""
    schema = {
        "calculator": calculator_data.CALCULATOR_TOOL["function"],
        "search": search_schema(DEFAULT_MAX_TOPK),
        "code": PythonTool.schema,
        "zoom": ImageZoomTool.schema,
    }[settings.task]
    return [{"type": "function", "function": schema}]


def _world_search_answers(queries: list[str]) -> dict[str, str]:
    """The `search` tool's answer to each query over the generated world's corpus, with the
    tool's defaults (BM25 over the same corpus, top 3, Search-R1's rendering)."""
    with tempfile.TemporaryDirectory(prefix="turnrl-search-world-") as folder:
        corpus = Path(folder) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(row) + "\n" for row in search_world.corpus_rows()))
        options = SearchOptions(corpus_path=corpus)
        index = Bm25Index.open(corpus, Path(folder) / "index", k1=options.bm25_k1, b=options.bm25_b)
        return {
            query: format_passages(passages)
            for query, passages in zip(queries, index.search(queries, options.topk), strict=True)
        }


def _cache_key(
    settings: TinyModelSettings,
    seed: int,
    chat_template: str,
    conversations: list[list[dict[str, Any]]],
) -> str:
    """A hash of everything the build reads, so a change to any of it builds anew."""
    described = json.dumps(
        {
            "format_version": FORMAT_VERSION,
            "seed": seed,
            # shared_prefix_forward shapes the forwards of RL groups only (an SFT batch has
            # none), so it leaves the build, and the shipped folders' names, as they were. The
            # task names the folder and decides the conversations: left out too, so the
            # calculator models keep the names they shipped under before there were tasks.
            "settings": _described_settings(settings),
            "chat_template_sha256": _sha256(chat_template),
            "conversations_sha256": _sha256(json.dumps(conversations, sort_keys=True)),
        },
        sort_keys=True,
    )
    return _sha256(described)[:16]


def _described_settings(settings: TinyModelSettings) -> dict[str, Any]:
    """The settings that go into the cache key. shared_prefix_forward shapes the forwards of RL
    groups only (an SFT batch has none), so it is left out, and the shipped folders keep their
    names. The task names the folder and decides the conversations: left out too, so the
    calculator models keep the names they shipped under before there were tasks; and so are
    the judge's settings while there is no judge, calls_shown (with its share) while it is
    0, and packed micro-batches while off, for the models shipped before them."""
    described = settings.model_dump(
        mode="json", exclude={"task": True, "optim": {"shared_prefix_forward"}}
    )
    if not settings.judge_share:
        del described["judge_share"], described["judge_noise"]
    if not settings.calls_shown:
        del described["calls_shown"], described["calls_shown_share"]
    if not settings.optim.pack_sequences:
        del described["optim"]["pack_sequences"]
    return described


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _build(
    folder: Path,
    settings: TinyModelSettings,
    seed: int,
    chat_template: str,
    conversations: list[list[dict[str, Any]]],
    judges: list[list[dict[str, Any]]],
) -> None:
    """Trains the tokenizer, makes the new model, fine-tunes it by the trainer's SFT on the
    task's `conversations` (with its tool) and the `judges`' (without) and saves both into
    `folder`."""
    started = time.monotonic()
    logger.info("tiny model: building into %s", folder)
    vision = settings.task == "zoom"
    tokenizer = _train_tokenizer(
        conversations + judges,
        chat_template,
        task_tools(settings),
        settings.vocab_size,
        settings.max_position_embeddings,
        list(tiny_vlm.VISION_TOKENS) if vision else [],
    )
    logger.info(
        "tiny model: tokenizer of %d tokens trained in %.1f s",
        len(tokenizer),
        time.monotonic() - started,
    )
    records = [
        ConversationRecord(f"tiny-model-{i}", messages, task_tools(settings))
        for i, messages in enumerate(conversations)
    ] + [ConversationRecord(f"tiny-judge-{i}", messages, None) for i, messages in enumerate(judges)]
    model = _new_model(tokenizer, settings, seed)
    # The SFT starts from a Hugging Face folder: the new model's, apart from the result.
    initial = folder / "initial"
    model.save_pretrained(initial)
    processor = None
    if vision:
        tiny_vlm.save_image_processor(initial)
        tiny_vlm.save_image_processor(folder)
        processor = VisionProcessor(initial)
        accuracy = tiny_vlm.pretrain_vision_tower(model, conversations, processor, seed)
        logger.info("tiny model: vision tower pretrained, probe accuracy %.2f", accuracy)
        model.save_pretrained(initial)
    examples = tokenize_conversations(tokenizer, records, settings.sft.max_length, vision=processor)
    logger.info(
        "tiny model: %d parameters, %d examples of %d tokens on average",
        sum(parameter.numel() for parameter in model.parameters()),
        len(examples),
        sum(len(example.token_ids) for example in examples) // len(examples),
    )
    models = sft_in_process(
        initial,
        examples,
        tokenizer.pad_token_id,
        sft=settings.sft,
        optim=settings.optim,
        steps=settings.train_steps,
        seed=seed,
        on_step=partial(_log_step, started=time.monotonic()),
    )
    # One unsharded model in this process: transformers' own save keeps the tied embeddings one
    # tensor (FsdpPolicy.save_pretrained's snapshot would write the head a second time).
    models.policy.model.save_pretrained(folder)
    models.policy.close()
    shutil.rmtree(initial)
    # The chat template goes into tokenizer_config.json, as in Qwen2.5's own repositories.
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    logger.info("tiny model: built in %.1f s", time.monotonic() - started)


def _log_step(step: int, total_steps: int, metrics: dict[str, float], started: float) -> None:
    if step % 50 == 1 or step == total_steps:
        logger.info(
            "tiny model: step %d/%d loss %.4f (%.1f s)",
            step,
            total_steps,
            metrics["loss"],
            time.monotonic() - started,
        )


def _train_tokenizer(
    conversations: list[list[dict[str, Any]]],
    chat_template: str,
    tools: list[dict[str, Any]],
    vocab_size: int,
    max_length: int,
    vision_tokens: list[str],
) -> PreTrainedTokenizerFast:
    """A byte-level BPE over the rendered conversations, wrapped with Qwen2.5's chat tokens
    and, for a vision-language model, its `vision_tokens` (special, after the others)."""
    rendered = render_jinja_template(conversations, tools=tools, chat_template=chat_template)[0]
    # The chat tokens are added whole afterwards; merges are learned on the text between them.
    added = SPECIAL_TOKENS + TOOL_TOKENS + vision_tokens
    chat_tokens = re.compile("|".join(re.escape(token) for token in added))
    corpus = [piece for text in rendered for piece in chat_tokens.split(text) if piece]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    # Qwen2.5's order after the BPE: the special tokens, then the tool markers, which are
    # ordinary added tokens there, so decoding with skip_special_tokens keeps them.
    bpe.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    bpe.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    bpe.add_special_tokens([AddedToken(token, special=True) for token in vision_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=["<|im_start|>", "<|im_end|>", *vision_tokens],
        chat_template=chat_template,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def _new_model(
    tokenizer: PreTrainedTokenizerFast, settings: TinyModelSettings, seed: int
) -> Qwen3ForCausalLM | Qwen2_5_VLForConditionalGeneration:
    """A random Qwen3 of the settings' shape, or for the zoom task a Qwen2.5-VL."""
    if settings.task == "zoom":
        config = tiny_vlm.vision_model_config(tokenizer, settings)
        return _seeded_model(Qwen2_5_VLForConditionalGeneration, config, tokenizer, seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=settings.num_attention_heads,
        num_key_value_heads=settings.num_key_value_heads,
        head_dim=settings.hidden_size // settings.num_attention_heads,
        intermediate_size=settings.intermediate_size,
        max_position_embeddings=settings.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    return _seeded_model(Qwen3ForCausalLM, config, tokenizer, seed)


def _seeded_model(model_class: type, config: Any, tokenizer: PreTrainedTokenizerFast, seed: int):
    """`model_class(config)` initialised from `seed`, generating until the tokenizer's EOS."""
    with torch.random.fork_rng():  # the caller's random state is left as it was
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
