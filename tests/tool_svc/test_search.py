"""The `search` tool: BM25 over a real Wikipedia + NQ corpus, its index cache, and the client of
a Search-R1 retriever server (a local stand-in speaking the real `/retrieve` wire format)."""

import asyncio
import contextlib
import gzip
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bm25s
import pydantic
import pytest
import Stemmer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests.tool_svc.http_stand_in import serve_app
from tool_svc.tools.base import ToolCallError, ToolErrorKind
from tool_svc.tools.search import SearchTool, format_passages
from turnrl.errors import ConfigError

RECALL_QUESTIONS = 200
# Measured recall@3 of the gold passage over the first 200 questions: 0.89 (all 2655: 0.89).
MIN_RECALL_AT_3 = 0.8
# verl's search tool schema: a list of queries instead of one.
VERL_SCHEMA = {
    "name": "search",
    "description": "Searches for relevant information based on queries.",
    "parameters": {
        "type": "object",
        "properties": {"query_list": {"type": "array", "items": {"type": "string"}}},
        "required": ["query_list"],
    },
}


@dataclass(frozen=True)
class Corpus:
    """The test corpus: 1000 wiki-18 passages, then one gold passage per NQ question."""

    path: Path
    contents: list[str]
    questions: list[dict[str, Any]]


