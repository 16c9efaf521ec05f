"""The calculator demo's own model: a tiny Qwen3 built from scratch that has learned the
calculator tool-call format (`tiny_model`, its settings in `settings`, the built demo and test
models in `models/`). An example of a task's model, not part of the core: it stands above the
services (its fine-tuning is the trainer's SFT, `trainer_svc.sft`), and only the wiring
(`turnrl_cli`), the tests, benchmarks and scripts import it; a service is given a model path."""
