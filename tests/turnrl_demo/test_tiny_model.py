"""The tiny calculator model (turnrl_demo.tiny_model): it loads with the Auto classes, its
tokenizer speaks turnrl's ChatML template, it calls the calculator and copies the tool's result
into its answer, the tests' and the demo's ship with the package, any other is built once per
cache folder (fine-tuned by the trainer's SFT), and the wiring resolves a null model path to it.
The calculator data it learns from: tests/turnrl/test_calculator_data.py."""

import asyncio
import json
import re
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from tool_svc.config import ToolConfig
from tool_svc.service import ToolService
from tool_svc.tools.base import ToolCallError
from tool_svc.tools.calculator import CalculatorOptions, CalculatorTool, format_value
from trainer_svc.config import DEFAULT_JUDGE_RUBRIC, SftConfig, TrainSettings
from trainer_svc.judge_training import judge_prompt
from turnrl.calculator_data import (
    CALCULATOR_TOOL,
    TOOLS,
    ProblemSettings,
    final_answer,
    generate_problems,
)
from turnrl.chat_tokens import CHAT_TEMPLATE, conversation_ids_and_loss_mask
from turnrl.config import REPO_ROOT
from turnrl_cli.model_paths import load_with_tiny_model
from turnrl_cli.project_config import load_project_config
from turnrl_demo.settings import TinyModelSettings
from turnrl_demo.tiny_model import (
    JUDGED_TRANSCRIPTS,
    SHIPPED_MODELS_DIR,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    build_tiny_model,
    judge_conversations,
    task_tools,
    training_conversations,
)

from ..turnrl.test_conversation_loss_mask import masked_runs

HELD_OUT_QUESTIONS = 20
# Measured with the default settings and seed 0: on these 20 questions 100% of first turns are
# calculator calls and 90% of final answers copy the last tool result; on 200 held-out
# questions, 100% and 92% (seeds 1 and 2: 100% and 95%, 93.5%). The bounds leave room for
# builds on other machines, whose float rounding differs.
MIN_TOOL_CALL_RATE = 0.9
MIN_ANSWER_COPY_RATE = 0.75
MAX_MODEL_TURNS = 4
MAX_NEW_TOKENS = 64
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@dataclass
class Episode:
    """A held-out problem played out: the model's turns and the calculator's results."""

    turns: list[str] = field(default_factory=list)
    tool_results: list[str] = field(default_factory=list)


def parse_tool_call(text: str) -> dict | None:
    """The calculator call in a model turn, or None when the turn holds no well-formed one."""
    match = TOOL_CALL.search(text)
    if match is None:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    arguments = call.get("arguments") if isinstance(call, dict) else None
    if call.get("name") != "calculator" or not isinstance(arguments, dict):
        return None
    return call if isinstance(arguments.get("expression"), str) else None


def play(model, tokenizer, messages: list[dict]) -> Episode:
    """Greedy turns until the model answers without a tool call; calls run the real calculator."""
    calculator = CalculatorTool("calculator", CalculatorOptions())
    episode = Episode()
    messages = list(messages)
    for _ in range(MAX_MODEL_TURNS):
        inputs = tokenizer.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        episode.turns.append(text)
        call = parse_tool_call(text)
        if call is None:
            break
        try:
            result = format_value(calculator.evaluate(call["arguments"]["expression"]))
        except ToolCallError as error:
            result = error.message
        episode.tool_results.append(result)
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": call}],
            }
        )
        messages.append({"role": "tool", "content": result})
    return episode


@pytest.fixture(scope="module")
def episodes(model, tokenizer) -> list[Episode]:
    problems = generate_problems(HELD_OUT_QUESTIONS, seed=0, split="test")
    return [play(model, tokenizer, problem.prompt_messages) for problem in problems]