@pytest.fixture(scope="module")
def corpus(fixtures: Path, tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    search = fixtures / "search"
    passages = [json.loads(line) for line in (search / "wiki18_dpr_sample_1000.jsonl").open()]
    with gzip.open(search / "nq-open-oracle.jsonl.gz", "rt") as file:
        questions = [json.loads(line) for line in file]
    for i, question in enumerate(questions):
        gold = question["ctxs"][0]
        passages.append({"id": f"nq-{i}", "contents": f'"{gold["title"]}"\n{gold["text"]}'})
    assert len({p["id"] for p in passages}) == len(passages)
    path = tmp_path_factory.mktemp("corpus") / "wiki_nq.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in passages))
    return Corpus(path, [p["contents"] for p in passages], questions)


@pytest.fixture(scope="module")
def index_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module: the first tool builds the index, later ones load it."""
    return tmp_path_factory.mktemp("bm25_cache")


@contextlib.asynccontextmanager
async def make_tool(options: dict[str, Any], schema=None) -> AsyncIterator[SearchTool]:
    [tool] = await SearchTool.from_config("search", options, schema)
    try:
        yield tool
    finally:
        await tool.close()


@pytest.fixture
async def local_tool(corpus: Corpus, index_cache_dir: Path) -> AsyncIterator[SearchTool]:
    options = {"corpus_path": str(corpus.path), "index_cache_dir": str(index_cache_dir)}
    async with make_tool(options) as tool:
        yield tool


async def search(tool: SearchTool, **args: Any) -> str:
    """Runs one call as the model would make it; returns the observation text."""
    return (await tool.execute(None, tool.parse_args(json.dumps(args)))).text


async def test_bm25_finds_the_gold_passage_in_the_top_3(local_tool: SearchTool, corpus: Corpus):
    questions = corpus.questions[:RECALL_QUESTIONS]
    texts = [await search(local_tool, query=q["question"]) for q in questions]
    found = sum(q["ctxs"][0]["text"] in text for q, text in zip(questions, texts, strict=True))
    recall = found / len(questions)
    assert recall >= MIN_RECALL_AT_3, f"recall@3 {recall:.3f}"
    assert all(text.count("\nDoc ") == 2 for text in texts)


async def test_output_is_search_r1_format(tmp_path: Path):
    contents = [
        '"Alpha Centauri"\nAlpha Centauri is a star system, the closest to the Sun.',
        '"Beta"\nBeta is a letter.\nIt has a second line about star charts.',
        '"Gamma"\nGamma rays are photons.',
    ]
    corpus_path = tmp_path / "tiny.jsonl"
    corpus_path.write_text(
        "".join(json.dumps({"id": i, "contents": c}) + "\n" for i, c in enumerate(contents))
    )
    options = {"corpus_path": str(corpus_path), "index_cache_dir": str(tmp_path / "cache")}
    async with make_tool(options) as tool:
        text = await search(tool, query="Alpha Centauri star system", topk=2)
        unmatched = await search(tool, query="the")
    assert text == (
        "Doc 1(Title: Alpha Centauri) Alpha Centauri is a star system, the closest to the Sun.\n"
        "Doc 2(Title: Beta) Beta is a letter.\nIt has a second line about star charts."
    )
    assert unmatched == "No passages matched the query."


def test_format_passages_matches_search_r1():
    # Search-R1: title = first line, text = the other lines joined by "\n"; one line per doc.
    passages = ['"T1"\nline one\nline two', "T2 without quotes\n", "no newline"]
    assert format_passages(passages) == (
        "Doc 1(Title: T1) line one\nline two\nDoc 2(Title: T2 without quotes) \n"
        "Doc 3(Title: no newline) "
    )


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Inode and mtime of `root` (".") and of everything under it."""
    return {
        str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in [root, *root.rglob("*")]
    }


async def test_index_cache_is_reused_and_rebuilt_when_the_corpus_changes(
    fixtures: Path, tmp_path: Path
):
    corpus_path = tmp_path / "wiki.jsonl"
    corpus_path.write_bytes((fixtures / "search" / "wiki18_dpr_sample_1000.jsonl").read_bytes())
    cache = tmp_path / "cache"
    options = {"corpus_path": str(corpus_path), "index_cache_dir": str(cache)}
    async with make_tool(options) as tool:
        assert await search(tool, query="Zyxwquv") == "No passages matched the query."
    built = _snapshot(cache)
    [index_dir] = [p for p in cache.iterdir()]
    assert index_dir.name.startswith("wiki-")

    async with make_tool(options):
        pass
    # Loaded, not rebuilt: same files, inodes and mtimes, and nothing staged in the cache root.
    assert _snapshot(cache) == built

    new_passage = {"id": "new", "contents": '"Zyxwquv"\nZyxwquv is a made-up word.'}
    with corpus_path.open("a") as file:
        file.write(json.dumps(new_passage) + "\n")
    async with make_tool(options) as tool:
        text = await search(tool, query="Zyxwquv")
    assert text == "Doc 1(Title: Zyxwquv) Zyxwquv is a made-up word."
    assert len(list(cache.iterdir())) == 2
    old_index = {k: v for k, v in built.items() if k != "."}
    assert {k: v for k, v in _snapshot(cache).items() if k in old_index} == old_index

    async with make_tool({**options, "bm25_k1": 1.2}):
        pass
    assert len(list(cache.iterdir())) == 3  # Another BM25 setting is another index.


async def test_corpus_line_without_contents_is_a_config_error(tmp_path: Path):
    corpus_path = tmp_path / "bad.jsonl"
    corpus_path.write_text('{"id": 0, "contents": "\\"T\\"\\ntext"}\n{"id": 1, "text": "x"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2: .*'contents'"):
        await SearchTool.from_config(
            "search", {"corpus_path": str(corpus_path), "index_cache_dir": str(tmp_path)}, None
        )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("{}", "'query' is a required property"),
        ('{"query": "x", "topk": 0}', "topk: 0 is less than the minimum of 1"),
        ('{"query": "x", "topk": 11}', "topk: 11 is greater than the maximum of 10"),
    ],
)
async def test_bad_arguments_are_invalid(local_tool: SearchTool, raw: str, expected: str):
    with pytest.raises(ToolCallError) as caught:
        local_tool.parse_args(raw)
    assert caught.value.kind is ToolErrorKind.INVALID_ARGUMENTS
    assert expected in caught.value.message


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"corpus_path": "c.jsonl", "retriever_url": "http://127.0.0.1:1"},
        {"retriever_url": "http://127.0.0.1:1", "topk": 5, "max_topk": 4},
    ],
)
async def test_bad_options_are_rejected(options: dict[str, Any]):
    with pytest.raises(pydantic.ValidationError):
        await SearchTool.from_config("search", options, None)


@dataclass
class RetrieverServer:
    """The stand-in retriever: URL, bodies received, and how it misbehaves (if it does)."""

    url: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)
    failures_left: int = 0  # Answers HTTP 500 to this many requests first.
    canned: Response | None = None
    hang: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture(scope="module")
def server_index(corpus: Corpus) -> bm25s.BM25:
    """The stand-in's own BM25 index, with the tool's settings, built with bm25s directly."""
    stemmer = Stemmer.Stemmer("english")
    index = bm25s.BM25()
    tokens = bm25s.tokenize(corpus.contents, stopwords="en", stemmer=stemmer, show_progress=False)
    index.index(tokens, show_progress=False)
    return index


