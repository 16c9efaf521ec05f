"""SFT mode (`trainer.mode: sft`): its loss on a real tiny model, its run through the
TrainerService RPCs (an in-process server), a stopped run resumed, bad configs and data, and
`turnrl run` with examples/calculator/sft.yaml."""

import contextlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer_svc.config import TrainerConfig, TrainSettings
from trainer_svc.data import ConversationRecord, load_conversations
from trainer_svc.fsdp import FsdpPolicy
from trainer_svc.ranks import Ranks
from trainer_svc.server import TrainerServicer
from trainer_svc.service import TrainerService
from trainer_svc.sft import (
    SftController,
    examples_batch,
    sft_in_process,
    sft_loss,
    tokenize_conversations,
)
from turnrl import rpc
from turnrl.calculator_data import TOOLS, ProblemSettings, generate_problems
from turnrl.config import REPO_ROOT, ClientConfig, ServerConfig
from turnrl.errors import ConfigError, InvalidArgumentError
from turnrl.v1 import trainer_pb2, trainer_pb2_grpc
from turnrl_cli.model_paths import load_with_tiny_model
from turnrl_demo.tiny_model import build_tiny_model

from ..conftest import EXAMPLE_CONFIG, run_turnrl, serve_in_process
from .fsdp_worker import checkpoint_tensors

State = trainer_pb2.Run.State
SFT_EXAMPLE = REPO_ROOT / "examples" / "calculator" / "sft.yaml"
# An SFT run small enough for a test: 12 conversations, 4 per step, 4 held out.
SMALL_SFT_RUN = {
    "mode": "sft",
    "eval_every": 2,
    "checkpoint": {"every": 2},
    "loggers": [],
    "data": {"generated_train_size": 12, "generated_eval_size": 4},
    "sft": {"conversations_per_step": 4},
    "optim": {"learning_rate": 0.001},
}


def calculator_records(count: int) -> list[ConversationRecord]:
    """Held-out calculator conversations of up to three operations."""
    problems = generate_problems(
        count, seed=5, split="test", settings=ProblemSettings(max_operations=3)
    )
    return [ConversationRecord(f"c{i}", p.messages, TOOLS) for i, p in enumerate(problems)]


def test_the_step_loss_is_the_assistant_tokens_cross_entropy_and_falls(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples = tokenize_conversations(tokenizer, calculator_records(8), max_length=2048)
    batch = examples_batch(examples, tokenizer.pad_token_id)
    # transformers' own causal-LM loss: the mean cross-entropy of the labelled tokens.
    labels = torch.where(batch.loss_mask, batch.input_ids, -100)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        expected = reference(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=labels
        ).loss
    # Micro-batches of two or three conversations: each adds its share of the step's mean.
    policy = FsdpPolicy(tiny_model_dir, TrainSettings(learning_rate=1e-3, micro_batch_tokens=1024))
    losses = [policy.train_step(batch, sft_loss)["loss"] for _ in range(4)]
    assert losses[0] == pytest.approx(float(expected), rel=1e-5)
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.8 * losses[0], losses


def test_conversations_that_do_not_fit_are_named(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = calculator_records(2)
    with pytest.raises(ConfigError, match=r"conversation c0 has \d+ tokens, more than .*=50"):
        tokenize_conversations(tokenizer, records, max_length=50)
    no_answer = ConversationRecord("c9", records[0].messages[:2], TOOLS)
    with pytest.raises(ConfigError, match=r"conversation c9: a conversation needs an assistant"):
        tokenize_conversations(tokenizer, [no_answer], max_length=2048)


@contextlib.asynccontextmanager
async def trainer_stub(runs_root: Path, model_path: str | None = None):
    """A real TrainerService server in this event loop, started with `runs_root` and
    `model_path`, and a stub on a channel to it."""
    service = TrainerService(Ranks(), model_path, runs_root=runs_root)
    descriptor = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]

    def add_servicer(server):
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(service), server)

    try:
        async with (
            serve_in_process(ServerConfig(port=0), descriptor, add_servicer) as address,
            rpc.open_channel(ClientConfig(address=address)) as channel,
        ):
            yield trainer_pb2_grpc.TrainerServiceStub(channel)
    finally:
        await service.close()


def sft_config_yaml(output_dir: Path, **trainer) -> str:
    return yaml.safe_dump({"trainer": {**SMALL_SFT_RUN, "output_dir": str(output_dir), **trainer}})


async def run_to_end(stub, config_yaml: str) -> tuple[trainer_pb2.Run, trainer_pb2.Run, list]:
    """StartRun, every progress event to the end, GetRun: (started run, ended run, events)."""
    started = await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config_yaml), timeout=30)
    request = trainer_pb2.StreamProgressRequest(run_name=started.run.name)
    events = [event async for event in stub.StreamProgress(request, timeout=300)]
    request = trainer_pb2.GetRunRequest(run_name=started.run.name)
    ended = (await stub.GetRun(request, timeout=10)).run
    return started.run, ended, events


