"""``ServerMetrics``: the server's Prometheus metrics, on a registry of its own (one per server).

Names follow vLLM's where one exists (``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``; the same
``model_name`` label and histogram buckets): ``vllm:num_requests_running`` / ``_waiting`` (gauges),
``vllm:kv_cache_usage_perc`` (pages held by requests / pool pages: pages held only by the prefix cache are
evictable and count as free, as in vLLM's ``BlockPool.get_usage`` in ``vllm/v1/core/block_pool.py``, ``1 -
num_free_blocks / num_gpu_blocks``, where a cached block whose ref_cnt drops to 0 goes back to the free queue; so
an idle server reports 0 whatever its cache holds), ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt
tokens looked up / restored from the cache), ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total{finished_reason}``, and the histograms ``vllm:time_to_first_token_seconds``
(arrival at the server -> first token pushed), ``vllm:inter_token_latency_seconds`` (gap between a request's
consecutive token pushes), ``vllm:request_time_per_output_token_seconds`` (TPOT: (e2e - TTFT) / (tokens - 1) per
request) and ``vllm:e2e_request_latency_seconds``.

KDA-specific (``kda:``): ``kda:state_slots_used`` / ``kda:state_slots_free`` (requests holding a private KDA
state, out of ``max_num_seqs``), ``kda:state_slots_capacity`` (state slots the pool could hold, states alone:
pool pages // state pages per request; it grows with a 16-bit ``--state-dtype``, while ``max_num_seqs`` caps the
slots in use), ``kda:requests_capacity`` (requests of ``max_model_len`` tokens the pool holds, state + KV pages), ``kda:pool_pages{kind}`` (free / kda_state / mla_kv pages),
``kda:prefix_cache_pages`` (pages the prefix cache holds), ``kda:request_pages`` (used pages held by requests
only: 0 when idle), ``kda:checkpoints_held`` (stored state checkpoints, counted per group), and the hits lost
to a missing checkpoint, named as SGLang names them (sgl-project/sglang PR #38018):
``sglang:mamba_cache_miss_requests_total`` / ``sglang:mamba_cache_miss_tokens_total``: a request whose cached
KV blocks reach further than its restored checkpoint, and by how many tokens (block-aligned KV hit - b).
With speculative decoding, vLLM's ``vllm:spec_decode_num_draft_tokens_total`` / ``vllm:spec_decode_num_accepted_tokens_total``
(draft tokens proposed / accepted; counted when a request ends, where vLLM counts each step).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from serve.engine.request import RequestResult, RequestStatus
from serve.memory.pool import PageKind

disable_created_metrics()          # as vLLM does: no *_created series beside each counter / histogram

# vLLM's buckets (vllm/v1/metrics/loggers.py), seconds; TTFT and ITL start lower: this engine is a CPU model.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REJECT_REASONS = ("never_fits", "queue_full")   # kda:requests_rejected_total{reason=...}
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """Every metric of one server, labelled ``model_name``; ``block_size`` (tokens) aligns the KV hit for the
    missing-checkpoint count. Written by the engine thread only."""

    def __init__(self, model_name: str, block_size: int):
        self.registry = r = CollectorRegistry()
        lab, self.model_name, self.block_size = ["model_name"], model_name, block_size

        def g(name, doc, extra=()):
            return Gauge(name, doc, lab + list(extra), registry=r)

        def c(name, doc, extra=()):
            return Counter(name, doc, lab + list(extra), registry=r)

        def h(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(model_name)

        self.running = g("vllm:num_requests_running", "Requests in the engine's running batch.")
        self.waiting = g("vllm:num_requests_waiting", "Requests waiting (server queue + engine waiting list).")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "Fraction of pool pages held by requests (0 to 1); pages held "
                          "only by the prefix cache are evictable and count as free, as in vLLM.")
        self.queries = c("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens queried.")
        self.hits = c("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens restored (b).")
        self.prompt_tokens = c("vllm:prompt_tokens", "Prompt tokens of requests the engine admitted.")
        self.generation_tokens = c("vllm:generation_tokens", "Generated tokens.")
        self.success = c("vllm:request_success", "Requests finished, by reason.", ["finished_reason"])
        self.aborted = c("kda:requests_aborted", "Requests aborted (client gone, non-finite values, failed publish).")
        self.rejected = c("kda:requests_rejected", "Requests refused, by reason: never_fits (the engine can never "
                          "fit it in the pool), queue_full (answered 429: max_num_seqs + max_queue outstanding).",
                          ["reason"])
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token (server arrival to first push).",
                      TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Gap between consecutive token pushes of a request.",
                     ITL_BUCKETS)
        self.tpot = h("vllm:request_time_per_output_token_seconds", "Per request: (e2e - TTFT) / (tokens - 1).",
                      ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Arrival to the last token.", E2E_BUCKETS)
        self.step_seconds = h("kda:engine_step_seconds", "Wall time of one engine.step().", ITL_BUCKETS)
        self.slots_used = g("kda:state_slots_used", "Requests holding a private KDA state.")
        self.slots_free = g("kda:state_slots_free", "State slots left (max_num_seqs - used).")
        self.slots_capacity = g("kda:state_slots_capacity", "State slots the pool could hold (pool pages // state "
                                "pages per request); max_num_seqs caps the slots in use.")
        self.requests_capacity = g("kda:requests_capacity", "Requests of max_model_len tokens the pool holds "
                                   "(pool pages // (state + KV pages per request)).")
        self.pool_pages = g("kda:pool_pages", "Pool pages by kind.", ["kind"])
        self.cache_pages = g("kda:prefix_cache_pages", "Pages the prefix cache holds (KV blocks + checkpoints).")
        self.request_pages = g("kda:request_pages", "Used pages not held by the prefix cache (requests' own).")
        self.checkpoints = g("kda:checkpoints_held", "State checkpoints stored (counted per group).")
        self.miss_requests = c("sglang:mamba_cache_miss_requests",
                               "Requests whose KV hit reached past their restored checkpoint.")
        self.miss_tokens = c("sglang:mamba_cache_miss_tokens",
                             "Prompt tokens cached as KV but recomputed for want of a checkpoint.")
        self.draft_tokens = c("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens proposed.")
        self.accepted_tokens = c("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")

        for counter in (self.queries, self.hits, self.prompt_tokens, self.generation_tokens, self.aborted,
                        self.miss_requests, self.miss_tokens, self.draft_tokens, self.accepted_tokens):
            counter.labels(model_name)                    # every series present from the start, at 0
        for reason in REJECT_REASONS:
            self.rejected.labels(model_name, reason)
        self.success.labels(model_name, "length")

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def pool_capacity(self, capacity) -> None:
        """Set the pool's fixed capacity gauges from a :class:`serve.http.model.PoolCapacity`."""
        self.slots_capacity.labels(self.model_name).set(capacity.state_slots)
        self.requests_capacity.labels(self.model_name).set(capacity.requests)

    # ---- engine thread ----------------------------------------------------------------------------------
    def tokens(self, stream, n: int, now: float) -> None:
        """``n`` new tokens of ``stream`` pushed at ``now`` (perf_counter seconds)."""
        m = self.model_name
        if stream.first_t is None:
            stream.first_t = now
            self.ttft.observe(now - stream.arrival_t)
        else:
            self.itl.observe(now - stream.last_t)
        stream.last_t = now
        self.generation_tokens.labels(m).inc(n)

    def queue_full(self) -> None:
        """A request refused at the door with 429 (any thread: prometheus_client counters are thread-safe)."""
        self.rejected.labels(self.model_name, "queue_full").inc()

    def finished(self, stream, res: RequestResult | None) -> None:
        """A request's end (``res`` None: aborted before it reached the engine)."""
        m = self.model_name
        if res is None or res.status is RequestStatus.ABORTED:
            self.aborted.labels(m).inc()
        elif res.status is RequestStatus.REJECTED:
            self.rejected.labels(m, "never_fits").inc()
        else:
            self.success.labels(m, "length").inc()
            self.e2e.observe(stream.last_t - stream.arrival_t)
            if stream.sent > 1:
                self.tpot.observe((stream.last_t - stream.first_t) / (stream.sent - 1))
        if res is not None and res.drafted_tokens:
            self.draft_tokens.labels(m).inc(res.drafted_tokens)
            self.accepted_tokens.labels(m).inc(res.accepted_tokens)
        if res is None or res.status is RequestStatus.REJECTED or (res.prefill_tokens == 0 and not res.hit_tokens):
            return                                            # never admitted: no lookup counted
        self.prompt_tokens.labels(m).inc(res.prompt_tokens)
        self.queries.labels(m).inc(res.prompt_tokens)
        self.hits.labels(m).inc(res.hit_tokens)
        lost = res.kv_hit_tokens // self.block_size * self.block_size - res.hit_tokens
        if lost > 0:
            self.miss_requests.labels(self.model_name).inc()
            self.miss_tokens.labels(self.model_name).inc(lost)

    def engine_state(self, engine, num_queued: int, max_num_seqs: int) -> None:
        """Gauges from the engine's state (``num_queued``: requests in front of the engine)."""
        m, pool = self.model_name, engine.pool
        self.running.labels(m).set(len(engine.running))
        self.waiting.labels(m).set(len(engine.waiting) + num_queued)
        self.slots_used.labels(m).set(len(engine.running))
        self.slots_free.labels(m).set(max_num_seqs - len(engine.running))
        used = pool.num_pages - pool.num_free
        evictable = 0 if engine.cache is None else engine.cache.evictable_pages()    # the prefix cache's own
        self.kv_usage.labels(m).set((used - evictable) / pool.num_pages)
        self.pool_pages.labels(m, "free").set(pool.num_free)
        self.pool_pages.labels(m, "kda_state").set(pool.num_used(PageKind.KDA_STATE))
        self.pool_pages.labels(m, "mla_kv").set(pool.num_used(PageKind.MLA_KV))
        cache_pages = checkpoints = 0
        if engine.cache is not None:
            st = engine.cache.stats()
            cache_pages, checkpoints = st.kv_pages + st.state_pages, st.checkpoints
        self.cache_pages.labels(m).set(cache_pages)
        self.request_pages.labels(m).set(used - cache_pages)
        self.checkpoints.labels(m).set(checkpoints)
