"""Which policy version sampled each token, as SGLang and vLLM servers report it: spans of
output positions, each labelled with the server's weight-version label, which turnrl's weight
paths set to str(policy_version) after every update."""

from pydantic import BaseModel


class WeightVersionSpan(BaseModel):
    """Output positions [start, end) were sampled under the weights labelled `version`."""

    version: str
    start: int
    end: int


def span_versions(spans: list[WeightVersionSpan]) -> list[int]:
    """One policy version per output position the spans cover."""
    return [version_number(span.version) for span in spans for _ in range(span.end - span.start)]


def version_number(label: str | None) -> int:
    """Our policy version from a server's weight-version label. Pushes label versions with
    their number; any other label (both servers start with "default") means the weights the
    server started with: 0."""
    try:
        return int(label or "0")
    except ValueError:
        return 0
