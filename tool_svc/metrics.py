"""Prometheus metrics of the tool service, in a registry of its own (no global state)."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

# Call latency buckets, in seconds: from a calculator (~1 ms) to a sandbox run near its limit.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ToolMetrics:
    """Calls, errors by kind, latency, queue depth, calls in flight and live sessions, per tool."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # memory, CPU seconds, open files
        self.calls = Counter(
            "turnrl_tool_calls", "Tool calls received.", ["tool"], registry=self.registry
        )
        self.errors = Counter(
            "turnrl_tool_errors",
            "Tool calls that failed, by kind (ToolError.Kind, or QUEUE_FULL for refused calls).",
            ["tool", "kind"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "turnrl_tool_call_seconds",
            "Wall time of a tool call, queueing included.",
            ["tool"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "turnrl_tool_queue_depth", "Calls waiting for a slot.", ["tool"], registry=self.registry
        )
        self.in_flight = Gauge(
            "turnrl_tool_in_flight", "Calls running now.", ["tool"], registry=self.registry
        )
        self.live_sessions = Gauge(
            "turnrl_tool_live_sessions", "Open sessions.", ["tool"], registry=self.registry
        )
