"""Hypothesis profiles of the fuzz tests.

"fuzz", the default, is derandomized: every run, CI's included, tries the same examples, so a
failure reproduces and CI never fails on an input no earlier run tried. It writes no example
database. `pytest tests/fuzz --hypothesis-profile=explore` tries ten times as many examples,
from a new random seed each run: the way to look for new crashes by hand.
"""

from hypothesis import HealthCheck, settings

FUZZ_EXAMPLES = 75
settings.register_profile(
    "fuzz",
    max_examples=FUZZ_EXAMPLES,
    derandomize=True,
    database=None,
    # A call to a service can take a second on a loaded machine; timing is not what is tested.
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "explore", parent=settings.get_profile("fuzz"), max_examples=10 * FUZZ_EXAMPLES,
    derandomize=False,
)  # fmt: skip
# Unless the command line named a profile (`--hypothesis-profile`).
if settings.get_current_profile_name() == "default":
    settings.load_profile("fuzz")
