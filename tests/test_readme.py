"""The README's config examples are valid configs: documentation that cannot drift."""

import re

import pytest
import yaml

from turnrl.config import REPO_ROOT, validate_config
from turnrl_cli.project_config import ProjectConfig

BLOCKS = re.findall(r"```yaml\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_config_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("block", BLOCKS)
def test_readme_config_example_validates(block):
    validate_config(ProjectConfig, yaml.safe_load(block), path=None, overrides={})
