"""`turnrl run` on image prompts through the four services (issue 35): a tiny random
Qwen2.5-VL (Qwen2.5-VL's real processor config and chat template) rolled out on the hf engine
and trained by the trainer service, its weights, vision tower included, pushed back each step;
the trainer's logprobs of the image trajectories are the engine's."""

import json
from pathlib import Path

from tests.conftest import FREE_PORTS, run_turnrl
from tests.tiny_vlm import (
    ZOOM_ANSWER,
    ZOOM_OPTIONS,
    ZOOM_QUESTION,
    data_url,
    png_bytes,
    save_tiny_vlm,
)
from turnrl.config import REPO_ROOT


def write_image_prompts(folder: Path, count: int) -> Path:
    """verl multimodal rows: an image file each, in the place of the prompt's `<image>`."""
    rows = []
    for index in range(count):
        (folder / f"image{index}.png").write_bytes(png_bytes(56 + 28 * (index % 2), 56, index))
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": "<image>Which number is shown?"}],
                "images": [f"image{index}.png"],
                "reward_model": {"ground_truth": str(index)},
                "extra_info": {"index": index},
            }
        )
    path = folder / "images.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


async def test_turnrl_run_trains_a_vision_language_model_on_image_prompts(fixtures, tmp_path):
    model = save_tiny_vlm(tmp_path / "vlm", fixtures)
    data = write_image_prompts(tmp_path, 4)
    code, _, stderr = await run_turnrl(
        "run", "--config", str(REPO_ROOT / "examples" / "calculator" / "config.yaml"),
        *FREE_PORTS,
        f"rollout.model_path={model}", f"trainer.model_path={model}",
        f"rollout.chat_template_path={model / 'chat_template.jinja'}",
        "rollout.max_new_tokens=8", "rollout.max_response_length=64",
        f"trainer.data.train_files=[{data}]", f"trainer.data.eval_files=[{data}]",
        "trainer.steps=2", "trainer.eval_every=2", "trainer.checkpoint.every=0",
        "trainer.rollout.prompts_per_step=2", "trainer.rollout.samples_per_prompt=2",
        "trainer.rollout.max_turns=1", "trainer.algorithm.mini_batches=1", "trainer.loggers=[]",
        f"trainer.output_dir={tmp_path / 'runs'}", "trainer.run_name=vlm",
        timeout_seconds=600,
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    run = tmp_path / "runs" / "vlm"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    mismatches = [s["mismatch/mean_abs_diff"] for s in steps if "mismatch/mean_abs_diff" in s]
    assert len(mismatches) == 2 and max(mismatches) < 1e-5, mismatches
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2


async def test_an_image_tool_result_travels_from_the_data_row_to_the_loss(
    zoom_caller_dir, tmp_path
):
    """The zoom caller, asked about an image (a data row's), calls image_zoom on the tool
    service, whose session holds the row's image (its `tools_kwargs`); the enlarged region
    comes back as the tool result's image, is placed in the trajectory after the call, and the
    trainer's logprobs over both images are the engine's."""
    rows = []
    for index in range(2):
        image = png_bytes(56, 56, 40 + index)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"<image>{ZOOM_QUESTION}"}],
                "images": [data_url(image)],
                "reward_model": {"ground_truth": ZOOM_ANSWER},
                "extra_info": {
                    "index": index,
                    "tools_kwargs": {"image_zoom": {"create_kwargs": {"image": data_url(image)}}},
                },
            }
        )
    data = tmp_path / "zoom.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tool = f"{{class_name: image_zoom, config: {json.dumps(ZOOM_OPTIONS)}}}"
    code, _, stderr = await run_turnrl(
        "run", "--config", str(REPO_ROOT / "examples" / "calculator" / "config.yaml"),
        *FREE_PORTS,
        f"rollout.model_path={zoom_caller_dir}", f"trainer.model_path={zoom_caller_dir}",
        f"tool.tools=[{tool}]", "trainer.rollout.tools=[image_zoom]",
        "rollout.max_new_tokens=64", "rollout.max_response_length=256",
        f"trainer.data.train_files=[{data}]", f"trainer.data.eval_files=[{data}]",
        "trainer.steps=1", "trainer.eval_every=0", "trainer.checkpoint.every=0",
        "trainer.rollout.prompts_per_step=2", "trainer.rollout.samples_per_prompt=2",
        "trainer.rollout.max_turns=2", "trainer.algorithm.mini_batches=1", "trainer.loggers=[]",
        f"trainer.output_dir={tmp_path / 'runs'}", "trainer.run_name=zoom",
        timeout_seconds=600,
    )  # fmt: skip
    assert code == 0, stderr[-3000:]
    run = tmp_path / "runs" / "zoom"
    dumped = [json.loads(line) for line in (run / "rollouts" / "step_000001.jsonl").open()]
    assert len(dumped) == 4
    for trajectory in dumped:
        assert trajectory["tool_calls"] and trajectory["tool_calls"][0]["name"] == "image_zoom"
        [tool_message] = [m for m in trajectory["messages"] if m["role"] == "tool"]
        text, image = tool_message["content"]
        assert text["text"] == "Region [0, 0, 28, 28] of the 56x56 image, shown at 56x56."
        assert image["type"] == "image_url"
        prompt_image, tool_image = trajectory["images"]
        assert (
            prompt_image["token_offset"] < trajectory["prompt_tokens"] < tool_image["token_offset"]
        )
        loss_mask = trajectory["loss_mask"]
        for record in (prompt_image, tool_image):
            span = range(record["token_offset"], record["token_offset"] + record["token_count"])
            assert not any(loss_mask[i] for i in span)
        assert trajectory["logprob_mismatch"] < 1e-5
    steps = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    [mismatch] = [s["mismatch/mean_abs_diff"] for s in steps if "mismatch/mean_abs_diff" in s]
    assert mismatch < 1e-5