async def test_a_run_without_a_model_trains_the_one_the_service_was_started_with(tmp_path):
    """What a client that cannot see the service's files sends (the composed trainer): the
    demo's model here, not the default settings' model the run would otherwise get."""
    demo_model = load_with_tiny_model(EXAMPLE_CONFIG, [], ["trainer"])[0].trainer.model_path
    assert demo_model != str(build_tiny_model())
    config = sft_config_yaml(tmp_path, run_name="served-model", steps=1)
    assert "model_path" not in config
    async with trainer_stub(tmp_path, demo_model) as stub:
        _, run, events = await run_to_end(stub, config)
    assert run.state == trainer_pb2.Run.State.STATE_SUCCEEDED, run.error_message
    setup = next(event for event in events if event.stage == "setup")
    assert setup.message.startswith(f"model {demo_model};")


async def test_an_sft_run_of_one_epoch_logs_evaluates_checkpoints_and_exports(
    tiny_model_dir, tmp_path
):
    config = sft_config_yaml(
        tmp_path, run_name="epoch", sft={"conversations_per_step": 4, "epochs": 1}
    )
    async with trainer_stub(tmp_path, str(tiny_model_dir)) as stub:
        started, run, events = await run_to_end(stub, config)
    assert started.total_steps == 0  # an epoch's steps are counted from the data, at setup
    assert run.state == State.STATE_SUCCEEDED, run.error_message
    assert run.step == run.total_steps == 3  # 12 conversations, 4 a step
    stages = [(event.step, event.stage) for event in events]
    for expected in [(0, "setup"), (0, "eval"), (1, "train"), (2, "eval"), (2, "checkpoint")]:
        assert expected in stages
    assert stages[-4:] == [(3, "eval"), (3, "checkpoint"), (3, "done"), (3, "state")]
    train = next(event for event in events if event.stage == "train")
    for name in ("train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s"):
        assert train.metrics[name] > 0, name

    run_dir = Path(run.output_dir)
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "train/loss" in r] == [1, 2, 3]
    assert [r["step"] for r in logged if "eval/loss" in r] == [0, 2, 3]
    assert [r["train/epoch"] for r in logged if "train/epoch" in r] == pytest.approx(
        [1 / 3, 2 / 3, 1]
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["epochs"] == 1.0
    assert summary["final_eval_loss"] == logged[-1]["eval/loss"] > 0
    assert (run_dir / "curves.png").read_bytes().startswith(b"\x89PNG")
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    AutoTokenizer.from_pretrained(run_dir / "final_model")
    checkpoint = run_dir / "checkpoints" / "step_000003"
    assert json.loads((checkpoint / "state.json").read_text())["data_position"] == 12
    exported_state = exported.state_dict()
    for name, tensor in checkpoint_tensors(checkpoint).items():
        torch.testing.assert_close(exported_state[name], tensor, rtol=0, atol=0)


async def test_an_sft_run_with_lora_trains_the_adapters_alone_and_exports_them(
    tiny_model_dir, tmp_path
):
    config = sft_config_yaml(
        tmp_path, run_name="lora", steps=2, lora={"rank": 4, "export_merged": True}
    )
    async with trainer_stub(tmp_path, str(tiny_model_dir)) as stub:
        _, run, events = await run_to_end(stub, config)
    assert run.state == State.STATE_SUCCEEDED, run.error_message
    assert [e.step for e in events if e.stage == "train"] == [1, 2]
    final = Path(run.output_dir) / "final_model"
    assert json.loads((final / "adapter_config.json").read_text())["r"] == 4
    adapters = AutoModelForCausalLM.from_pretrained(final)  # base + adapter, through peft
    merged = AutoModelForCausalLM.from_pretrained(final / "merged")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        tuned, plain = adapters(ids).logits, base(ids).logits
        # Merged, W + BA is rounded once in float32; through peft, Wx + B(Ax): the logits (up
        # to about 13 here) agree to float32 rounding, relative to their size (1.1e-5 apart on
        # one CPU), while the trained adapters moved them by up to 2.4e-2.
        torch.testing.assert_close(merged(ids).logits, tuned, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(tuned, plain)  # the adapters were trained and exported


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"mode": "dpo"}, "mode"),
        ({"sft": {"conversations_per_step": 0}}, "conversations_per_step"),
        ({"sft": {"epochs": 1, "max_lenght": 512}}, "max_lenght"),
    ],
)
async def test_bad_sft_configs_are_invalid_arguments(tmp_path, trainer, message):
    async with trainer_stub(tmp_path) as stub:
        with pytest.raises(InvalidArgumentError) as info:
            config = sft_config_yaml(tmp_path, **trainer)
            await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=30)
    assert message in info.value.details


