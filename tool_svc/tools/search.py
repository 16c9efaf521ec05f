"""`search`: the top-k passages for a query, shown to the model as Search-R1 shows them.

Passages come from one of two back ends; a config sets exactly one:
- `corpus_path`: a local BM25 index (bm25s, English stemming and stopwords) over a FlashRAG /
  Search-R1 JSONL corpus, one `{"id", "contents"}` per line with contents `"Title"\\ntext`. The
  index is built once per corpus content and BM25 setting into `index_cache_dir`, then
  memory-mapped from there, so a restart loads it instead of rebuilding it.
- `retriever_url`: a Search-R1 retriever server, `POST {retriever_url}/retrieve` with
  `{"queries", "topk", "return_scores"}`, answered by `{"result": [[{"document", "score"}]]}`.

A query's passages read `Doc 1(Title: Title) text`, one per line, as Search-R1's
`_passages2string` writes them; a verl-style `query_list` call gets one such block per query.
"""

import asyncio
import hashlib
import json
import mmap
import shutil
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Self

import bm25s
import httpx
import numpy as np
import Stemmer
from pydantic import BaseModel, Field, model_validator

from tool_svc.tools.base import Tool, ToolCallError, ToolErrorKind, ToolResult
from turnrl.config import StrictModel
from turnrl.errors import ConfigError
from turnrl.http_json import MAX_ERROR_BODY_CHARS, HttpJsonError, post_json

DEFAULT_MAX_TOPK = 10
# Bump when the layout of a cached index changes, so older caches are rebuilt, not misread.
CACHE_FORMAT_VERSION = 1
STEMMER_LANGUAGE = "english"
STOPWORDS = "en"
BM25_METHOD = "lucene"
CORPUS_FILE = "corpus.jsonl"
OFFSETS_FILE = "corpus_offsets.npy"
HASH_CHUNK_BYTES = 1 << 20
# Between the blocks of a `query_list` call, as verl's search tool joins them.
BLOCK_SEPARATOR = "\n---\n"
NO_PASSAGES = "No passages matched the query."


class SearchOptions(StrictModel):
    """Where passages come from and how many one call returns."""

    corpus_path: Path | None = Field(
        default=None,
        description="JSONL corpus to index with BM25, one {id, contents} per line, contents "
        "'\"Title\"\\ntext'. Exactly one of corpus_path and retriever_url is set.",
    )
    index_cache_dir: Path = Field(
        default=Path("~/.cache/turnrl/bm25"),
        description="Folder of built BM25 indexes, one subfolder per corpus content and BM25 "
        "setting; '~' is expanded.",
    )
    bm25_k1: float = Field(
        default=1.5, gt=0, description="BM25 term-frequency saturation k1 (unitless)."
    )
    bm25_b: float = Field(
        default=0.75, ge=0, le=1, description="BM25 length normalization b (0: none, 1: full)."
    )
    retriever_url: str | None = Field(
        default=None,
        description="Base URL of a Search-R1 retriever server; calls POST {retriever_url}/retrieve.",
    )
    topk: int = Field(default=3, ge=1, description="Passages per query when a call gives no topk.")
    max_topk: int = Field(
        default=DEFAULT_MAX_TOPK, ge=1, description="Largest topk a call may ask for."
    )
    request_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description="Limit of one retriever call, retries included, in seconds.",
    )
    max_retries: int = Field(
        default=2,
        ge=0,
        description="Retries of a retriever call after a connection error or an HTTP 5xx answer.",
    )

    @model_validator(mode="after")
    def _one_source_and_topk_in_range(self) -> Self:
        if (self.corpus_path is None) == (self.retriever_url is None):
            raise ValueError(
                "set exactly one of corpus_path and retriever_url; got "
                f"corpus_path={self.corpus_path!r}, retriever_url={self.retriever_url!r}"
            )
        if self.topk > self.max_topk:
            raise ValueError(f"topk {self.topk} exceeds max_topk {self.max_topk}")
        return self


def search_schema(max_topk: int) -> dict[str, Any]:
    """The tool's OpenAI function schema, with `topk` bounded by `max_topk`."""
    return {
        "name": "search",
        "description": "Search Wikipedia for passages relevant to a query. Returns the best "
        "passages, each with its article title.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "description": "The search query."},
                "topk": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": max_topk,
                    "description": "How many passages to return.",
                },
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    }


