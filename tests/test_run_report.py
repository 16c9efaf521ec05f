"""`turnrl report` and `turnrl show` on a run folder written by the trainer's own writers
(trainer_svc/report.py, trainer_svc/dumps.py) from real trajectories tokenized with the tiny
model's tokenizer; the page is loaded in headless Chromium (installed by `make setup`:
scripts/setup_system.sh), whose absence fails the test."""

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from trainer_svc import dumps, report
from trainer_svc.config import TrainerConfig
from trainer_svc.dumps import DumpWriter, dump_path, rollout_records, trajectory_record
from trainer_svc.report import REWARD_PLOT, RunReport
from trainer_svc.rl_step import rollout_batch
from turnrl.messages import openai_tool_call
from turnrl.trajectory import FinishReason, Segment, Trajectory
from turnrl.trajectory import SegmentSource as Source
from turnrl.v1 import common_pb2
from turnrl_cli import cli, run_folder
from turnrl_cli.run_report import render_page, script_json
from turnrl_cli.run_show import token_text

# Model and tool text that would break a page that pasted it in as HTML.
HOSTILE = '</script><script>document.body.dataset.errors="injected"</script><b>&amp;'
TRAINED_COLOUR, MASKED_COLOUR = (0xDB, 0xEA, 0xFE), (0xF3, 0xF4, 0xF6)  # report_page.html


def chat_tokens(tokenizer, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=generation_prompt
    )


def calculator_trajectory(tokenizer, index: int, reward: float) -> Trajectory:
    """A calculator episode: a question, a tool call, the tool's (hostile) output, an answer;
    each segment's tokens from the chat template, as the rollout service builds them."""
    user = {"role": "user", "content": f"What is {index} + 2?"}
    call = openai_tool_call("call_0", "calculator", json.dumps({"expression": f"{index}+2"}))
    assistant = {"role": "assistant", "content": "", "tool_calls": [call]}
    tool = {"role": "tool", "content": HOSTILE, "tool_call_id": "call_0", "name": "calculator"}
    answer = {"role": "assistant", "content": f"The answer is {index + 2}."}
    prompt = chat_tokens(tokenizer, [user], generation_prompt=True)
    first = chat_tokens(tokenizer, [user, assistant])[len(prompt) :]
    with_tool = chat_tokens(tokenizer, [user, assistant, tool], generation_prompt=True)
    last = chat_tokens(tokenizer, [user, assistant, tool, answer])[len(with_tool) :]
    trajectory = Trajectory(
        trajectory_id=f"g{index}/0",
        group_id=f"g{index}",
        sample_index=0,
        segments=[
            Segment(Source.PROMPT, prompt),
            Segment(Source.MODEL, first, [-0.1 * (i % 3) for i in range(len(first))], 1),
            Segment(Source.TOOL, with_tool[len(prompt) + len(first) :]),
            Segment(Source.MODEL, last, [-0.2] * len(last), 2),
        ],
        messages=[user, assistant, tool, answer],
        finish_reason=FinishReason.STOP,
        reward=common_pb2.Reward(score=reward),
    )
    assert trajectory.token_ids == chat_tokens(tokenizer, [user, assistant, tool, answer])
    return trajectory


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tokenizer) -> Path:
    """A two-step run's folder: metrics, curves and summary, two rollout dumps with the
    trainer's logprobs, one evaluation dump."""
    run_dir = tmp_path_factory.mktemp("runs") / "calculator-test"
    run_dir.mkdir()
    metrics = RunReport(run_dir, TrainerConfig(loggers=[]), REWARD_PLOT)
    writer = DumpWriter(tokenizer)
    for step in (1, 2):
        trajectories = [calculator_trajectory(tokenizer, i, float(i % 2)) for i in range(4)]
        rollouts = rollout_batch(trajectories, pad_token_id=0)
        extras = rollouts.batch.extras
        # The trainer's logprobs: off by 0 to 1.5 nats, growing along the sequence.
        gap = torch.linspace(0, 1.5, extras["rollout_logprobs"].shape[-1])
        extras["old_logprobs"] = extras["rollout_logprobs"] - gap * rollouts.batch.loss_mask
        extras["advantages"] = torch.ones_like(extras["rollout_logprobs"])
        records = rollout_records(rollouts, [0, 1, 3], step, policy_version=2)
        writer.write(dump_path(run_dir, "rollouts", step), lambda records=records: records)
        metrics.log(step, {"rollout/reward_mean": 0.5 * step, "mismatch/mean_abs_diff": 0.1})
    held_out = [calculator_trajectory(tokenizer, i, 1.0) for i in range(2)]
    writer.write(
        dump_path(run_dir, "eval", 2), lambda: [trajectory_record(t, 2, 2) for t in held_out]
    )
    metrics.log(2, {"eval/accuracy": 0.75})
    writer.close()
    metrics.finish({"final_eval_accuracy": 0.75, "note": HOSTILE})
    return run_dir


def expand(runs: list[list]) -> list:
    return [value for value, count in runs for _ in range(count)]


def page_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', page, re.S)
    return json.loads(match[1])


