"""Images the python tool's code writes in /workspace, returned with the call's result.

The work dir is a host folder that untrusted code wrote, so it is read without following any
link: only regular files named *.png, *.jpg, *.jpeg or *.webp, opened with O_NOFOLLOW, count.
Those new or changed since the call began are checked like every image (turnrl.images) and
returned in path order, at most `max_images`; each one skipped (over the count or the size,
not a readable image) is named in a note the model reads with the output.
"""

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from tool_svc.tools.base import ToolImage
from turnrl.errors import InvalidArgumentError
from turnrl.images import ImageSettings, load_image
from turnrl.v1 import common_pb2

# The file names that count as images, with the media type each must hold.
MIME_TYPES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".webp": "image/webp",
}
MAX_ENTRIES = 10_000  # entries looked at per scan: code that writes a million files is not walked

# A file's identity for "changed since": its modification time and size.
Stamps = dict[str, tuple[int, int]]


@dataclass
class WorkspaceImages:
    """The images a call wrote, and a note per image it wrote that is not among them."""

    images: list[ToolImage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def image_stamps(workdir: Path) -> Stamps:
    """Each image file under `workdir` now, by path relative to it."""
    stamps: Stamps = {}
    for path, info in _image_files(workdir):
        stamps[path] = (info.st_mtime_ns, info.st_size)
    return stamps


def new_images(
    workdir: Path, before: Stamps, max_images: int, settings: ImageSettings
) -> WorkspaceImages:
    """The images under `workdir` that are not in `before` as they are now."""
    found = WorkspaceImages()
    for path, info in sorted(_image_files(workdir)):
        if before.get(path) == (info.st_mtime_ns, info.st_size):
            continue
        if len(found.images) == max_images:
            found.notes.append(f"[{path} not shown: at most {max_images} images per call]")
            continue
        if info.st_size > settings.max_image_bytes:
            found.notes.append(
                f"[{path} not shown: {info.st_size} bytes, over {settings.max_image_bytes}]"
            )
            continue
        try:
            data = _read_regular_file(workdir / path, settings.max_image_bytes)
        except OSError as e:  # strerror only: the host path of the work dir stays unsaid
            found.notes.append(f"[{path} not shown: {e.strerror or e}]")
            continue
        try:
            declared = MIME_TYPES[os.path.splitext(path)[1].lower()]
            image = load_image(common_pb2.Image(data=data, mime_type=declared), settings, path)
        except InvalidArgumentError as e:
            found.notes.append(f"[not shown: {e}]")
            continue
        found.images.append(ToolImage(image.data, image.mime_type))
    return found


def _image_files(workdir: Path) -> list[tuple[str, os.stat_result]]:
    """(relative path, lstat) of each regular file with an image suffix under `workdir`,
    links not followed; at most MAX_ENTRIES entries are looked at."""
    files: list[tuple[str, os.stat_result]] = []
    seen = 0
    for folder, dirs, names in os.walk(workdir, followlinks=False):
        for name in names:
            seen += 1
            if seen > MAX_ENTRIES:
                return files
            if os.path.splitext(name)[1].lower() not in MIME_TYPES:
                continue
            path = os.path.join(folder, name)
            try:
                info = os.lstat(path)
            except OSError:  # removed since listed
                continue
            if stat.S_ISREG(info.st_mode):
                files.append((os.path.relpath(path, workdir), info))
        seen += len(dirs)
    return files


def _read_regular_file(path: Path, max_bytes: int) -> bytes:
    """The file's bytes, refusing a link or anything but a regular file (it may have been
    swapped since it was listed) and anything over `max_bytes`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise OSError(f"{path.name} grew over {max_bytes} bytes")
    return data
