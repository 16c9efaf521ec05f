"""Where the tests' third-party fixture files come from, and how a machine gets them.

Tests read real tokenizers, chat templates and datasets from a fixtures folder. CI has all of them
in $TURNRL_FIXTURES (../shared/fixtures; its SOURCES.md says where each file came from). A machine
without that folder but with access to the Hugging Face Hub downloads the files the Hub holds, at
pinned commits, into the turnrl cache: `HUB_FILES` says where each one lives there. The fixtures in
`NOT_ON_HUB` have no faithful Hub copy, so only the shared folder has them.
"""

import functools
import io
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pyarrow.parquet as pq
from huggingface_hub import hf_hub_download
from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

from turnrl.config import cache_dir, fixtures_dir


def chat_template_of_tokenizer_config(data: bytes) -> bytes:
    """The `chat_template` a tokenizer_config.json holds, as the .jinja file the fixture is."""
    return json.loads(data)["chat_template"].encode()


def jsonl_of_parquet(data: bytes) -> bytes:
    """A parquet table as JSON lines, written as the original GSM8K release writes them."""
    rows = pq.read_table(io.BytesIO(data)).to_pylist()
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


@dataclass(frozen=True)
class HubFile:
    """A fixture file's source: `filename` in the Hub repo `repo_id` at commit `revision`, turned
    into the fixture's bytes by `convert` where the Hub keeps it in another form."""

    repo_id: str
    filename: str
    revision: str
    repo_type: str = "model"
    convert: Callable[[bytes], bytes] | None = None


# Each commit below is one that public code pins for that repository.
QWEN_IMAGE = "75e0b4be04f60ec59a75f475837eced720f823b6"
QWEN3_0_6B = "c1899de289a04d12100db370d81485cdf75e47ca"
QWEN2_5_0_5B_INSTRUCT = "7ae557604adf67be50417f59c2c2f167def9a775"
QWEN3_4B_INSTRUCT_2507 = "cdbee75f17c01a7cc42f958dc650907174af0554"
PHI_3_5_MINI_INSTRUCT = "2fe192450127e6a83f7441aef6e3ca586c338b77"
GPT_OSS_20B = "6cee5e81ee83917806bbde320786a8fb61efebee"
GLM_4_5 = "cbb2c7cfb52fa128a9660cb1a7a78e017899e115"
NEMOTRON_3_NANO = "cbd3fa9f933d55ef16a84236559f4ee2a0526848"
GSM8K = "e53f048856ff4f594e959d75785d2c2d37b678ee"
QWEN2_5_VL_7B_INSTRUCT = "cc594898137f460bfe9f0759e9844b3ce807cfb5"
QWEN3_VL_4B_INSTRUCT = "ebb281ec70b05090aa6165b016eac8ec08e71b17"

QWEN2_5_TOKENIZER_FILES = (
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "added_tokens.json",
    "special_tokens_map.json",
)

# The vision-language fixtures' folders, Hub repositories and commits.
VLM_REPOS = (
    ("qwen2.5-vl", "Qwen/Qwen2.5-VL-7B-Instruct", QWEN2_5_VL_7B_INSTRUCT),
    ("qwen3-vl", "Qwen/Qwen3-VL-4B-Instruct", QWEN3_VL_4B_INSTRUCT),
)

