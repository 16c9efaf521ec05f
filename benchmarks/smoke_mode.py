"""`--smoke`, which every benchmark takes: its own tiny sizes, a run of a few seconds that
`tests/benchmarks/test_smoke.py` makes in `make test`, so that no benchmark stops running
unnoticed. Options given beside it still win."""

import argparse
from typing import Any


def parse_args(parser: argparse.ArgumentParser, smoke: dict[str, Any]) -> argparse.Namespace:
    """`parser.parse_args()`, with `--smoke` added: it makes `smoke` (option dest -> value)
    the defaults."""
    parser.add_argument(
        "--smoke", action="store_true", help=f"tiny sizes for a run of a few seconds: {smoke}"
    )
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args()
