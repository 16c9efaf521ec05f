"""Prometheus metrics of the rollout service, made from `RolloutService.stats()` at each scrape:
the counts GetStats reports, kept once."""

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from turnrl.metrics import metric


@dataclass(frozen=True)
class StatsMetric:
    """One metric made of a value in `stats()["metrics"]`, which engines may name differently."""

    name: str
    documentation: str
    counter: bool  # a running total (rate() gives it per second), else a gauge
    keys: tuple[str, ...]  # the value's names: the hf engine's, then the server engines'


# Under one name whichever engine runs; every other value of `stats()["metrics"]` is exposed
# as the gauge turnrl_rollout_engine_<its name>.
NAMED_METRICS = (
    StatsMetric(
        "turnrl_rollout_requests_running",
        "Generate requests the engine runs now.",
        False,
        ("running", "running_requests"),
    ),
    StatsMetric(
        "turnrl_rollout_requests_queued",
        "Requests waiting for a place in the engine's batch (hf engine).",
        False,
        ("waiting",),
    ),
    StatsMetric(
        "turnrl_rollout_generated_tokens",
        "Tokens the engine generated; rate() of it is tokens/s.",
        True,
        ("tokens_generated", "generated_tokens_total"),
    ),
    StatsMetric(
        "turnrl_rollout_kv_cache_bytes",
        "KV cache bytes held by the running requests (hf engine).",
        False,
        ("running_kv_bytes",),
    ),
    StatsMetric(
        "turnrl_rollout_weight_pushes",
        "Weight updates and pushes loaded into the engine.",
        True,
        ("weight_pushes",),
    ),
    StatsMetric(
        "turnrl_rollout_weight_push_bytes",
        "Bytes of weights loaded into the engine.",
        True,
        ("weight_push_bytes",),
    ),
    StatsMetric(
        "turnrl_rollout_last_weight_push_stall_seconds",
        "How long generation was paused for the last weight load.",
        False,
        ("last_weight_push_stall_seconds",),
    ),
)


def rollout_metrics(stats: dict[str, Any]) -> Iterator[Metric]:
    """The metrics of one `RolloutService.stats()`, each labelled with the engine's name."""
    engine = {"engine": stats["engine"]}
    yield metric(
        "turnrl_rollout_running_trajectories",
        "Trajectories being rolled out now.",
        False,
        [(engine, stats["running_trajectories"])],
    )
    yield metric(
        "turnrl_rollout_finished_trajectories",
        "Trajectories rolled out to their end.",
        True,
        [(engine, stats["finished_trajectories"])],
    )
    yield metric(
        "turnrl_rollout_policy_version",
        "Version of the weights the engine holds.",
        False,
        [(engine, stats["policy_version"])],
    )
    yield metric(
        "turnrl_rollout_paused", "1 while generation is paused.", False, [(engine, stats["paused"])]
    )
    values = dict(stats["metrics"])
    for named in NAMED_METRICS:
        key = next((k for k in named.keys if k in values), None)
        if key is not None:
            yield metric(
                named.name, named.documentation, named.counter, [(engine, values.pop(key))]
            )
    for key, value in sorted(values.items()):
        name = "turnrl_rollout_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
        yield metric(name, f"GetStats metric {key!r}.", False, [(engine, value)])
