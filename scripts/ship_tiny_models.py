"""Rebuilds the tiny models that ship in `turnrl_demo/models/`: the default settings' (the
tests' model) and the `tiny_model` of each CPU example (calculator, search, code, zoom, the chained
calculator task's warm start that mostly stops after a first call,
examples/calculator/turn_credit.yaml, and the policy and judge of
examples/calculator/judge.yaml), and removes shipped folders none names any more. Run it after
a change to what a build reads (the settings, the tasks' data, the chat template, the builder),
then commit the folders:

    .venv/bin/python scripts/ship_tiny_models.py
"""

import logging
import shutil

from turnrl.config import REPO_ROOT
from turnrl_cli.project_config import load_project_config
from turnrl_demo.settings import TinyModelSettings
from turnrl_demo.tiny_model import SHIPPED_MODELS_DIR, build_tiny_model

EXAMPLE_CONFIGS = [
    *(
        REPO_ROOT / "examples" / task / "config.yaml"
        for task in ("calculator", "search", "code", "zoom")
    ),
    REPO_ROOT / "examples" / "calculator" / "turn_credit.yaml",
    REPO_ROOT / "examples" / "calculator" / "judge.yaml",
]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    examples = [load_project_config(path, []).tiny_model for path in EXAMPLE_CONFIGS]
    wanted = [TinyModelSettings(), *examples]
    folders = {build_tiny_model(SHIPPED_MODELS_DIR, settings=settings) for settings in wanted}
    for folder in SHIPPED_MODELS_DIR.iterdir():
        if folder not in folders:
            shutil.rmtree(folder)
    for folder in sorted(folders):
        # Built as a private temp folder (and safetensors writes its file 0600): the image's
        # user reads them too.
        folder.chmod(0o755)
        for path in folder.iterdir():
            path.chmod(0o644)
        size = sum(path.stat().st_size for path in folder.iterdir())
        print(f"shipped {folder.relative_to(REPO_ROOT)} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