def test_loads_as_a_float32_qwen3_with_tied_embeddings(model, tokenizer):
    assert model.config.model_type == "qwen3"
    assert model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_tokenizer_round_trips_text(tokenizer):
    for text in [
        "Tom has 12 apples. He buys 7 more.",
        "  spaces,\ttabs\nand newlines\n\n",
        "unseen words: Zürich, 東京, emoji 🙂, 3.14159",
    ]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_chat_tokens_are_single_ids(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    ids = [
        tokenizer.encode(token, add_special_tokens=False) for token in SPECIAL_TOKENS + TOOL_TOKENS
    ]
    assert all(len(token_ids) == 1 for token_ids in ids), ids
    assert len({token_ids[0] for token_ids in ids}) == len(ids)
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_is_turnrls_and_renders_tools(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE.read_text()
    problem = generate_problems(1, seed=0)[0]
    text = tokenizer.apply_chat_template(problem.messages, tools=TOOLS, tokenize=False)
    assert json.dumps(CALCULATOR_TOOL) in text
    expression = problem.expressions[0]
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    result = problem.messages[3]["content"]
    assert f"<|im_start|>tool\n<tool_response>\n{result}\n</tool_response><|im_end|>" in text
    assert text.endswith(f"<|im_start|>assistant\n#### {problem.answer}<|im_end|>\n")
    ids = tokenizer.apply_chat_template(problem.prompt_messages, tools=TOOLS, return_dict=True)[
        "input_ids"
    ]
    assert tokenizer.decode(ids).endswith("<|im_start|>user\n" + problem.question + "<|im_end|>\n")


def test_training_examples_are_whole_renders_with_the_loss_on_assistant_turns(tokenizer):
    """What the build fine-tunes on (`conversation_ids_and_loss_mask`): the calculator
    conversations rendered whole, the loss on each tool call and the final answer, each through
    its `<|im_end|>`. These are the examples of FORMAT_VERSION 1's builder, token for token."""
    for problem in generate_problems(50, seed=0):
        ids, loss_mask = conversation_ids_and_loss_mask(tokenizer, problem.messages, TOOLS)
        assert ids == tokenizer.apply_chat_template(
            problem.messages, tools=TOOLS, return_dict=False
        )
        calls = [
            json.dumps({"name": "calculator", "arguments": {"expression": expression}})
            for expression in problem.expressions
        ]
        assert [tokenizer.decode(run) for run in masked_runs(ids, loss_mask)] == [
            *(f"<tool_call>\n{call}\n</tool_call><|im_end|>" for call in calls),
            f"#### {problem.answer}<|im_end|>",
        ]


def test_held_out_first_turns_are_calculator_calls(episodes):
    calls = [parse_tool_call(episode.turns[0]) for episode in episodes]
    rate = sum(call is not None for call in calls) / len(calls)
    assert rate >= MIN_TOOL_CALL_RATE, [episode.turns[0] for episode in episodes]


def test_final_answers_copy_the_last_tool_result(episodes):
    copied = [
        bool(episode.tool_results) and final_answer(episode.turns[-1]) == episode.tool_results[-1]
        for episode in episodes
    ]
    rate = sum(copied) / len(copied)
    assert rate >= MIN_ANSWER_COPY_RATE, [(e.turns, e.tool_results) for e in episodes]


def test_the_tests_and_the_examples_models_ship_and_nothing_else(tmp_path):
    """They resolve to the shipped folders without building (scripts/ship_tiny_models.py makes
    them anew when what a build reads changes), and no stale folder ships beside them."""
    configs = [
        REPO_ROOT / "examples" / task / "config.yaml"
        for task in ("calculator", "search", "code", "zoom")
    ]
    configs += [
        REPO_ROOT / "examples" / "calculator" / f for f in ("turn_credit.yaml", "judge.yaml")
    ]
    examples = [load_project_config(config).tiny_model for config in configs]
    folders = {
        build_tiny_model(tmp_path, settings=settings)
        for settings in (TinyModelSettings(), *examples)
    }
    assert len(folders) == 7
    tasks = {folder.name.rsplit("-", 2)[1] for folder in folders}
    assert tasks == {"calculator", "search", "code", "zoom"}
    assert {folder.parent for folder in folders} == {SHIPPED_MODELS_DIR}
    assert set(SHIPPED_MODELS_DIR.iterdir()) == folders
    assert not any(tmp_path.iterdir())  # nothing was built


def test_other_settings_are_built_once_into_the_cache(tmp_path):
    settings = TinyModelSettings.model_validate(
        {
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "intermediate_size": 64,
            "train_problems": 40,
            "train_steps": 3,
            "optim": {"warmup_steps": 1},
        }
    )
    folder = build_tiny_model(tmp_path, settings=settings)
    assert folder.parent == tmp_path
    assert AutoModelForCausalLM.from_pretrained(folder).config.num_hidden_layers == 1
    weights = folder / "model.safetensors"
    modified_ns = weights.stat().st_mtime_ns
    assert build_tiny_model(tmp_path, settings=settings) == folder
    assert weights.stat().st_mtime_ns == modified_ns
    # The atomic build leaves no temporary folder behind.
    assert [path.name for path in tmp_path.iterdir()] == [folder.name]


def test_the_fine_tuning_takes_the_trainers_settings_and_a_partial_optim_keeps_the_rest():
    settings = TinyModelSettings.model_validate({"optim": {"learning_rate": 0.005}})
    assert isinstance(settings.sft, SftConfig) and isinstance(settings.optim, TrainSettings)
    assert settings.optim == TinyModelSettings().optim.model_copy(update={"learning_rate": 0.005})
    assert settings.optim.lr_schedule == "cosine" and settings.optim.betas == (0.9, 0.95)


def test_a_warm_up_longer_than_the_fine_tuning_is_refused_when_the_config_loads():
    with pytest.raises(ValidationError, match=r"optim over the SFT's 10 steps: cosine schedule"):
        TinyModelSettings(train_steps=10)
    with pytest.raises(ValidationError, match=r"SFT's 5 steps"):  # 80 conversations, 16 a step
        TinyModelSettings.model_validate({"train_problems": 80, "sft": {"epochs": 1}})


def test_a_share_of_conversations_guesses_without_the_tool():
    one_operation = ProblemSettings(max_operations=1)  # the guess is then always wrong
    settings = TinyModelSettings(train_problems=400, guess_share=0.25, problems=one_operation)
    conversations = training_conversations(settings, seed=0)
    problems = generate_problems(400, seed=0, settings=settings.problems)
    guesses = [(c, p) for c, p in zip(conversations, problems, strict=True) if len(c) == 3]
    assert 60 <= len(guesses) <= 140  # about a quarter
    for conversation, problem in guesses:
        guess = final_answer(conversation[-1]["content"])
        assert guess == problem.expressions[0].split(" ")[0] != str(problem.answer)
        assert problem.question.startswith(f"{problem.question.split()[0]} has {guess} ")
    assert all(c == p.messages for c, p in zip(conversations, problems, strict=True) if len(c) > 3)
    assert training_conversations(settings, seed=0) == conversations


def test_chained_conversations_shown_in_part_stop_after_their_first_call():
    chains = ProblemSettings(min_operations=2, max_operations=3, one_call_per_operation=True)
    settings = TinyModelSettings(train_problems=50, calls_shown=1, problems=chains)
    conversations = training_conversations(settings, seed=0)
    problems = generate_problems(50, seed=0, settings=chains)
    right = 0
    for conversation, problem in zip(conversations, problems, strict=True):
        *start, call, result, answer = conversation
        assert start == problem.prompt_messages and len(problem.messages) > len(conversation)
        assert call == problem.messages[len(start)] and result["role"] == "tool"
        assert answer == {"role": "assistant", "content": f"#### {result['content']}"}
        right += final_answer(answer["content"]) == str(problem.answer)
    assert right <= 5  # by chance only (a count of 0 times anything): the chain goes on
    whole = training_conversations(settings.model_copy(update={"calls_shown": 0}), seed=0)
    assert whole == [problem.messages for problem in problems]
    half = training_conversations(settings.model_copy(update={"calls_shown_share": 0.5}), seed=0)
    cut = [len(one) < len(problem.messages) for one, problem in zip(half, problems, strict=True)]
    assert 15 <= sum(cut) <= 35
    for one, whole_one, short in zip(half, whole, conversations, strict=True):
        assert one in (whole_one, short)
    with pytest.raises(ValidationError, match="calls_shown is for the calculator task only"):
        TinyModelSettings(task="code", calls_shown=1)


def test_a_share_of_problems_teaches_the_judges_role_with_some_verdicts_flipped():
    """The judge's conversations are the prompt a co-trained judge gets (the trainer's own
    rendering of a policy's messages) on a solved conversation, a guess, a miscopied call or a
    miscopied answer, and the verdict the task's answer gives, `judge_noise` of them flipped."""
    one_operation = ProblemSettings(max_operations=1)
    settings = TinyModelSettings(
        train_problems=800, judge_share=0.5, judge_noise=0.25, problems=one_operation
    )
    judges = judge_conversations(settings, seed=0)
    assert 320 <= len(judges) <= 480  # about half the problems
    problems = {p.question: p for p in generate_problems(800, seed=0, settings=one_operation)}
    solved_prompts = {judge_prompt(p.messages, DEFAULT_JUDGE_RUBRIC) for p in problems.values()}
    kinds, flipped = Counter(), 0
    for prompt, verdict in judges:
        assert prompt["role"] == "user" and verdict["role"] == "assistant"
        assert verdict["content"] in ("Verdict: yes", "Verdict: no")
        problem = problems[re.search(r"Problem: (.*)\n", prompt["content"])[1]]
        answer = final_answer(prompt["content"])
        call = re.search(
            r'calls calculator\(\{"expression": "(.*)"\}\)\n\ntool: (\d+)', prompt["content"]
        )
        if prompt["content"] in solved_prompts:
            kinds["solved"] += 1
        elif call is None:
            kinds["guess"] += 1
        elif call[2] != answer:
            kinds["miscopied_answer"] += 1
        else:
            assert call[1] != problem.expressions[0]
            kinds["miscopied_call"] += 1
        flipped += (
            verdict["content"] != f"Verdict: {'yes' if answer == str(problem.answer) else 'no'}"
        )
    assert 0.18 <= flipped / len(judges) <= 0.32
    for kind, share in JUDGED_TRANSCRIPTS.items():
        assert abs(kinds[kind] / len(judges) - share) < 0.07, kinds
    assert judge_conversations(settings, seed=0) == judges
    # Without judges the conversations are the policy's alone, as before there were judges.
    assert judge_conversations(TinyModelSettings(), seed=0) == []
    with pytest.raises(ValidationError, match="judge_share is for the calculator task only"):
        TinyModelSettings(task="search", judge_share=0.5)


def test_a_null_model_path_becomes_the_configs_tiny_model(tiny_model_dir):
    project, overrides = load_with_tiny_model(None, [], ["rollout"])
    assert project.rollout.model_path == str(tiny_model_dir)
    assert project.trainer.model_path is None  # not asked for
    assert overrides == [f"rollout.model_path={tiny_model_dir}"]


@pytest.mark.parametrize("task", ["search", "code", "zoom"])
async def test_each_tasks_conversations_render_the_schema_its_tool_serves(task):
    """The schema a tiny model learns is the one the tool service shows the policy."""
    settings = TinyModelSettings(task=task, train_problems=200, guess_share=0.25)
    # Off the loop: zoom's conversations hold the image_zoom tool's answers, run by asyncio.run.
    conversations = await asyncio.to_thread(training_conversations, settings, seed=0)
    guesses = [c for c in conversations if len(c) == 3]
    assert 25 <= len(guesses) <= 75  # about a quarter answer at once
    tool_name = {"search": "search", "code": "python", "zoom": "image_zoom"}[task]
    for conversation in conversations:
        if len(conversation) > 3:
            assert conversation[2]["tool_calls"][0]["function"]["name"] == tool_name
    options = {"search": {"corpus_path": str(REPO_ROOT / "examples/search/corpus.jsonl")}}
    config = ToolConfig(tools=[{"class_name": tool_name, "config": options.get(task, {})}])
    service = await ToolService.create(config)
    try:
        served = [info.schema for info in service.list_tools()]
    finally:
        await service.close()
    assert [tool["function"] for tool in task_tools(settings)] == served