def test_the_page_is_one_file_with_the_runs_data_and_model_text_escaped(run_dir):
    page = render_page(run_dir)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*\w+:""", page)  # nothing to fetch
    assert "http" not in page.replace("http-equiv", "")
    # The hostile text never appears raw: only the page's own two script elements close.
    assert HOSTILE not in page and page.count("</script>") == 3  # error hook, data, main
    assert "&lt;/script&gt;" in page  # the summary's note, as HTML text
    data = page_data(page)
    assert sorted(data["dumps"]) == ["eval", "rollouts"]
    assert sorted(data["dumps"]["rollouts"]) == ["1", "2"]
    record = data["dumps"]["rollouts"]["2"][0]
    assert record["messages"][2]["content"] == HOSTILE  # decoded back exactly
    view = record["view"]
    assert "".join(view["pieces"]).count("<|im_start|>") == 4
    assert len(view["pieces"]) == len(view["ids"]) == record["total_tokens"]
    trained, versions = expand(view["trained"]), expand(view["versions"])
    assert len(trained) == len(versions) == len(expand(view["sources"])) == len(view["pieces"])
    # Prompt, the first model turn (policy 1), the tool's answer, the second (policy 2).
    assert [run[0] for run in view["sources"]] == ["prompt", "model", "tool", "model"]
    assert {v for v, t in zip(versions, trained, strict=True) if t} == {1, 2}
    assert all(view["trainer"][i] is None for i, t in enumerate(trained) if not t)
    eval_view = data["dumps"]["eval"]["2"][0]["view"]
    assert set(eval_view["trainer"]) == {None}  # an evaluation has no trainer logprobs
    assert '<svg class="chart"' in page and "held-out accuracy" in page


def test_the_reader_knows_the_names_the_trainer_writes():
    assert run_folder.METRICS_FILE == report.METRICS_FILE
    assert run_folder.SUMMARY_FILE == report.SUMMARY_FILE
    assert run_folder.DUMP_FOLDERS == (dumps.ROLLOUTS_FOLDER, dumps.EVAL_FOLDER)


def test_script_json_survives_any_closing_tag():
    text = script_json({"a": "</script><!-- \u2028 &"})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == {"a": "</script><!-- \u2028 &"}


def test_report_writes_the_page_into_the_run_folder(run_dir, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["report", str(run_dir)])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"report: {run_dir / 'report.html'}\n"
    assert (run_dir / "report.html").read_text() == render_page(run_dir)


def test_report_of_a_folder_that_is_no_run_names_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["report", str(tmp_path)])
    assert exited.value.code == 2
    assert f"{str(tmp_path)!r} is not a run folder" in capsys.readouterr().err


def test_show_prints_a_steps_trajectories_best_first(run_dir, capsys):
    with pytest.raises(SystemExit):
        cli.main(["show", str(run_dir), "--step", "1", "-n", "2", "--tokens"])
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # not a terminal: no colours
    headers = [line for line in out.splitlines() if line.startswith("── ")]
    assert len(headers) == 2 and all("step 1 · reward 1.000" in h for h in headers)
    assert "[tool] " + HOSTILE in out and '→ calculator({"expression": "1+2"})' in out
    # Trained runs between «», the chat template's and the tool's tokens outside them.
    assert re.search("«The answer is [35].<\\|im_end\\|>↵\n»", out)
    assert "<|im_start|>tool" in out.split("«")[2]


def test_show_of_a_step_not_dumped_lists_the_steps(run_dir, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["show", str(run_dir), "--eval", "--step", "7"])
    assert exited.value.code == 2
    assert "no eval dump of step 7 " in (err := capsys.readouterr().err) and "dumped: [2]" in err


def test_a_dump_without_token_text_is_named(run_dir, tmp_path, capsys):
    old_run = tmp_path / "old"
    shutil.copytree(run_dir, old_run)
    path = old_run / "rollouts" / "step_000002.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text(
        "\n".join(json.dumps({k: v for k, v in r.items() if k != "tokens"}) for r in records)
    )
    with pytest.raises(SystemExit) as exited:
        cli.main(["report", str(old_run)])
    assert exited.value.code == 2
    assert "of step 2 has no ['tokens']" in capsys.readouterr().err


def test_show_tints_trained_tokens_by_their_gap(run_dir):
    record = json.loads((run_dir / "rollouts" / "step_000001.jsonl").read_text().splitlines()[0])
    text = token_text(record)
    styles = {str(span.style) for span in text.spans}
    assert "dim" in styles  # masked
    tints = {s for s in styles if s.startswith("blue on rgb(")}
    assert len(tints) > 3  # the gap grows along the sequence


def test_the_page_renders_a_trajectory_in_headless_chromium(run_dir, tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "chromium is missing: `make setup` installs it (scripts/setup_system.sh)"
    page = run_dir / "report.html"
    page.write_text(render_page(run_dir))
    browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    browser += [f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1800"]
    dom = subprocess.run(
        [*browser, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=60
    ).stdout
    body = re.search(r"<body[^>]*>", dom)[0]
    assert 'data-rendered="ok"' in body and "data-errors" not in body, body
    # The best trajectory of the last step is open, its tokens one span each.
    tokens = re.search(r'<div class="tokens" id="tokens">(.*?)</div>', dom, re.S)[1]
    assert tokens.count('class="tok trained') > 10 and tokens.count('class="tok masked') > 10
    assert html.escape(HOSTILE, quote=False) in re.sub("<[^>]*>", "", tokens)  # text, as text
    assert f'<div class="content">{html.escape(HOSTILE, quote=False)}</div>' in dom
    assert 'title="id ' in tokens and "trainer logprob" in tokens

    screenshot = tmp_path / "page.png"
    subprocess.run(
        [*browser, f"--screenshot={screenshot}", page.as_uri()], capture_output=True, timeout=60
    )
    colours = {colour for _, colour in Image.open(screenshot).convert("RGB").getcolors(1 << 24)}
    assert len(colours) > 50  # text, charts, tints: not a blank page
    assert MASKED_COLOUR in colours
