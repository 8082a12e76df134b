"""Prometheus metrics of a server (vLLM's names where it has one), in a registry of its own.

Gauges mirror the engine's stats after every step; counters and histograms are fed by the
engine thread as tokens arrive. GET /metrics renders the registry in the text format.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; vLLM's TTFT and inter-token-latency buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


class ServerMetrics:
    """The metrics of one server; the AsyncEngine calls the on_* hooks from its thread."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).")
        self.prefix_hit_rate = gauge("vllm:prefix_cache_hit_rate", "Prefix-cache hit rate of prompt tokens.")
        self.preemptions = gauge("vllm:num_preemptions", "Preemptions since start (cumulative).")
        self.compilations = gauge("paged_jax:num_compilations", "Step shapes compiled since start.")
        self.generated = Counter("vllm:generation_tokens", "Generated tokens.", list(labels),
                                 registry=self.registry).labels(**labels)
        self.finished = Counter("vllm:request_success", "Finished requests by reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", list(labels),
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens of a request.",
                             list(labels), buckets=ITL_BUCKETS, registry=self.registry).labels(**labels)
        # Speculative decoding (vLLM's spec_decode counters; cumulative engine stats, mirrored).
        self.spec_drafts = gauge("vllm:spec_decode_num_drafts", "Verification rows (requests with proposals).")
        self.spec_draft_tokens = gauge("vllm:spec_decode_num_draft_tokens", "Proposed tokens.")
        self.spec_accepted_tokens = gauge("vllm:spec_decode_num_accepted_tokens", "Accepted proposed tokens.")
        self.spec_disabled_steps = gauge("paged_jax:spec_decode_num_disabled_steps",
                                         "Steps with no proposals: the batch at disable_by_batch_size or more.")
        self.spec_accepted_per_pos = Gauge("vllm:spec_decode_acceptance_rate_per_pos",
                                           "Share of verification rows whose proposal at this position was "
                                           "accepted.", ["model_name", "position"], registry=self.registry)
        self.spec_mean_accepted_length = gauge("vllm:spec_decode_mean_acceptance_length",
                                               "Tokens a verification row emits, on average (accepted + 1).")
        self.reserved_cpus = gauge("paged_jax:engine_reserved_cpus",
                                   "Cores the engine process leaves to the HTTP process (CPU backend).")
        self.engine_restarts = Counter("paged_jax:engine_restarts",
                                       "Engine processes started after one died (serve --restart-engine).",
                                       list(labels), registry=self.registry).labels(**labels)
        self.prompt_tokens_computed = gauge("paged_jax:prompt_tokens_computed",
                                            "Prompt tokens computed here (not prefix hits, not pulled).")
        # Disaggregation (cumulative engine stats, mirrored; only with --kv-role).
        self.kv_transfer = {name: gauge(f"paged_jax:{name}", doc) for name, doc in (
            ("num_remote_loads", "Requests whose prompt KV was pulled from a producer."),
            ("num_remote_load_failures", "Pulls that failed or timed out (the request prefilled locally)."),
            ("num_external_tokens", "Prompt tokens pulled instead of computed."),
            ("num_kv_offers", "Finished prompts offered to consumers."),
            ("num_kv_pinned_requests", "Finished prompts whose blocks wait to be pulled."),
            ("kv_transfer_offers_expired", "Offers no consumer released before the timeout."),
            ("kv_transfer_bytes_sent", "KV page bytes sent to consumers."),
            ("kv_transfer_bytes_received", "KV page bytes pulled from producers."))}
        self._model_name = model_name

    def on_step(self, stats: dict) -> None:
        self.running.set(stats["num_running_reqs"])
        self.waiting.set(stats["num_waiting_reqs"])
        self.kv_usage.set(stats["kv_cache_usage"])
        self.prefix_hit_rate.set(stats["prefix_cache_hit_rate"])
        self.preemptions.set(stats["num_preemptions"])
        self.compilations.set(stats["num_compilations"])
        self.prompt_tokens_computed.set(stats["num_prompt_tokens_computed"])
        if "kv_role" in stats:
            for name, metric in self.kv_transfer.items():
                metric.set(stats[name])
        if "spec_num_drafts" in stats:
            self.spec_drafts.set(stats["spec_num_drafts"])
            self.spec_draft_tokens.set(stats["spec_num_draft_tokens"])
            self.spec_accepted_tokens.set(stats["spec_num_accepted_tokens"])
            self.spec_disabled_steps.set(stats["spec_num_disabled_steps"])
            self.spec_mean_accepted_length.set(stats["spec_mean_accepted_length"])
            for position, rate in enumerate(stats["spec_acceptance_rate_per_position"]):
                self.spec_accepted_per_pos.labels(model_name=self._model_name, position=str(position)).set(rate)

    def on_tokens(self, num_tokens: int, seconds: float, first: bool) -> None:
        """num_tokens arrived for one request, `seconds` after its arrival (first) or its last token."""
        (self.ttft if first else self.itl).observe(seconds)
        self.generated.inc(num_tokens)

    def on_finished(self, reason: str, num_tokens: int) -> None:
        self.finished.labels(model_name=self._model_name, finished_reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
