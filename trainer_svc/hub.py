"""Uploads of a run's model to a Hugging Face Hub model repo (`trainer.push_to_hub`), with
huggingface_hub's HfApi, whose calls block: they run one at a time on a thread of their own,
so that a step never waits on the network.

    setup      create_repo(exist_ok) [and the branch]: a rejected token or repo fails the run
               before its first step
    step N     (every_n_steps) the policy exported as final_model would be, into a temporary
               folder of the run, uploaded in one commit; a step that finds the previous upload
               still running skips its own (hub/skipped_uploads): the next due step's is newer
    end        waits for a running upload, then uploads final_model/ (and checkpoints/) and
               waits for it; its commit goes into summary.json. A failed final upload fails the
               run, its files left in final_model/

A failed upload of a step is logged, counted (hub/failed_uploads), named in a progress event
and in summary.json; the run goes on.
"""

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from huggingface_hub import CommitInfo, HfApi

from trainer_svc.config import PushToHubSettings
from turnrl.config import read_secret_env

logger = logging.getLogger(__name__)
# Called with an upload's metrics and a line saying what happened, naming its step.
UploadReport = Callable[[dict[str, float], str], None]


class HubUploadError(Exception):
    """The final upload of a run failed: the run fails, its model left in final_model/."""


class HubPublisher:
    """The uploads of one run to `settings.repo_id`, reported through `report`. Reads the token
    from `settings.token_env` (ConfigError when unset)."""

    def __init__(self, settings: PushToHubSettings, run_name: str, report: UploadReport) -> None:
        self.settings = settings
        self.run_name = run_name
        self._report = report
        token = read_secret_env(settings.token_env)
        self._api = HfApi(endpoint=settings.endpoint, token=token, library_name="turnrl")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hub-upload")
        self._upload: asyncio.Task | None = None
        self.uploads = 0
        self.skipped = 0
        self.failures: list[str] = []

    async def open_repo(self) -> None:
        """Creates the repo (private unless `settings.private` is false) and the branch
        `settings.revision`, unless they exist. Raises HubUploadError when the Hub refuses."""
        try:
            await self._in_thread(self._open_repo)
        except Exception as e:  # any of huggingface_hub's and httpx's errors
            raise HubUploadError(
                f"push_to_hub: cannot create or reach repo {self.settings.repo_id!r} at "
                f"{self._api.endpoint}: {type(e).__name__}: {e}"
            ) from e

    def _open_repo(self) -> None:
        settings = self.settings
        self._api.create_repo(settings.repo_id, private=settings.private, exist_ok=True)
        if settings.revision is not None:
            self._api.create_branch(settings.repo_id, branch=settings.revision, exist_ok=True)

    def ready_for(self, step: int) -> bool:
        """Whether the upload of `step` should start: every_n_steps makes it due and the previous
        upload is done. A due step that finds one running is skipped, and counted."""
        every = self.settings.every_n_steps
        if every is None or step % every:
            return False
        if self._upload is not None and not self._upload.done():
            self.skipped += 1
            message = f"upload of step {step} skipped: the previous upload is still running"
            self._report({"hub/skipped_uploads": float(self.skipped)}, message)
            return False
        return True

    def start_step_upload(self, step: int, folder: Path) -> None:
        """Uploads `folder`, the export of `step`, in the background, then removes it."""
        message = f"turnrl run {self.run_name}: step {step}"
        self._upload = asyncio.create_task(self._upload_folders(step, [(folder, "")], message))
        self._upload.add_done_callback(lambda _: shutil.rmtree(folder, ignore_errors=True))

    async def finish(self, step: int, final_model: Path, checkpoints: Path) -> dict[str, Any]:
        """Waits for a running upload, uploads `final_model` (and, with include_checkpoints,
        `checkpoints` under checkpoints/) and waits for it; returns what summary.json says of
        the uploads, its `final_upload_error` None unless the final upload failed."""
        if self._upload is not None:
            await self._upload
        folders = [(final_model, "")]
        if self.settings.include_checkpoints:  # the run has just checkpointed its last step
            folders.append((checkpoints, checkpoints.name))
        message = f"turnrl run {self.run_name}: final model, step {step}"
        final = await self._upload_folders(step, folders, message)
        self._executor.shutdown()
        return {
            "repo_id": self.settings.repo_id,
            "revision": self.settings.revision or "main",
            "commit_url": final.commit_url if final is not None else None,
            "commit_oid": final.oid if final is not None else None,
            "uploads": self.uploads,
            "skipped_uploads": self.skipped,
            "failed_uploads": self.failures,
            "final_upload_error": None if final is not None else self.failures[-1],
        }

    def close(self) -> None:
        """Cancels a running upload (a failed run's) and lets the thread go."""
        if self._upload is not None:
            self._upload.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _upload_folders(
        self, step: int, folders: list[tuple[Path, str]], message: str
    ) -> CommitInfo | None:
        """Uploads each (folder, path in the repo), one commit each, and reports the result;
        the last commit, or None when an upload failed (logged, counted and reported)."""
        started = time.monotonic()
        try:
            for folder, path_in_repo in folders:
                commit = await self._in_thread(self._upload_folder, folder, path_in_repo, message)
        except Exception as e:  # any of huggingface_hub's and httpx's errors
            logger.exception("upload of step %d to %s failed", step, self.settings.repo_id)
            self.failures.append(f"step {step}: {type(e).__name__}: {e}")
            metrics = {"hub/failed_uploads": float(len(self.failures))}
            self._report(metrics, f"upload to {self.settings.repo_id} failed: {self.failures[-1]}")
            return None
        self.uploads += 1
        seconds = time.monotonic() - started
        metrics = {"hub/uploads": float(self.uploads), "hub/upload_seconds": seconds}
        self._report(metrics, f"step {step} uploaded: {commit.commit_url}")
        return commit

    def _upload_folder(self, folder: Path, path_in_repo: str, message: str) -> CommitInfo:
        return self._api.upload_folder(
            repo_id=self.settings.repo_id,
            folder_path=folder,
            path_in_repo=path_in_repo,
            commit_message=message,
            revision=self.settings.revision,
        )

    async def _in_thread(self, function: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)
