"""Reading a running process's `/metrics` in tests: one sample, summed over the label values
not named."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scraped(root: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples at `root`/metrics whose labels include `labels`."""
    text = httpx.get(f"{root}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
