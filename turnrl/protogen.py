"""Generates the Python stubs in `turnrl/v1/` from `protos/turnrl/v1/*.proto` (`make protos`).

The stubs are committed so that installing turnrl needs no protoc; a test regenerates them
into a temporary folder and fails when they differ from the committed ones.
"""

import sys
import tempfile
from importlib.resources import files
from pathlib import Path

from grpc_tools import protoc

from turnrl.config import REPO_ROOT

PROTO_ROOT = REPO_ROOT / "protos"
STUBS_DIR = REPO_ROOT / "turnrl" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out_dir: Path) -> list[Path]:
    """Writes the stubs of every proto under `protos/turnrl/v1/` into `out_dir`; returns them."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.glob("turnrl/v1/*.proto"))
    plugins = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as tmp:
        code = protoc.main(
            [
                "protoc",
                f"-I{PROTO_ROOT}",
                f"-I{files('grpc_tools') / '_proto'}",
                f"--plugin=protoc-gen-mypy={plugins / 'protoc-gen-mypy'}",
                f"--plugin=protoc-gen-mypy_grpc={plugins / 'protoc-gen-mypy_grpc'}",
                f"--python_out={tmp}",
                f"--grpc_python_out={tmp}",
                f"--mypy_out={tmp}",
                f"--mypy_grpc_out={tmp}",
                *protos,
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} on {protos}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for stub in sorted((Path(tmp) / "turnrl" / "v1").iterdir()):
            target = out_dir / stub.name
            target.write_bytes(stub.read_bytes())
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate(STUBS_DIR):
        print(path.relative_to(REPO_ROOT))
