"""resolve_fixtures against a stand-in of the Hugging Face Hub on 127.0.0.1.

The stand-in speaks the Hub's file protocol as huggingface_hub's hf_hub_download uses it: HEAD and
GET of <endpoint>/[datasets/]<repo id>/resolve/<revision>/<file name>, answered with the
X-Repo-Commit, ETag and Content-Length headers, or with a 404 carrying the Hub's X-Error-Code. It
serves each table entry at its pinned revision only, in the Hub's form of the file, built from the
real fixtures.
"""

import contextlib
import hashlib
import io
import json
import re
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.fixture_files import (
    HUB_FILES,
    FixturesUnavailableError,
    HubFile,
    chat_template_of_tokenizer_config,
    jsonl_of_parquet,
    resolve_fixtures,
)

RESOLVE_PATH = re.compile(r"/(?P<repo>(?:datasets/)?[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/.+")


def tokenizer_config_holding(template: bytes) -> bytes:
    return json.dumps({"chat_template": template.decode()}, indent=2).encode()


def parquet_of_jsonl(lines: bytes) -> bytes:
    rows = [json.loads(line) for line in lines.decode().splitlines()]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


# Each conversion's inverse: the Hub's form of a fixture file.
HUB_FORM = {
    None: lambda data: data,
    chat_template_of_tokenizer_config: tokenizer_config_holding,
    jsonl_of_parquet: parquet_of_jsonl,
}


def resolve_url_path(source: HubFile, revision: str) -> str:
    prefix = "datasets/" if source.repo_type == "dataset" else ""
    return f"/{prefix}{source.repo_id}/resolve/{revision}/{source.filename}"


def hub_files(fixtures: Path, revision: str | None = None) -> dict[str, bytes]:
    """URL path -> content, for every table entry at its pinned revision (or at `revision`)."""
    return {
        resolve_url_path(source, revision or source.revision): HUB_FORM[source.convert](
            (fixtures / path).read_bytes()
        )
        for path, source in HUB_FILES.items()
    }


class HubHandler(BaseHTTPRequestHandler):
    server: "HubStandIn"

    def do_HEAD(self) -> None:
        self.answer(with_body=False)

    def do_GET(self) -> None:
        self.answer(with_body=True)

    def answer(self, with_body: bool) -> None:
        self.server.requests.append((self.command, self.path))
        content = self.server.files.get(self.path)
        if content is None:
            self.send_response(404)
            self.send_header("X-Error-Code", self.server.error_code(self.path))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("X-Repo-Commit", RESOLVE_PATH.fullmatch(self.path)["revision"])
        # The Hub's ETag of a file kept in git: its git blob id.
        blob_id = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
        self.send_header("ETag", f'"{blob_id}"')
        self.send_header("Content-Length", str(len(content)))
        self.end_headers()
        if with_body:
            self.wfile.write(content)

    def log_message(self, format: str, *args) -> None:
        """Quiet: the test asserts on `requests` instead."""


class HubStandIn(ThreadingHTTPServer):
    """Serves `files` (URL path -> content) on 127.0.0.1 and records every request."""

    def __init__(self, files: dict[str, bytes]):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.files = files
        self.requests: list[tuple[str, str]] = []
        self.revisions = {
            match["repo"]: match["revision"] for match in map(RESOLVE_PATH.fullmatch, files)
        }

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def error_code(self, path: str) -> str:
        """The X-Error-Code the Hub gives for a file it lacks."""
        match = RESOLVE_PATH.fullmatch(path)
        if match is None or match["repo"] not in self.revisions:
            return "RepoNotFound"
        if match["revision"] != self.revisions[match["repo"]]:
            return "RevisionNotFound"
        return "EntryNotFound"


@contextlib.contextmanager
def hub_stand_in(files: dict[str, bytes]) -> Iterator[HubStandIn]:
    hub = HubStandIn(files)
    thread = threading.Thread(target=hub.serve_forever)
    thread.start()
    try:
        yield hub
    finally:
        hub.shutdown()
        thread.join()
        hub.server_close()


def closed_local_url() -> str:
    """The URL of a 127.0.0.1 port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def no_fixtures_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A machine without the fixtures folder, whose Hub is nowhere until a test starts one;
    returns where its Hub downloads go."""
    monkeypatch.setenv("TURNRL_FIXTURES", str(tmp_path / "no-fixtures-here"))
    monkeypatch.setenv("TURNRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_ENDPOINT", closed_local_url())
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "cache" / "test-fixtures"


def test_without_the_folder_the_table_files_come_from_the_hub_at_their_pinned_revisions(
    fixtures: Path, no_fixtures_folder: Path, monkeypatch: pytest.MonkeyPatch
):
    with hub_stand_in(hub_files(fixtures)) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.warns(UserWarning, match="search/wiki18_dpr_sample_1000.jsonl"):
            folder = resolve_fixtures()
    assert folder == no_fixtures_folder
    assert {path for method, path in hub.requests if method == "GET"} == set(hub.files)
    for path in HUB_FILES:
        assert (folder / path).read_bytes() == (fixtures / path).read_bytes(), path
    assert not list(folder.rglob("*.partial"))

    # The server is gone and the Hub is off limits: a complete folder needs neither.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.warns(UserWarning, match="no Hub source"):
        assert resolve_fixtures() == folder


@pytest.mark.filterwarnings("error")
def test_an_existing_fixtures_folder_is_used_and_nothing_is_fetched(
    fixtures: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv("TURNRL_FIXTURES", str(shared))
    monkeypatch.setenv("TURNRL_CACHE", str(tmp_path / "cache"))
    with hub_stand_in(hub_files(fixtures)) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        assert resolve_fixtures() == shared
    assert hub.requests == []
    assert not (tmp_path / "cache").exists()


def test_without_the_folder_or_the_hub_the_error_names_both_ways(
    no_fixtures_folder: Path, monkeypatch: pytest.MonkeyPatch
):
    # Offline as well as a closed port: huggingface_hub alone would retry the refused connection
    # with backoff for about 20 seconds before it gives up.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FixturesUnavailableError) as raised:
        resolve_fixtures()
    assert_names_both_ways(str(raised.value), "LocalEntryNotFoundError")
    assert "openai/gsm8k" in str(raised.value)
    assert not no_fixtures_folder.exists()


def test_a_hub_without_the_pinned_revisions_is_an_error_naming_both_ways(
    fixtures: Path, no_fixtures_folder: Path, monkeypatch: pytest.MonkeyPatch
):
    with hub_stand_in(hub_files(fixtures, revision="1" * 40)) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(FixturesUnavailableError) as raised:
            resolve_fixtures()
    assert_names_both_ways(str(raised.value), "RevisionNotFoundError")
    assert not no_fixtures_folder.exists()


def assert_names_both_ways(message: str, cause: str) -> None:
    assert "TURNRL_FIXTURES" in message
    assert "Hugging Face Hub" in message
    assert cause in message
