"""What each finished prompt feeds: the server's metrics, the request log's record and the cache diagnosis."""

from __future__ import annotations

import time

from kvprefix.cache import BlockHasher
from kvprefix.engine import RequestMetrics
from kvprefix.http.tenancy import Caller, pseudonym
from kvprefix.logs import RequestLogWriter, RequestRecord
from kvprefix.server.cache_detail import CacheDetail, CacheTracker
from kvprefix.server.metrics import FinishedSequence, ServerMetrics
from kvprefix.server.model_info import ModelInfo
from kvprefix.server.models import Target
from kvprefix.server.run import Job


class Books:
    """Books the jobs of one HTTP request (its body's fields go into the records)."""

    def __init__(self, info: ModelInfo, metrics: ServerMetrics, tracker: CacheTracker | None,
                 request_log: RequestLogWriter | None, hasher: BlockHasher, req, caller: Caller, chat: bool,
                 max_tokens: int, target: Target):
        self.info = info
        self.metrics = metrics
        self.tracker = tracker  # None: cache detail is off, and nothing mirrors the cache
        self.request_log = request_log
        self.hasher = hasher
        self.req = req
        self.caller = caller
        self.chat = chat
        self.max_tokens = max_tokens  # after defaults
        self.target = target  # the base model or the adapter it ran on

    def diagnose(self, job: Job) -> CacheDetail | None:
        """Why the job's prompt missed the cache, when asked for or logged; made at its first output with a token,
        while the cache looks much as at admission."""
        if self.tracker is None or not (self.req.cache_detail or self.request_log is not None):
            return None
        out = job.out
        detail = self.tracker.diagnose(job.index, job.prompt.token_ids, out.prompt_block_hashes,
                                       out.num_cached_tokens, self.caller.tenant, self.caller.client_salt,
                                       self.target.lora_fingerprint)
        if detail is not None and out.cached_tokens_by_tier:
            lower = sum(out.cached_tokens_by_tier.values())
            detail.cached_tokens_from = {"pool": out.num_cached_tokens - lower, **out.cached_tokens_by_tier}
        return detail

    def finish(self, job: Job, aborted: bool) -> None:
        """Feeds metrics and the request log once per job, whether it finished or was aborted."""
        if job.finished:
            return
        job.finished = True
        out = job.out
        cached = out.num_cached_tokens if out is not None else 0
        reasons = [r or "abort" for r in job.reasons]
        e2e = time.monotonic() - job.arrival
        m = out.metrics if out is not None else None
        # The engine's first token, from the request's arrival at the server (its wait for admission included).
        ttft = None if m is None or m.first_token_time is None else m.first_token_time - job.arrival
        self.metrics.observe(FinishedSequence(
            len(job.prompt.token_ids), cached, job.tokens, reasons, ttft, e2e, self.max_tokens,
            *_phases(m), token_gaps_s=m.token_gaps if m is not None else [],
            lora_name=None if self.target.lora is None else self.target.name,
            num_preemptions=m.num_preemptions if m is not None else 0))
        if self.request_log is not None:
            self.request_log.write(self._record(job, cached, reasons, ttft, e2e, aborted))

    def _record(self, job: Job, cached: int, reasons: list[str], ttft: float | None, e2e: float,
                aborted: bool) -> RequestRecord:
        info, caller, out = self.info, self.caller, job.out
        if out is not None:
            hashes, namespace = out.prompt_block_hashes, out.namespace_id
        else:  # aborted before the engine's first output: hash as the engine does
            hasher = self.hasher.for_namespace(caller.tenant, caller.client_salt, self.target.lora_fingerprint)
            hashes, namespace = hasher.hash_blocks(job.prompt.token_ids), hasher.namespace_id
        spans = job.prompt.message_spans
        return RequestRecord(
            timestamp=round(job.arrival_wall, 6),
            finish_time=round(job.arrival_wall + e2e, 6),
            request_id=job.request_id,
            endpoint="chat" if self.chat else "completions",
            model=self.target.name,
            replica=info.replica_id,
            tenant=pseudonym(caller.tenant_label),
            namespace=namespace,
            prompt_tokens=len(job.prompt.token_ids),
            block_size=info.block_size,
            hash_algo=info.hash_algo,
            block_hashes=[h.hex() for h in hashes],
            cached_tokens=cached,
            disk_cached_tokens=out.cached_tokens_by_tier.get("disk", 0) if out is not None else 0,
            shared_cached_tokens=out.cached_tokens_by_tier.get("shared", 0) if out is not None else 0,
            miss_reason=job.detail.reason if job.detail is not None else None,
            output_tokens=sum(job.tokens),
            n=job.n,
            finish_reasons=reasons,
            timings={"ttft_s": None if ttft is None else round(ttft, 6), "e2e_s": round(e2e, 6)},
            status="aborted" if aborted or "abort" in reasons else "ok",
            salted=caller.tenant is not None or caller.client_salt is not None,
            prompt_cache_key=self.req.prompt_cache_key,
            user=None if self.req.user is None else pseudonym(self.req.user),
            prompt=job.prompt.text,
            message_spans=[list(sp) if sp else None for sp in spans] if spans else None,
        )


def _phases(m: RequestMetrics | None) -> tuple[float | None, ...]:
    """The engine's queue, prefill, decode and inference times of a request (None for phases it never reached)."""
    if m is None or m.first_scheduled_time is None:
        return None, None, None, None
    queue = m.first_scheduled_time - m.arrival_time
    prefill = None if m.first_token_time is None else m.first_token_time - m.first_scheduled_time
    done = m.finished_time is not None and m.first_token_time is not None
    decode = m.finished_time - m.first_token_time if done else None
    inference = m.finished_time - m.first_scheduled_time if m.finished_time is not None else None
    return queue, prefill, decode, inference
