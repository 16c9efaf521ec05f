"""`turnrl eval`: a model evaluated without training, through the real services the launcher
starts (the trainer's eval mode, the same evaluation as a run's), on held-out prompts of two
data sources read from a `datasets` folder; sampled, so mean@n and pass@k are measured."""

import json
from math import comb

import datasets

from turnrl.calculator_data import generate_problems

from .conftest import EXAMPLE_CONFIG, FREE_PORTS, run_turnrl

SOURCES = ["openai/gsm8k", "gsm8k"]  # both graded by the reward service's gsm8k scorer


def held_out_folder(folder):
    """Four calculator test problems as verl rows, two per data source, saved with
    `datasets`' save_to_disk."""
    rows = [
        {
            "data_source": SOURCES[index % 2],
            "prompt": problem.prompt_messages,
            "reward_model": {"ground_truth": str(problem.answer)},
            "extra_info": {"index": index},
        }
        for index, problem in enumerate(generate_problems(4, seed=7, split="test"))
    ]
    datasets.Dataset.from_list(rows).save_to_disk(folder)
    return folder


def unbiased_pass_at_k(records: list[dict], k: int) -> float:
    groups: dict[str, list[float]] = {}
    for record in records:
        groups.setdefault(record["group_id"], []).append(record["reward"])
    estimates = [
        1 - comb(len(r) - sum(x >= 1.0 for x in r), k) / comb(len(r), k) for r in groups.values()
    ]
    return sum(estimates) / len(estimates)


async def test_eval_measures_a_model_per_data_source_and_writes_metrics_and_generations(
    tmp_path, tiny_model_dir
):
    data = held_out_folder(tmp_path / "held_out")
    output = tmp_path / "evaluation"
    code, _, stderr = await run_turnrl(
        "eval", "--config", str(EXAMPLE_CONFIG), "--model", str(tiny_model_dir),
        "--output", str(output), *FREE_PORTS,
        f"trainer.data.eval_files=[{{disk: {data}}}]",
        "trainer.eval={n: 4, temperature: 1.0, k: [1, 2, 4], success_threshold: 1.0}",
        env={"HF_HUB_OFFLINE": "1", "COLUMNS": "200"},
        timeout_seconds=240,
    )  # fmt: skip
    assert code == 0, stderr
    summary = json.loads((output / "summary.json").read_text())
    assert summary["held_out_prompts"] == 4 and summary["samples_per_prompt"] == 4
    assert summary["model"] == str(tiny_model_dir)

    # The generations: 4 samples of each prompt, the metrics recomputed from them.
    records = [json.loads(line) for line in (output / "eval/step_000000.jsonl").open()]
    assert len(records) == 16
    assert sorted({r["data_source"] for r in records}) == sorted(SOURCES)
    assert all(r["error_message"] == "" and r["reward_error"] is None for r in records)
    rewards = [r["reward"] for r in records]
    assert summary["eval/mean@4"] == sum(rewards) / len(rewards)
    for k in (1, 2, 4):
        assert abs(summary[f"eval/pass@{k}"] - unbiased_pass_at_k(records, k)) < 1e-9
        for source in SOURCES:
            of_source = [r for r in records if r["data_source"] == source]
            expected = unbiased_pass_at_k(of_source, k)
            assert abs(summary[f"eval/{source}/pass@{k}"] - expected) < 1e-9
    assert summary["eval/pass@1"] <= summary["eval/pass@2"] <= summary["eval/pass@4"]
    # Sampled, not greedy: a prompt's samples differ.
    by_prompt = {}
    for record in records:
        by_prompt.setdefault(record["group_id"], set()).add(tuple(record["token_ids"]))
    assert any(len(samples) > 1 for samples in by_prompt.values())

    # The table per data source, and nothing trained, pushed or saved.
    for text in ("data source", "mean@4", "pass@4", "openai/gsm8k", "all", str(output)):
        assert text in stderr, text
    assert not (output / "final_model").exists() and not (output / "checkpoints").exists()