def format_passages(contents: list[str]) -> str:
    """Search-R1's rendering of one query's passages: `Doc i(Title: t) text`, one per line."""
    lines = []
    for i, passage in enumerate(contents):
        title, _, text = passage.partition("\n")
        title = title.strip('"')
        lines.append(f"Doc {i + 1}(Title: {title}) {text}")
    return "\n".join(lines) if lines else NO_PASSAGES


class SearchTool(Tool):
    """Retrieves passages from a local BM25 index or a Search-R1 retriever server.

    Takes `query` (a string) or, with a verl-style schema, `query_list` (strings); a call's
    `topk` may not exceed `max_topk`. A retriever that is down, answers non-200 or malformed
    JSON, or is silent past `request_timeout_seconds` gives an UNAVAILABLE error naming its URL.
    """

    schema: ClassVar[dict[str, Any]] = search_schema(DEFAULT_MAX_TOPK)
    Options = SearchOptions

    def __init__(
        self,
        name: str,
        options: SearchOptions,
        schema: dict[str, Any] | None = None,
        *,
        retriever: "Bm25Index | RetrieverClient",
    ):
        super().__init__(name, options, schema or search_schema(options.max_topk))
        self._retriever = retriever

    @classmethod
    async def from_config(
        cls, name: str, options: dict[str, Any], schema: dict[str, Any] | None
    ) -> list[Tool]:
        """Builds the tool; with `corpus_path`, loads (or first builds) its BM25 index."""
        parsed = SearchOptions.model_validate(options)
        retriever: Bm25Index | RetrieverClient
        if parsed.corpus_path is not None:
            retriever = await asyncio.to_thread(
                Bm25Index.open,
                parsed.corpus_path,
                parsed.index_cache_dir.expanduser(),
                k1=parsed.bm25_k1,
                b=parsed.bm25_b,
            )
        else:
            retriever = RetrieverClient(
                parsed.retriever_url, parsed.request_timeout_seconds, parsed.max_retries
            )
        return [cls(name, parsed, schema, retriever=retriever)]

    async def execute(self, session: Any, args: dict[str, Any]) -> ToolResult:
        queries = self._queries(args)
        options: SearchOptions = self.options
        topk = args.get("topk", options.topk)
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= options.max_topk:
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS,
                f"topk is {topk!r}; allowed: 1 to {options.max_topk}",
            )
        results = await self._retriever.retrieve(queries, topk)
        return ToolResult(text=BLOCK_SEPARATOR.join(format_passages(r) for r in results))

    @staticmethod
    def _queries(args: dict[str, Any]) -> list[str]:
        if "query" in args:
            return [args["query"]]
        queries = args.get("query_list")
        if (
            not isinstance(queries, list)
            or not queries
            or not all(isinstance(q, str) and q for q in queries)
        ):
            raise ToolCallError(
                ToolErrorKind.INVALID_ARGUMENTS,
                "give 'query' (a non-empty string) or 'query_list' (non-empty strings); got "
                f"query_list={queries!r}",
            )
        return queries

    async def close(self) -> None:
        await self._retriever.close()