@pytest.fixture
async def retriever(corpus: Corpus, server_index: bm25s.BM25) -> AsyncIterator[RetrieverServer]:
    state = RetrieverServer()
    stemmer = Stemmer.Stemmer("english")

    async def retrieve(request: Request) -> Response:
        body = await request.json()
        state.requests.append(body)
        if state.hang:
            await state.release.wait()
        if state.failures_left:
            state.failures_left -= 1
            return PlainTextResponse("retriever overloaded", status_code=500)
        if state.canned is not None:
            return state.canned
        tokens = bm25s.tokenize(
            body["queries"], stopwords="en", stemmer=stemmer, return_ids=False, show_progress=False
        )
        indices, scores = server_index.retrieve(tokens, k=body["topk"], show_progress=False)
        result = [
            [
                {"document": {"id": str(i), "contents": corpus.contents[i]}, "score": float(s)}
                for i, s in zip(row, row_scores, strict=True)
            ]
            for row, row_scores in zip(indices, scores, strict=True)
        ]
        return JSONResponse({"result": result})

    async with serve_app(Starlette(routes=[Route("/retrieve", retrieve, methods=["POST"])])) as url:
        state.url = url
        try:
            yield state
        finally:
            state.release.set()


def remote_options(url: str, **options: Any) -> dict[str, Any]:
    return {"retriever_url": url, "request_timeout_seconds": 5, **options}


async def test_remote_results_match_local_bm25(
    retriever: RetrieverServer, local_tool: SearchTool, corpus: Corpus
):
    questions = [q["question"] for q in corpus.questions[:20]]
    async with make_tool(remote_options(retriever.url)) as remote:
        for question in questions:
            assert await search(remote, query=question) == await search(local_tool, query=question)
        topk_5 = await search(remote, query=questions[0], topk=5)
    assert topk_5.count("\nDoc ") == 4
    assert retriever.requests[0] == {"queries": [questions[0]], "topk": 3, "return_scores": True}


async def test_query_list_gives_one_block_per_query(
    retriever: RetrieverServer, local_tool: SearchTool, corpus: Corpus
):
    questions = [q["question"] for q in corpus.questions[:2]]
    async with make_tool(remote_options(retriever.url), schema=VERL_SCHEMA) as remote:
        text = await search(remote, query_list=questions)
    first, second = [await search(local_tool, query=q) for q in questions]
    assert text == f"{first}\n---\n{second}"
    assert retriever.requests == [{"queries": questions, "topk": 3, "return_scores": True}]


async def test_server_errors_are_retried(retriever: RetrieverServer, corpus: Corpus):
    retriever.failures_left = 2
    async with make_tool(remote_options(retriever.url, max_retries=2)) as remote:
        text = await search(remote, query=corpus.questions[0]["question"])
    assert text.startswith("Doc 1(Title: ")
    assert len(retriever.requests) == 3


async def test_persistent_server_error_is_unavailable_naming_url_and_status(
    retriever: RetrieverServer,
):
    retriever.failures_left = 100
    async with make_tool(remote_options(retriever.url, max_retries=1)) as remote:
        with pytest.raises(ToolCallError) as caught:
            await search(remote, query="anything")
    assert caught.value.kind is ToolErrorKind.UNAVAILABLE
    assert f"{retriever.url}/retrieve" in caught.value.message
    assert "HTTP 500" in caught.value.message
    assert len(retriever.requests) == 2


async def test_malformed_answer_is_unavailable(retriever: RetrieverServer):
    retriever.canned = JSONResponse({"result": [[{"score": 1.0}]]})
    async with make_tool(remote_options(retriever.url)) as remote:
        with pytest.raises(ToolCallError) as caught:
            await search(remote, query="anything")
    assert caught.value.kind is ToolErrorKind.UNAVAILABLE
    assert "malformed" in caught.value.message


async def test_silent_server_is_unavailable_after_the_timeout(retriever: RetrieverServer):
    retriever.hang = True
    options = remote_options(retriever.url, request_timeout_seconds=0.3)
    async with make_tool(options) as remote:
        with pytest.raises(ToolCallError) as caught:
            await search(remote, query="anything")
    assert caught.value.kind is ToolErrorKind.UNAVAILABLE
    assert "did not answer within 0.3 s" in caught.value.message


async def test_server_down_is_unavailable_naming_url():
    # A bound socket that does not listen: connections to it are refused.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with make_tool(remote_options(url, max_retries=1)) as remote:
            with pytest.raises(ToolCallError) as caught:
                await search(remote, query="anything")
    assert caught.value.kind is ToolErrorKind.UNAVAILABLE
    assert f"{url}/retrieve" in caught.value.message
    assert "unreachable" in caught.value.message