# Fixture path (relative to the fixtures folder) -> its source on the Hub.
HUB_FILES: dict[str, HubFile] = {
    # The fixture Qwen2.5 tokenizer is the text tokenizer Qwen-Image ships (SOURCES.md, section 1).
    **{
        f"tokenizers/qwen2.5/{name}": HubFile("Qwen/Qwen-Image", f"tokenizer/{name}", QWEN_IMAGE)
        for name in QWEN2_5_TOKENIZER_FILES
    },
    # Qwen2, Qwen2.5 and Qwen3 share one BPE.
    "tokenizers/qwen3/vocab.json": HubFile("Qwen/Qwen3-0.6B", "vocab.json", QWEN3_0_6B),
    "tokenizers/qwen3/merges.txt": HubFile("Qwen/Qwen3-0.6B", "merges.txt", QWEN3_0_6B),
    # The fixture templates are the models' own (TRL keeps them to compare byte for byte): older
    # models keep theirs in tokenizer_config.json, newer ones in chat_template.jinja.
    "chat_templates/qwen2.5-instruct.jinja": HubFile(
        "Qwen/Qwen2.5-0.5B-Instruct",
        "tokenizer_config.json",
        QWEN2_5_0_5B_INSTRUCT,
        convert=chat_template_of_tokenizer_config,
    ),
    "chat_templates/qwen3.jinja": HubFile(
        "Qwen/Qwen3-0.6B",
        "tokenizer_config.json",
        QWEN3_0_6B,
        convert=chat_template_of_tokenizer_config,
    ),
    "chat_templates/qwen3-instruct-2507.jinja": HubFile(
        "Qwen/Qwen3-4B-Instruct-2507",
        "tokenizer_config.json",
        QWEN3_4B_INSTRUCT_2507,
        convert=chat_template_of_tokenizer_config,
    ),
    "chat_templates/phi-3.5-mini-instruct.jinja": HubFile(
        "microsoft/Phi-3.5-mini-instruct",
        "tokenizer_config.json",
        PHI_3_5_MINI_INSTRUCT,
        convert=chat_template_of_tokenizer_config,
    ),
    "chat_templates/gpt-oss.jinja": HubFile(
        "openai/gpt-oss-20b", "chat_template.jinja", GPT_OSS_20B
    ),
    "chat_templates/glm-4-moe.jinja": HubFile("zai-org/GLM-4.5", "chat_template.jinja", GLM_4_5),
    "chat_templates/nemotron-3-nano.jinja": HubFile(
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "chat_template.jinja", NEMOTRON_3_NANO
    ),
    # The vision-language files are the models' own; each template is its chat_template.json's.
    **{
        f"vlm/{name}/{file}": HubFile(repo, file, revision)
        for name, repo, revision in VLM_REPOS
        for file in ("config.json", "preprocessor_config.json")
    },
    **{
        f"vlm/{name}/chat_template.jinja": HubFile(
            repo, "chat_template.json", revision, convert=chat_template_of_tokenizer_config
        )
        for name, repo, revision in VLM_REPOS
    },
    # The Hub keeps the GSM8K release (openai/grade-school-math) as parquet, in the same row order.
    "gsm8k/train.jsonl": HubFile(
        "openai/gsm8k",
        "main/train-00000-of-00001.parquet",
        GSM8K,
        repo_type="dataset",
        convert=jsonl_of_parquet,
    ),
    "gsm8k/test.jsonl": HubFile(
        "openai/gsm8k",
        "main/test-00000-of-00001.parquet",
        GSM8K,
        repo_type="dataset",
        convert=jsonl_of_parquet,
    ),
}

LLAMA_GATED = "its Hub source, a meta-llama repository, is gated"
TRL_MODIFIED = "a TRL training variant, kept on GitHub (huggingface/trl), not on the Hub"

# Fixtures the tests read that have no faithful Hub source -> why.
NOT_ON_HUB: dict[str, str] = {
    "tokenizers/qwen3/tokenizer_config.json": (
        "it holds the launch-era Qwen3 template; no published commit of a Qwen3 repository with "
        "that template was found"
    ),
    "chat_templates/llama-3-instruct.jinja": LLAMA_GATED,
    "chat_templates/llama-3.1-instruct.jinja": LLAMA_GATED,
    "chat_templates/llama-3.2-instruct.jinja": LLAMA_GATED,
    "chat_templates/gemma-3-it.jinja": "its Hub source, a google/gemma-3 repository, is gated",
    "chat_templates/cohere2-command-r7b.jinja": (
        "its Hub source, CohereLabs/c4ai-command-r7b-12-2024, is gated (and CC-BY-NC)"
    ),
    "chat_templates/deepseek-v3.jinja": (
        "deepseek-ai/DeepSeek-V3 has several published commits and which one holds this template "
        "is unknown"
    ),
    "chat_templates/qwen3-trl-training-prefix-preserving.jinja": TRL_MODIFIED,
    "chat_templates/qwen2.5-instruct-trl-training-generation-tags.jinja": TRL_MODIFIED,
    "chat_templates/mistral-vllm-tool-example.jinja": "a vLLM example, kept on GitHub only",
    "search/nq-open-oracle.jsonl.gz": "from GitHub (nelson-liu/lost-in-the-middle) only",
    "search/wiki18_dpr_sample_1000.jsonl": "a FlashRAG sample, kept on GitHub only",
}


