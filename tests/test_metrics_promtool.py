"""The engine's /metrics text passes Prometheus' own checker (`promtool check metrics`).

promtool 2.x also lints metric names containing ':' — the `resin:` prefix the issue
mandates (vLLM's `vllm:` gets the same lint). Every other complaint fails the test.
CI installs promtool (Debian's `prometheus`); the test is skipped where it is absent.
"""

import shutil
import subprocess

import numpy as np
import pytest

import resin


class OneTokenRunner:
    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        n = plan.num_sequences
        return resin.ForwardOutput(np.zeros(n, np.uint32), np.arange(n + 1, dtype=np.uint32))


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed"
)
def test_promtool_accepts_metrics_text() -> None:
    engine = resin.Engine(
        resin.EngineConfig(
            page_size=4, num_pages=16, max_model_len=32, eos_token_ids=[0], num_speculative_tokens=2
        ),
        OneTokenRunner(),
    )
    engine.add_request("stops", [1, 2, 3], resin.SamplingParams(max_tokens=3))
    engine.add_request("runs", [1, 2, 3, 4, 5], resin.SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("aborted", [7, 8], resin.SamplingParams(max_tokens=3))
    engine.abort("aborted")
    while engine.has_unfinished():
        engine.step()
    text = engine.metrics_text()
    assert 'spec_decode_num_accepted_tokens_per_pos_total{position="1"}' in text
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    other = [line for line in complaints if "metric names should not contain ':'" not in line]
    assert other == [], "\n".join(other)
    assert len(complaints) == len([line for line in text.splitlines() if line.startswith("# TYPE")])
