//! Engine metrics, exported in Prometheus text format (0.0.4) with a `resin:` prefix
//! and vLLM's names, suffixes and units.
//!
//! Counters end in `_total`; durations are histograms in seconds. Gauges (running,
//! waiting, KV-cache usage) are read from the engine at export time, so they never
//! drift from the state they describe.

use std::fmt::Write;

use crate::request::FinishReason;

/// A cumulative histogram with fixed upper bounds.
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    pub fn observe(&mut self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| value <= b) {
            self.counts[i] += 1;
        }
        self.sum += value;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let _ =
            writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", self.count, self.sum, self.count);
    }
}

const TTFT_BUCKETS_S: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
    2560.0,
];
const ITL_BUCKETS_S: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const REQUEST_LATENCY_BUCKETS_S: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
];

const FINISH_REASONS: [FinishReason; 3] = [FinishReason::Stop, FinishReason::Length, FinishReason::Abort];

/// Everything the engine counts. Gauges are passed to [`Metrics::render`].
#[derive(Clone, Debug)]
pub struct Metrics {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Indexed like `FINISH_REASONS`.
    request_success: [u64; 3],
    pub num_preemptions: u64,
    pub prefix_cache_queries_tokens: u64,
    pub prefix_cache_hits_tokens: u64,
    /// Speculative decoding (vLLM's names): verify rows, drafts in them, drafts accepted.
    pub spec_decode_num_drafts: u64,
    pub spec_decode_num_draft_tokens: u64,
    pub spec_decode_num_accepted_tokens: u64,
    /// Per draft position (0 = the first draft of a row): rows whose draft at that position
    /// was accepted — vLLM's `spec_decode_num_accepted_tokens_per_pos`. One entry per
    /// position up to `num_speculative_tokens` (empty without speculative decoding).
    pub spec_decode_num_accepted_tokens_per_pos: Vec<u64>,
    pub time_to_first_token_s: Histogram,
    pub inter_token_latency_s: Histogram,
    pub e2e_request_latency_s: Histogram,
    pub request_queue_time_s: Histogram,
}

/// Point-in-time values the engine reads for an export.
pub struct Gauges {
    pub num_requests_running: usize,
    pub num_requests_waiting: usize,
    pub kv_cache_usage: f64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            prompt_tokens: 0,
            generation_tokens: 0,
            request_success: [0; 3],
            num_preemptions: 0,
            prefix_cache_queries_tokens: 0,
            prefix_cache_hits_tokens: 0,
            spec_decode_num_drafts: 0,
            spec_decode_num_draft_tokens: 0,
            spec_decode_num_accepted_tokens: 0,
            spec_decode_num_accepted_tokens_per_pos: Vec::new(),
            time_to_first_token_s: Histogram::new(TTFT_BUCKETS_S),
            inter_token_latency_s: Histogram::new(ITL_BUCKETS_S),
            e2e_request_latency_s: Histogram::new(REQUEST_LATENCY_BUCKETS_S),
            request_queue_time_s: Histogram::new(REQUEST_LATENCY_BUCKETS_S),
        }
    }
}

impl Metrics {
    /// Zeroed, with a per-position acceptance counter for each of `num_speculative_tokens`.
    pub fn with_draft_positions(num_speculative_tokens: usize) -> Self {
        Metrics { spec_decode_num_accepted_tokens_per_pos: vec![0; num_speculative_tokens], ..Metrics::default() }
    }

    pub fn record_finished(&mut self, reason: FinishReason) {
        let i = FINISH_REASONS.iter().position(|&r| r == reason).unwrap();
        self.request_success[i] += 1;
    }

    pub fn request_success(&self, reason: FinishReason) -> u64 {
        self.request_success[FINISH_REASONS.iter().position(|&r| r == reason).unwrap()]
    }