class FixturesUnavailableError(RuntimeError):
    """Neither the fixtures folder nor the Hugging Face Hub is there to give the fixtures."""


def resolve_fixtures() -> Path:
    """The test fixtures folder: $TURNRL_FIXTURES (default ../shared/fixtures) when it exists;
    otherwise the `HUB_FILES` downloaded from the Hub (HF_ENDPOINT, HF_HUB_OFFLINE apply) into
    <turnrl cache>/test-fixtures, laid out the same way. A complete download is reused without
    network. Raises FixturesUnavailableError when neither way works. Only the table's files are
    guaranteed there: a warning names the fixtures only the shared folder has."""
    shared = fixtures_dir()
    if shared.is_dir():
        return shared
    downloaded = cache_dir() / "test-fixtures"
    missing = tuple(path for path in HUB_FILES if not (downloaded / path).is_file())
    # huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE once, at import; read here, they take
    # effect however late they are set.
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or None
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ENV_VARS_TRUE_VALUES
    if missing and (failure := download_failure(missing, downloaded, endpoint, offline)):
        raise FixturesUnavailableError(unavailable_message(shared, failure))
    warnings.warn(
        f"Test fixtures come from the Hugging Face Hub ({downloaded}). These have no Hub source, "
        "so tests that read them fail; set TURNRL_FIXTURES to a folder of all fixtures (CI's "
        "../shared/fixtures) for them: "
        + "; ".join(f"{path} ({reason})" for path, reason in NOT_ON_HUB.items()),
        stacklevel=2,
    )
    return downloaded


@functools.cache
def download_failure(
    paths: tuple[str, ...], folder: Path, endpoint: str | None, offline: bool
) -> str | None:
    """Downloads the `HUB_FILES` entries `paths` into `folder`; what went wrong, or None.

    Cached, so a failure is met once per test session, not once per test that asks: an
    unreachable Hub costs about 23 s of huggingface_hub's retries each time."""
    try:
        download_from_hub(paths, folder, endpoint, offline)
    # HfHubHTTPError and the offline and not-found errors are OSErrors; a connection that
    # fails while a file streams surfaces as httpx2's own error.
    except (OSError, httpx2.HTTPError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def download_from_hub(
    paths: Iterable[str], folder: Path, endpoint: str | None, offline: bool
) -> None:
    """Downloads the `HUB_FILES` entries `paths` from `endpoint` (None: the Hub) into `folder` as
    the fixture files; `offline` (HF_HUB_OFFLINE) fails at once, as nothing is cached."""
    # The Hub's own forms of the files (a tokenizer_config.json, a parquet) are not kept.
    with tempfile.TemporaryDirectory() as hub_cache:
        for path in paths:
            source = HUB_FILES[path]
            hub_copy = hf_hub_download(
                repo_id=source.repo_id,
                filename=source.filename,
                revision=source.revision,
                repo_type=source.repo_type,
                cache_dir=hub_cache,
                endpoint=endpoint,
                local_files_only=offline,
                # Every source is public: no token of the user's goes to whatever HF_ENDPOINT is.
                token=False,
            )
            data = Path(hub_copy).read_bytes()
            write_whole(folder / path, source.convert(data) if source.convert else data)


def write_whole(path: Path, data: bytes) -> None:
    """Writes `path` at once, so an interrupted download never leaves a file that looks done."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)


def unavailable_message(shared: Path, failure: str) -> str:
    repos = sorted({source.repo_id for source in HUB_FILES.values()})
    return (
        f"Test fixtures are unavailable: {shared} is not a folder, and downloading them from the "
        f"Hugging Face Hub failed ({failure}).\n"
        "Either set TURNRL_FIXTURES to a folder of the fixtures (CI's ../shared/fixtures), or give "
        "this machine access to the Hugging Face Hub (HF_ENDPOINT, when set, must point at one; "
        "HF_HUB_OFFLINE must be unset) to download from: " + ", ".join(repos) + "."
    )
