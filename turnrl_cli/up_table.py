"""Reading `turnrl up`'s output back: the rows of its address table (`launcher._table`) and the
line that says every service is SERVING. The tests and the benchmarks that start `turnrl up`
read it with these, so a change to the table is made here once."""

import re
from dataclasses import dataclass

# A row of the table as rich draws it: service (with #replica after the first), address, and
# where it runs (`pid N` for a local process).
UP_TABLE_ROW = re.compile(
    r"((?:tool|reward|rollout|trainer)(?:#\d+)?)\s*│\s*(127\.0\.0\.1:\d+)\s*│\s*pid (\d+)"
)
# Printed after the table once every service is SERVING (`launcher.up`).
UP_READY_LINE = "Ctrl-C stops them"


@dataclass(frozen=True)
class UpRow:
    """One service as `turnrl up` lists it."""

    name: str  # "rollout", "rollout#1", ...
    address: str  # host:port
    pid: int


def up_row(line: str) -> UpRow | None:
    """The service `line` lists, or None for any other line."""
    if match := UP_TABLE_ROW.search(line):
        return UpRow(name=match.group(1), address=match.group(2), pid=int(match.group(3)))
    return None


def up_rows(text: str) -> dict[str, UpRow]:
    """Every service listed in `text` (all of `turnrl up --check`'s output), by name."""
    rows = (up_row(line) for line in text.splitlines())
    return {row.name: row for row in rows if row is not None}