class Bm25Index:
    """A bm25s index and its passages, memory-mapped from one cache folder.

    Searches may run in many threads at once: nothing here is written after `__init__`.
    """

    def __init__(self, directory: Path):
        self.directory = directory
        self._bm25 = bm25s.BM25.load(directory, mmap=True, show_progress=False)
        # Start of each passage's line in CORPUS_FILE, then the file's end.
        self._offsets = np.load(directory / OFFSETS_FILE, mmap_mode="r")
        with open(directory / CORPUS_FILE, "rb") as file:
            self._corpus = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)

    @classmethod
    def open(cls, corpus_path: Path, cache_root: Path, *, k1: float, b: float) -> "Bm25Index":
        """The cached index of this corpus content and BM25 setting, built first if absent.

        Blocking (reads and hashes the whole corpus): call it in a thread. Raises ConfigError
        for a corpus that is empty or has a line that is not `{"contents": string, ...}`.
        """
        settings = {
            "format": CACHE_FORMAT_VERSION,
            "bm25s": bm25s.__version__,
            "method": BM25_METHOD,
            "k1": k1,
            "b": b,
            "stemmer": STEMMER_LANGUAGE,
            "stopwords": STOPWORDS,
            "corpus_sha256": _file_sha256(corpus_path),
        }
        key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
        directory = cache_root / f"{corpus_path.stem}-{key[:16]}"
        if not directory.is_dir():
            _build_index(corpus_path, directory, k1=k1, b=b)
        return cls(directory)

    def search(self, queries: list[str], topk: int) -> list[list[str]]:
        """Per query, the contents of its best `topk` passages that share a term with it.

        CPU work (numpy releases the GIL): call it in a thread.
        """
        # PyStemmer stemmers are not thread-safe, so each call makes its own.
        tokens = bm25s.tokenize(
            queries,
            stopwords=STOPWORDS,
            stemmer=Stemmer.Stemmer(STEMMER_LANGUAGE),
            return_ids=False,
            show_progress=False,
        )
        k = min(topk, len(self._offsets) - 1)
        indices, scores = self._bm25.retrieve(tokens, k=k, show_progress=False)
        return [
            [self._passage(int(i)) for i, score in zip(row, row_scores, strict=True) if score > 0]
            for row, row_scores in zip(indices, scores, strict=True)
        ]

    def _passage(self, index: int) -> str:
        # Slicing, unlike seek + read, keeps no file position, so threads cannot interfere.
        return json.loads(self._corpus[self._offsets[index] : self._offsets[index + 1]])

    async def retrieve(self, queries: list[str], topk: int) -> list[list[str]]:
        """`search` in a worker thread."""
        return await asyncio.to_thread(self.search, queries, topk)

    async def close(self) -> None:
        """Unmaps the passages; the index arrays go with the object."""
        self._corpus.close()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _read_corpus(path: Path) -> list[str]:
    contents = []
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                passage = json.loads(line)["contents"]
            except (json.JSONDecodeError, TypeError, KeyError):
                passage = None
            if not isinstance(passage, str):
                raise ConfigError(
                    f"{path}:{line_number}: expected a JSON object with a string 'contents', "
                    f"got {line[:MAX_ERROR_BODY_CHARS]!r}"
                )
            contents.append(passage)
    if not contents:
        raise ConfigError(f"corpus {str(path)!r} holds no passages")
    return contents


def _build_index(corpus_path: Path, directory: Path, *, k1: float, b: float) -> None:
    """Indexes the corpus into `directory`, atomically: built aside, then renamed into place."""
    contents = _read_corpus(corpus_path)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        bm25 = bm25s.BM25(k1=k1, b=b, method=BM25_METHOD)
        tokens = bm25s.tokenize(
            contents,
            stopwords=STOPWORDS,
            stemmer=Stemmer.Stemmer(STEMMER_LANGUAGE),
            show_progress=False,
        )
        bm25.index(tokens, show_progress=False)
        bm25.save(staging, show_progress=False)
        offsets = [0]
        with open(staging / CORPUS_FILE, "wb") as file:
            for passage in contents:
                offsets.append(offsets[-1] + file.write(json.dumps(passage).encode() + b"\n"))
        np.save(staging / OFFSETS_FILE, np.asarray(offsets, dtype=np.int64))
        try:
            staging.rename(directory)
        except OSError:
            # Another process built the same index meanwhile; it is identical, so use theirs.
            if not directory.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


class _Document(BaseModel):
    contents: str


class _Hit(BaseModel):
    document: _Document


class _RetrieveResponse(BaseModel):
    result: list[list[_Hit]]


class RetrieverClient:
    """A client of a Search-R1 retriever server: `POST {url}/retrieve`."""

    def __init__(self, url: str, timeout_seconds: float, max_retries: int):
        self.url = url.rstrip("/") + "/retrieve"
        self._timeout_seconds = timeout_seconds
        self._max_retries = max_retries
        # trust_env=False: no proxy or netrc from the environment.
        self._client = httpx.AsyncClient(timeout=timeout_seconds, trust_env=False)

    async def retrieve(self, queries: list[str], topk: int) -> list[list[str]]:
        """Per query, the contents of the passages the server returns, best first."""
        payload = {"queries": queries, "topk": topk, "return_scores": True}
        try:
            reply = await post_json(
                self._client,
                self.url,
                payload,
                _RetrieveResponse,
                timeout_seconds=self._timeout_seconds,
                max_retries=self._max_retries,
            )
        except HttpJsonError as e:
            raise self._unavailable(str(e)) from None
        result = reply.result
        if len(result) != len(queries):
            raise self._unavailable(
                f"answered {len(result)} result lists for {len(queries)} queries"
            )
        return [[hit.document.contents for hit in hits] for hits in result]

    def _unavailable(self, what: str) -> ToolCallError:
        return ToolCallError(ToolErrorKind.UNAVAILABLE, f"retriever at {self.url!r} {what}")

    async def close(self) -> None:
        """Closes the HTTP connections."""
        await self._client.aclose()
