"""Prometheus metrics of the reward service, in a registry of its own (no global state)."""

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector

# Scoring latency buckets, in seconds: from a rule scorer (~1 ms) to a judge or code run near
# its timeout.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RewardMetrics:
    """Items scored, their latency, failures by kind, and judge answers without a verdict,
    per scorer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # memory, CPU seconds, open files
        self.items = Counter(
            "turnrl_reward_items",
            "Items scored (failures included); rate() of it is items/s.",
            ["scorer"],
            registry=self.registry,
        )
        self.errors = Counter(
            "turnrl_reward_errors",
            "Items that failed, by kind (a ScoringFailure name: SCORER_BROKEN, ...).",
            ["scorer", "kind"],
            registry=self.registry,
        )
        self.judge_no_verdict = Counter(
            "turnrl_reward_judge_no_verdict",
            "Items an LLM judge answered without a verdict in any sample, scored its "
            "default_score with extras.error saying so (counted in items, not in errors: the "
            "judge did answer).",
            ["scorer"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "turnrl_reward_item_seconds",
            "Wall time of scoring one item, waiting for a slot included.",
            ["scorer"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
