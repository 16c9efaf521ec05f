"""Generate request ids of the RL loops: a rollout service refuses an id that is still running
("already running"), and the calls of a trainer that died may still be ending there when its
run resumes."""

from trainer_svc.config import DataConfig, TrainerConfig
from trainer_svc.controller import Controller
from trainer_svc.data import load_datasets
from trainer_svc.ranks import Ranks


def test_a_resumed_run_never_reuses_the_request_ids_of_the_trainer_before_it(tmp_path):
    config = TrainerConfig.model_validate({})
    prompts, _ = load_datasets(DataConfig(generated_train_size=1), seed=0)
    killed, resumed = (Controller(config, tmp_path / "run", print, Ranks()) for _ in range(2))
    ids = [
        controller._generate_request(prompts, ["a"], tag, training=training).request_id
        for controller in (killed, resumed)
        for tag, training in (("step1.0", True), ("eval1", False))
    ]
    assert len(set(ids)) == 4, ids
    assert all(request_id.startswith("run/") for request_id in ids)
    # One trainer's calls carry one mark: its steps and evaluations stay apart by their tags.
    assert ids[0].rsplit("/", 1)[0] == ids[1].rsplit("/", 1)[0]
