"""Prometheus metrics a service makes from its own state at each scrape (no double bookkeeping),
in a registry of its own (no global state: several services may share a process in tests)."""

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# A scrape waits this long for the event loop; a busier loop answers the scrape with an error.
SCRAPE_TIMEOUT_SECONDS = 5.0


class LoopCollector(Collector):
    """Runs `collect` on `loop` at each scrape: the HTTP endpoint scrapes from a thread of its
    own, and the service's state changes on the loop, so it is read there, never mid-change."""

    def __init__(
        self, collect: Callable[[], Iterable[Metric]], loop: asyncio.AbstractEventLoop
    ) -> None:
        self._collect = collect
        self._loop = loop

    def collect(self) -> Iterator[Metric]:
        made: concurrent.futures.Future[list[Metric]] = concurrent.futures.Future()

        def make() -> None:
            try:
                made.set_result(list(self._collect()))
            except Exception as e:
                made.set_exception(e)

        self._loop.call_soon_threadsafe(make)
        return iter(made.result(timeout=SCRAPE_TIMEOUT_SECONDS))


def loop_registry(collect: Callable[[], Iterable[Metric]]) -> CollectorRegistry:
    """A registry of the metrics `collect` makes at each scrape, on the event loop running now
    (call this on it), and of this process (resident memory, CPU seconds, open files)."""
    registry = CollectorRegistry()
    registry.register(LoopCollector(collect, asyncio.get_running_loop()))
    ProcessCollector(registry=registry)
    return registry


def metric(
    name: str, documentation: str, counter: bool, samples: Iterable[tuple[dict[str, str], float]]
) -> Metric:
    """The counter (a running total: rate() makes it per second) or gauge family `name` with
    one sample per (labels, value); every sample has the same label names."""
    samples = list(samples)
    labels = list(samples[0][0]) if samples else []
    family_class = CounterMetricFamily if counter else GaugeMetricFamily
    family = family_class(name, documentation, labels=labels)
    for sample_labels, value in samples:
        family.add_metric([sample_labels[label] for label in labels], float(value))
    return family