    /// The Prometheus text exposition.
    pub fn render(&self, gauges: &Gauges) -> String {
        let mut out = String::with_capacity(8192);
        let mut scalar = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(out, "# HELP resin:{name} {help}\n# TYPE resin:{name} {kind}\nresin:{name} {value}");
        };
        scalar(
            "num_requests_running",
            "gauge",
            "Number of requests in the running set.",
            gauges.num_requests_running.to_string(),
        );
        scalar(
            "num_requests_waiting",
            "gauge",
            "Number of requests waiting to be scheduled.",
            gauges.num_requests_waiting.to_string(),
        );
        scalar(
            "kv_cache_usage_perc",
            "gauge",
            "Fraction of KV-cache pages in use (1 = 100%).",
            gauges.kv_cache_usage.to_string(),
        );
        scalar("prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens.to_string());
        scalar(
            "generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            self.generation_tokens.to_string(),
        );
        scalar("num_preemptions_total", "counter", "Cumulative number of preemptions.", self.num_preemptions.to_string());
        scalar(
            "prefix_cache_queries_total",
            "counter",
            "Prefix-cache queries, in tokens (prompt tokens looked up on first scheduling).",
            self.prefix_cache_queries_tokens.to_string(),
        );
        scalar("prefix_cache_hits_total", "counter", "Prefix-cache hits, in tokens.", self.prefix_cache_hits_tokens.to_string());
        scalar(
            "spec_decode_num_drafts_total",
            "counter",
            "Speculative decoding: rows that verified drafts.",
            self.spec_decode_num_drafts.to_string(),
        );
        scalar(
            "spec_decode_num_draft_tokens_total",
            "counter",
            "Speculative decoding: draft tokens verified.",
            self.spec_decode_num_draft_tokens.to_string(),
        );
        scalar(
            "spec_decode_num_accepted_tokens_total",
            "counter",
            "Speculative decoding: draft tokens the target model accepted.",
            self.spec_decode_num_accepted_tokens.to_string(),
        );
        if !self.spec_decode_num_accepted_tokens_per_pos.is_empty() {
            let _ = writeln!(
                out,
                "# HELP resin:spec_decode_num_accepted_tokens_per_pos_total Speculative decoding: accepted drafts by position in the row (0 = first draft).\n# TYPE resin:spec_decode_num_accepted_tokens_per_pos_total counter"
            );
            for (position, count) in self.spec_decode_num_accepted_tokens_per_pos.iter().enumerate() {
                let _ = writeln!(out, "resin:spec_decode_num_accepted_tokens_per_pos_total{{position=\"{position}\"}} {count}");
            }
        }
        let _ = writeln!(
            out,
            "# HELP resin:request_success_total Count of finished requests by finish reason.\n# TYPE resin:request_success_total counter"
        );
        for (reason, count) in FINISH_REASONS.iter().zip(self.request_success) {
            let _ = writeln!(out, "resin:request_success_total{{finished_reason=\"{}\"}} {count}", reason.as_str());
        }
        self.time_to_first_token_s.write(
            &mut out,
            "resin:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
        );
        self.inter_token_latency_s.write(
            &mut out,
            "resin:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
        );
        self.e2e_request_latency_s.write(
            &mut out,
            "resin:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
        );
        self.request_queue_time_s.write(
            &mut out,
            "resin:request_queue_time_seconds",
            "Histogram of time spent waiting before first scheduling, in seconds.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative_and_renders_inf_sum_count() {
        let mut m = Metrics::default();
        m.time_to_first_token_s.observe(0.003);
        m.time_to_first_token_s.observe(0.5);
        m.time_to_first_token_s.observe(1e6);
        m.record_finished(FinishReason::Length);
        let text = m.render(&Gauges { num_requests_running: 2, num_requests_waiting: 1, kv_cache_usage: 0.25 });
        assert!(text.contains("resin:time_to_first_token_seconds_bucket{le=\"0.001\"} 0\n"));
        assert!(text.contains("resin:time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("resin:time_to_first_token_seconds_bucket{le=\"0.5\"} 2\n"));
        assert!(text.contains("resin:time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"));
        assert!(text.contains("resin:time_to_first_token_seconds_count 3\n"));
        assert!(text.contains("resin:request_success_total{finished_reason=\"length\"} 1\n"));
        assert!(text.contains("resin:num_requests_running 2\n"));
        assert!(text.contains("resin:kv_cache_usage_perc 0.25\n"));
    }
}
