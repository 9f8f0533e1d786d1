"""Reading the server's Prometheus metrics in tests."""
from __future__ import annotations

import re
import time
import urllib.request


def metrics(server) -> dict[str, float]:
    """triton_vlm_* metrics by name, with `:state` appended where the metric has a state label."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'(triton_vlm_\w+)\{([^}]*)\} (\S+)', line)
        if m:
            state = re.search(r'state="(\w+)"', m.group(2))
            out[m.group(1) + (f":{state.group(1)}" if state else "")] = float(m.group(3))
    return out


def wait_for(server, predicate, timeout: float = 30.0) -> dict[str, float]:
    """The metrics once `predicate` holds, or the last reading at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        if predicate(values) or time.monotonic() > deadline:
            return values
        time.sleep(0.05)
