"""A local stand-in for the Hugging Face Hub: the parts of its HTTP API that huggingface_hub's
(2.4.0) `HfApi.create_repo`, `create_branch` and `upload_folder` call, on 127.0.0.1 in a thread
of its own (starlette + uvicorn). It keeps the repos it was asked to create (private or not)
and the commits made to them (message, branch, files), so a test reads back what was uploaded.

    POST /api/repos/create                       {name, organization, visibility, type}
    POST /api/models/{owner}/{name}/branch/{b}   create_branch
    POST /api/models/{owner}/{name}/preupload/{revision}
                                                 each file's upload mode: always "regular", the
                                                 Hub's answer for small text files, so that the
                                                 client sends the bytes in the commit itself
                                                 and never takes the LFS/Xet path (with hf_xet
                                                 installed, the real Hub's model weights go to
                                                 Xet storage, a protocol this server lacks)
    POST /api/models/{owner}/{name}/commit/{revision}
                                                 the commit, NDJSON: a header line (summary,
                                                 description), then a "file" line per file
                                                 (base64 content)

Every request must carry `Authorization: Bearer <token>`; a wrong token gets 401 as the Hub's.
`reject_commits` makes every commit fail with 403, as a token without write access does;
`hold_commits`, when set, holds each commit until the event is set, as a slow upload would.
"""

import asyncio
import base64
import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


@dataclass
class Commit:
    message: str
    branch: str
    oid: str
    files: dict[str, bytes]  # path in the repo -> content


@dataclass
class Repo:
    private: bool
    branches: set[str] = field(default_factory=lambda: {"main"})
    commits: list[Commit] = field(default_factory=list)

    def tree(self, branch: str = "main") -> dict[str, bytes]:
        """The files of `branch` after its last commit."""
        files: dict[str, bytes] = {}
        for commit in self.commits:
            if commit.branch == branch:
                files.update(commit.files)
        return files


class HubServer:
    """The server and what it holds; `url` is its endpoint once `start` returns."""

    def __init__(self, token: str, reject_commits: bool = False) -> None:
        self.token = token
        self.reject_commits = reject_commits
        self.hold_commits: threading.Event | None = None
        self.repos: dict[str, Repo] = {}
        self.url = ""
        repo = "/api/models/{owner}/{name}"
        app = Starlette(
            routes=[
                Route("/api/repos/create", self._create_repo, methods=["POST"]),
                Route(repo + "/branch/{branch:path}", self._create_branch, methods=["POST"]),
                Route(repo + "/preupload/{revision:path}", self._preupload, methods=["POST"]),
                Route(repo + "/commit/{revision:path}", self._commit, methods=["POST"]),
            ]
        )
        self._server = _Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [listener]}, daemon=True
        )
        self._thread.start()
        assert self._server.ready.wait(timeout=30), "the hub server did not start"

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _refused(self, request: Request) -> JSONResponse | None:
        if request.headers.get("authorization") != f"Bearer {self.token}":
            return _error(401, "Invalid credentials in Authorization header")
        return None

    def _repo(self, request: Request) -> tuple[str, Repo | None]:
        repo_id = "{owner}/{name}".format(**request.path_params)
        return repo_id, self.repos.get(repo_id)

    async def _create_repo(self, request: Request) -> JSONResponse:
        if refused := self._refused(request):
            return refused
        payload = await request.json()
        repo_id = f"{payload['organization']}/{payload['name']}"
        if payload.get("type", "model") != "model":
            return _error(400, f"this server holds model repos only, not {payload['type']!r}")
        url = f"{self.url}/{repo_id}"
        if repo_id in self.repos:  # the client reads the url from this answer too
            return _error(409, "You already created this model repo", body={"url": url})
        self.repos[repo_id] = Repo(private=payload.get("visibility") == "private")
        return JSONResponse({"url": url, "name": repo_id})

    async def _create_branch(self, request: Request) -> JSONResponse:
        if refused := self._refused(request):
            return refused
        repo_id, repo = self._repo(request)
        if repo is None:
            return _error(404, f"Repository not found: {repo_id}", code="RepoNotFound")
        branch = request.path_params["branch"]
        if branch in repo.branches:
            return _error(409, f"Reference refs/heads/{branch} already exists")
        repo.branches.add(branch)
        return JSONResponse({})

    async def _preupload(self, request: Request) -> JSONResponse:
        if refused := self._refused(request):
            return refused
        repo_id, repo = self._repo(request)
        if repo is None:
            return _error(404, f"Repository not found: {repo_id}", code="RepoNotFound")
        files = (await request.json())["files"]
        modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
        return JSONResponse({"files": modes})

    async def _commit(self, request: Request) -> JSONResponse:
        if refused := self._refused(request):
            return refused
        repo_id, repo = self._repo(request)
        if repo is None:
            return _error(404, f"Repository not found: {repo_id}", code="RepoNotFound")
        if self.hold_commits is not None:
            await asyncio.to_thread(self.hold_commits.wait)
        if self.reject_commits:
            return _error(403, "You don't have the rights to write to this repo")
        branch = request.path_params["revision"]
        if branch not in repo.branches:
            return _error(404, f"Invalid rev id: {branch}", code="RevisionNotFound")
        lines = [json.loads(line) for line in (await request.body()).splitlines() if line]
        header, operations = lines[0], lines[1:]
        assert header["key"] == "header", header
        files = {}
        for operation in operations:
            if operation["key"] != "file":  # lfsFile: this server asked for regular uploads
                return _error(400, f"unexpected commit operation {operation['key']!r}")
            value = operation["value"]
            files[value["path"]] = base64.b64decode(value["content"])
        oid = hashlib.sha1(json.dumps([repo_id, len(repo.commits)]).encode()).hexdigest()
        repo.commits.append(Commit(header["value"]["summary"], branch, oid, files))
        url = f"{self.url}/{repo_id}/commit/{oid}"
        return JSONResponse({"commitUrl": url, "commitOid": oid, "pullRequestUrl": None})


class _Server(uvicorn.Server):
    """uvicorn's server, saying when it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


def _error(
    status: int, message: str, code: str | None = None, body: dict | None = None
) -> JSONResponse:
    """An error as the Hub answers it: its message in X-Error-Message and the JSON body."""
    headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
    return JSONResponse({"error": message, **(body or {})}, status_code=status, headers=headers)