async def test_bad_sft_data_fails_the_run_naming_the_conversation(tiny_model_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}
    bad = {"messages": [{"role": "user", "content": "Hi"}, *good["messages"][1:] * 2]}
    data.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    config = sft_config_yaml(tmp_path, data={"train_files": [str(data)]})
    async with trainer_stub(tmp_path, str(tiny_model_dir)) as stub:
        _, run, _ = await run_to_end(stub, config)
    assert run.state == State.STATE_FAILED
    assert "conversation chats-1: two assistant messages in a row" in run.error_message


async def test_a_stopped_sft_run_resumes_where_it_stopped(tiny_model_dir, tmp_path):
    config = TrainerConfig.model_validate(
        {
            **SMALL_SFT_RUN,
            "model_path": str(tiny_model_dir),
            "steps": 4,
            "eval_every": 0,
            "checkpoint": {"every": 0},
        }
    )
    for name in ("whole", "stopped"):
        (tmp_path / name).mkdir()  # as StartRun makes it
    whole = SftController(config, tmp_path / "whole", lambda event: None, Ranks())
    await whole.run(resume=False)

    def stop_after_step_2(event):
        if event.stage == "train" and event.step == 2:
            stopped.request_stop()

    stopped = SftController(config, tmp_path / "stopped", stop_after_step_2, Ranks())
    assert (await stopped.run(resume=False))["steps"] == 2  # and a checkpoint of step 2
    resumed = SftController(config, tmp_path / "stopped", lambda event: None, Ranks())
    assert (await resumed.run(resume=True))["steps"] == 4

    def losses(run_dir: Path) -> list[float]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [record["train/loss"] for record in map(json.loads, lines) if "train/loss" in record]

    assert losses(tmp_path / "stopped") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)
    for name, tensor in whole.ranks.models.policy.full_state_dict().items():
        torch.testing.assert_close(resumed.ranks.models.policy.full_state_dict()[name], tensor)


async def test_a_run_without_any_model_is_refused_naming_trainer_model_path(tmp_path):
    """No service builds the tiny model for itself: StartRun refuses a run that names no model
    on a service started without one."""
    config = sft_config_yaml(tmp_path, run_name="no-model", steps=1)
    async with trainer_stub(tmp_path) as stub:
        with pytest.raises(InvalidArgumentError, match=r"trainer\.model_path is null"):
            await stub.StartRun(trainer_pb2.StartRunRequest(config_yaml=config), timeout=30)
    assert not (tmp_path / "no-model").exists()


async def test_sft_in_process_takes_the_steps_of_an_sft_run(tiny_model_dir, tmp_path):
    """The in-process SFT (the tiny demo model's fine-tuning) is an SftController run's steps:
    the same batches, loss and schedule, so the same losses."""
    config = TrainerConfig.model_validate(
        {
            **SMALL_SFT_RUN,
            "model_path": str(tiny_model_dir),
            "steps": 3,
            "eval_every": 0,
            "checkpoint": {"every": 0},
            "optim": {"learning_rate": 0.001, "warmup_steps": 1, "lr_schedule": "cosine"},
        }
    )
    await SftController(config, tmp_path, lambda event: None, Ranks()).run(resume=False)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    run_metrics = [record for record in map(json.loads, lines) if "train/loss" in record]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    train, _ = load_conversations(config.data, config.seed)
    examples = tokenize_conversations(tokenizer, train, config.sft.max_length)
    steps = []
    sft_in_process(
        tiny_model_dir,
        examples,
        tokenizer.pad_token_id,
        sft=config.sft,
        optim=config.optim,
        steps=config.steps,
        seed=config.seed,
        on_step=lambda step, total, metrics: steps.append((step, total, metrics)),
    )
    assert [(step, total) for step, total, _ in steps] == [(1, 3), (2, 3), (3, 3)]
    for (_, _, metrics), logged in zip(steps, run_metrics, strict=True):
        assert metrics["loss"] == pytest.approx(logged["train/loss"], rel=1e-5)
        assert metrics["lr"] == pytest.approx(logged["train/lr"], rel=1e-9)


async def test_turnrl_run_trains_the_example_in_the_trainer_service_alone(tiny_model_dir, tmp_path):
    code, _, stderr = await run_turnrl(
        "run",
        "--config",
        str(SFT_EXAMPLE),
        "trainer.server.port=0",
        f"trainer.output_dir={tmp_path}",
        "trainer.sft.epochs=null",
        "trainer.steps=2",
        "trainer.eval_every=0",
        "trainer.loggers=[]",
        "trainer.data.generated_train_size=16",
        "trainer.data.generated_eval_size=4",
        "trainer.sft.conversations_per_step=4",
        "trainer.optim.warmup_steps=1",
        timeout_seconds=300,
    )
    assert code == 0, stderr[-3000:]
    assert "[trainer]" in stderr and "[rollout]" not in stderr and "[tool]" not in stderr
    summary = json.loads((tmp_path / "calculator-sft" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["mode"] == "sft"
    assert summary["initial_eval_loss"] > 0 and summary["final_eval_loss"] > 0
    assert (tmp_path / "calculator-sft" / "final_model" / "model.safetensors").is_file()
