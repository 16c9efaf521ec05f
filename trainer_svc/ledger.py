"""The prompt ledger of an RL run: `ledger.jsonl` in the run folder, lines saying what became
of every prompt group a step settled, so that "was each prompt of the epoch trained exactly
once?" is a question a file answers.

A line is {"step": N, "trained": [...], "filtered": [...], "unused": [...]}, one per step,
written when the step has its batch (so before its checkpoint, and never after it), each list
holding prompt keys "<position>:<prompt id>" (the position of the draw in `EpochSampler`, so a
prompt drawn again in a later epoch has another key); empty lists are left out:
- trained: groups the step's update used;
- filtered: groups dynamic sampling dropped, their rewards all equal (DAPO), and, in the sync
  loop, groups none of whose trajectories was usable (the async loop rolls those out again);
  the async loop's step lists those filtered since the step before;
- unused: groups rolled out but left over when the sync loop's batch was already full.
A group that is rolled out again (too stale, or no trajectory survived an infrastructure
failure) is not settled and appears once it is. On resume the lines after the checkpoint's step
are dropped: the restored model never trained on them, and those prompts are rolled out again.
"""

import json
from pathlib import Path

LEDGER_FILE = "ledger.jsonl"


def prompt_key(position: int, prompt_id: str) -> str:
    """A prompt group's key: the sampler position it was drawn at, and the record's id."""
    return f"{position}:{prompt_id}"


class PromptLedger:
    """Appends the settled prompt groups of each step to `<run_dir>/ledger.jsonl`."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LEDGER_FILE

    def record(self, step: int, **groups: list[str]) -> None:
        """Appends `step`'s line; `groups` maps an outcome (trained, filtered, unused) to keys."""
        line = {"step": step, **{outcome: keys for outcome, keys in groups.items() if keys}}
        with self.path.open("a") as file:
            file.write(json.dumps(line) + "\n")

    def rewind(self, step: int) -> None:
        """Drops the lines of steps after `step` (a resumed run continues from that step)."""
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line and json.loads(line)["step"] <= step
        ]
        self.path.write_text("".join(line + "\n" for line in kept))

    def settled(self) -> dict[str, list[str]]:
        """Every key of the ledger by outcome, in the order settled (a key may recur only if a
        prompt was settled twice, which a correct run never does)."""
        outcomes: dict[str, list[str]] = {}
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                for outcome, keys in json.loads(line).items():
                    if outcome != "step":
                        outcomes.setdefault(outcome, []).extend(keys)
        return outcomes
