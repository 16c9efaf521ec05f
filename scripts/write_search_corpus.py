"""Writes the CPU search task's corpus, `examples/search/corpus.jsonl`: the generated world's
passages (turnrl.search_world), one FlashRAG/Search-R1 JSONL row per town. Run it after a change
to the world, then commit the file (a test checks it against the generator):

    .venv/bin/python scripts/write_search_corpus.py
"""

import json

from turnrl.config import REPO_ROOT
from turnrl.search_world import corpus_rows

CORPUS = REPO_ROOT / "examples" / "search" / "corpus.jsonl"


def main() -> None:
    CORPUS.write_text("".join(json.dumps(row) + "\n" for row in corpus_rows()))
    print(f"wrote {CORPUS.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
