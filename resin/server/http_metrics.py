"""HTTP-side Prometheus metrics: requests by endpoint and status, and their latency.

Exposed after the engine's own metrics on ``/metrics`` (Prometheus text format 0.0.4, the
``resin:`` prefix the engine uses):

- ``resin:http_requests_total{endpoint, method, status}`` — counter, one per finished HTTP
  request (a streamed request counts when its response starts, with the status it was sent);
- ``resin:http_request_duration_seconds{endpoint}`` — histogram of the time to the response
  head (for a stream: time to the first byte of the headers, not to its end).

Endpoints are the route templates (``/v1/chat/completions``), never raw paths, so a client
cannot blow up the label set; unknown paths count as ``other``.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class HttpMetrics:
    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = set(endpoints)
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self._buckets: dict[str, list[int]] = {}
        self._sum_s: dict[str, float] = defaultdict(float)
        self._count: dict[str, int] = defaultdict(int)

    def endpoint_of(self, path: str) -> str:
        return path if path in self.endpoints else "other"

    def observe(self, path: str, method: str, status: int, duration_s: float) -> None:
        endpoint = self.endpoint_of(path)
        with self._lock:
            self._requests[(endpoint, method, status)] += 1
            buckets = self._buckets.setdefault(endpoint, [0] * len(DURATION_BUCKETS_S))
            index = bisect.bisect_left(DURATION_BUCKETS_S, duration_s)
            if index < len(buckets):
                buckets[index] += 1
            self._sum_s[endpoint] += duration_s
            self._count[endpoint] += 1

    def render(self) -> str:
        lines = [
            "# HELP resin:http_requests_total HTTP requests by endpoint, method and status.",
            "# TYPE resin:http_requests_total counter",
        ]
        with self._lock:
            for (endpoint, method, status), count in sorted(self._requests.items()):
                lines.append(
                    f'resin:http_requests_total{{endpoint="{endpoint}",'
                    f'method="{method}",status="{status}"}} {count}'
                )
            lines += [
                "# HELP resin:http_request_duration_seconds Time to the response head.",
                "# TYPE resin:http_request_duration_seconds histogram",
            ]
            for endpoint in sorted(self._buckets):
                cumulative = 0
                for bound, count in zip(DURATION_BUCKETS_S, self._buckets[endpoint]):
                    cumulative += count
                    lines.append(
                        f"resin:http_request_duration_seconds_bucket{{endpoint="
                        f'"{endpoint}",le="{bound}"}} {cumulative}'
                    )
                lines.append(
                    f'resin:http_request_duration_seconds_bucket{{endpoint="{endpoint}",'
                    f'le="+Inf"}} {self._count[endpoint]}'
                )
                lines.append(
                    f'resin:http_request_duration_seconds_sum{{endpoint="{endpoint}"}} '
                    f"{self._sum_s[endpoint]}"
                )
                lines.append(
                    f"resin:http_request_duration_seconds_count{{endpoint="
                    f'"{endpoint}"}} {self._count[endpoint]}'
                )
        return "\n".join(lines) + "\n"
