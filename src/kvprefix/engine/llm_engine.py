"""LLMEngine: the synchronous core that LLM and AsyncLLM drive. Owns the model runner, scheduler, KV cache manager
and block hashers; turns prompts into requests and steps into RequestDeltas (each caller's OutputState folds them)."""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Any

import torch

from kvprefix.cache import BlockHasher, KVCacheManager, block_identity
from kvprefix.cache.default_model import DEFAULT_MODEL_NAME, default_model_path
from kvprefix.cache.media import POOL, Medium
from kvprefix.engine.args import EngineArgs
from kvprefix.engine.beam_search import BeamSearch, BeamSearchParams
from kvprefix.engine.kv_tier import open_kv_tier
from kvprefix.engine.lora import LoraAdapters
from kvprefix.engine.lora_request import LoraActivity, LoRARequest
from kvprefix.engine.metrics import ITERATION_TOKEN_BUCKETS, engine_metrics, prefill_seconds_per_block
from kvprefix.engine.model_runner import ModelRunner, num_kv_blocks
from kvprefix.engine.output_state import OutputState
from kvprefix.engine.outputs import RequestDelta, RequestMetrics, SampleDelta
from kvprefix.engine.request import Request, RequestStatus
from kvprefix.engine.sampler import Sampler
from kvprefix.engine.sampling_params import SamplingParams
from kvprefix.engine.scheduler import Scheduler
from kvprefix.model import ModelConfig, load_model
from kvprefix.model.batch_invariant import make_batch_invariant, numerics_fingerprint
from kvprefix.model.loader import default_dtype, resolve_dtype, resolve_model_path
from kvprefix.model.lora import LoraAdapter, LoraLayers
from kvprefix.model.quantized_linear import kv_method, quantize_model, resolve_quantization
from kvprefix.tokenizer import Tokenizer
from kvprefix.tokenizer.chat_template import ChatTemplate

# Prompt positions whose logits are computed at once for prompt logprobs (each is a vocabulary of floats).
_SCORE_SLICE = 256
# A prompt: text, token ids, or a dict with "prompt_token_ids" or "prompt" (vLLM's input forms).
PromptType = str | list[int] | dict[str, Any]


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (e.g. its sampling could not be carried out); the engine goes on."""


@dataclasses.dataclass
class _UserRequest:
    """A request as the caller sees it: one prompt, ``n`` samples; under beam search (``search``), its live beams."""

    request_id: str
    samples: list[Request]
    metrics: RequestMetrics
    search: BeamSearch | None = None
    candidates: dict[str, dict] = dataclasses.field(default_factory=dict)  # beam id -> its next token's candidates
    num_forks: int = 0  # beams forked so far (their ids are f"{request_id}-beam{k}")
    num_preemptions_gone: int = 0  # of beams that ended
    first: Request = dataclasses.field(init=False)  # sample 0, or beam 0: whose admission counted the prompt

    def __post_init__(self) -> None:
        self.first = self.samples[0]

    @property
    def finished(self) -> bool:
        return self.search.done if self.search is not None else all(s.finished for s in self.samples)

    def num_preemptions(self) -> int:
        return self.num_preemptions_gone + sum(s.num_preemptions for s in self.samples)

    def delta(self, samples: list[SampleDelta], prompt_logprobs: list | None = None) -> RequestDelta:
        return RequestDelta(
            request_id=self.request_id,
            samples=samples,
            finished=self.finished,
            num_cached_tokens=max(0, self.first.num_cached_tokens),
            cached_tokens_by_tier=self.first.cached_tokens_by_tier(),
            metrics=dataclasses.replace(self.metrics),
            prompt_logprobs=prompt_logprobs,
        )


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        if args.cpu_threads is not None:
            torch.set_num_threads(args.cpu_threads)
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = default_dtype(device) if args.dtype == "auto" else resolve_dtype(args.dtype)
        self.model_name = args.model or DEFAULT_MODEL_NAME
        self.uses_default_model = args.model is None
        path = default_model_path() if args.model is None else resolve_model_path(args.model)
        # What the weights run as: the method asked for, or by default a quantized GGUF's own blocks on CPU.
        self.quantization = resolve_quantization(args.quantization, path, device)
        self.model_config = ModelConfig.from_path(path)
        self.tokenizer = Tokenizer(path)
        if args.chat_template is not None or args.chat_template_content_format != "auto":
            self.tokenizer = self.tokenizer.with_chat_template(
                ChatTemplate.given(args.chat_template, args.chat_template_content_format))
        self.max_model_len = min(args.max_model_len or 2**62, self.model_config.max_position_embeddings)
        # What names the blocks (published to routers): the checkpoint's own bytes, dtype and quantization, and in
        # deterministic mode the numerics its bytes depend on.
        numerics = numerics_fingerprint(device) if args.deterministic else ""
        self.identity = block_identity(path, str(dtype).removeprefix("torch."), kv_method(self.quantization),
                                       self.tokenizer.chat_template, content_format=self.tokenizer.content_format(),
                                       block_size=args.block_size,
                                       hash_algo=args.prefix_caching_hash_algo, numerics=numerics)
        self.hasher = self.identity.hasher()
        self._template_hashers: dict[str, BlockHasher] = {}  # by template fingerprint, for LLM.chat(chat_template=)
        # First: on CUDA the KV budget is what the weights leave free.
        model = quantize_model(load_model(path, dtype, device), self.quantization, path)
        if args.deterministic and args.enable_lora:  # the invariant tiles would wrap the adapters' hooks untested
            raise ValueError("deterministic=True does not serve LoRA adapters yet: choose one")
        if args.deterministic:
            model = make_batch_invariant(model)
        self.loras = LoraAdapters(model, args.max_loras, args.max_lora_rank) if args.enable_lora else None
        for name, adapter_path in (args.lora_modules or {}).items():
            if self.loras is None:
                raise ValueError("lora_modules need enable_lora=True")
            self.loras.load(name, adapter_path)
        num_blocks = num_kv_blocks(
            self.model_config,
            args.block_size,
            dtype,
            device,
            args.num_gpu_blocks,
            args.kv_cache_memory,
            args.gpu_memory_utilization,
        )
        self.manager = KVCacheManager(
            num_blocks, args.block_size, args.enable_prefix_caching, reserve_fraction=args.tenant_kv_reserve
        )
        # The longest a request (prompt + output) may grow: the model's limit, or the whole KV cache if smaller.
        self.max_sequence_tokens = min(self.max_model_len, num_blocks * args.block_size)
        self.scheduler = Scheduler(
            self.manager,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            share_inflight_prefixes=args.share_inflight_prefixes and args.enable_prefix_caching,
            scheduling_policy=args.scheduling_policy,
            max_wait_steps=args.max_wait_steps,
            max_loras=args.max_loras if args.enable_lora else None,
        )
        self.runner = ModelRunner.create(model, num_blocks, self.manager, dtype, device,
                                         LoraLayers(model) if args.enable_lora else None)
        self.kv_tier = open_kv_tier(args, self.identity, self.model_config, dtype, self.manager,
                                    self.runner.kv_caches, self.prefill_seconds_per_block)
        self.scheduler.lower_tier = self.kv_tier
        self.sampler = Sampler(args.seed, device)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | self.tokenizer.eos_token_ids
        self._requests: dict[str, _UserRequest] = {}
        self._user_request_of: dict[str, _UserRequest] = {}  # sample id -> its user request
        self._counters = dict(prompt_tokens=0, generation_tokens=0, requests_finished=0, requests_aborted=0,
                              requests_failed=0)
        self._failures: list[tuple[str, RequestFailedError]] = []
        self._iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)  # per bucket (not cumulative), then +Inf
        self._iteration_tokens_sum = 0
        self._prefill_seconds = 0.0  # the prompt tokens' share of the model's time in each step, summed

    # ---- requests

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for any accepted prompt form."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        tenant: str | None = None,
        lora_request: LoRARequest | None = None,
        chat_template_hash: str | None = None,
    ) -> OutputState:
        """Queues a request. Raises ValueError for a reused id, a bad prompt, or one that cannot fit.

        With ``BeamSearchParams`` it is a beam search: its one output carries the ``beam_width`` best sequences, best
        first, once the search is done (``_advance_search``).

        ``tenant``, ``cache_salt`` and the LoRA adapter pick the cache namespace: the request only hits blocks of its
        namespace; ``chat_template_hash``: the fingerprint of the chat template its prompt was rendered with, where
        that is not the engine's (``LLM.chat(chat_template=...)``): its blocks are rooted in that template's. ``lora_request`` runs it with that adapter: loaded from its path at the name's first use, or
        (no path) one loaded already, else ``LoraNotFoundError``.
        Returns the request's ``OutputState``, which the caller feeds the request's deltas (``step``,
        ``abort_request``)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        beam = isinstance(params, BeamSearchParams)
        num_samples = 1 if beam else params.n
        # Sample ids f"{i}_{request_id}" may equal another request's id; scheduler and cache key by sample id.
        sample_ids = [request_id] if num_samples == 1 else [f"{i}_{request_id}" for i in range(num_samples)]
        for sample_id in sample_ids:
            if sample_id in self._user_request_of:
                raise ValueError(f"request {request_id!r}: sample id {sample_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        self._check_prompt(request_id, ids)
        if beam and params.num_candidates > self.model_config.vocab_size:
            raise ValueError(f"request {request_id!r}: beam_width {params.beam_width} needs "
                             f"{params.num_candidates} candidate tokens; the vocabulary has {self.model_config.vocab_size}")
        grammar = None if beam else self._grammar(params)
        lora = self._lora(lora_request)
        room = self.max_sequence_tokens - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        hasher = self._template_hasher(chat_template_hash).for_namespace(tenant, cache_salt,
                                                                          lora.fingerprint if lora else None)
        samples: list[Request] = []
        for i in range(num_samples):
            if beam:
                sample_params = params.step_params(max_tokens)
            else:
                sample_params = params.for_sample(i) if params.n > 1 else params
            samples.append(
                Request(
                    sample_ids[i],
                    ids,
                    sample_params,
                    hasher,
                    max_tokens=max_tokens,
                    eos_token_ids=self.eos_token_ids,
                    tokenizer=self.tokenizer,
                    index=i,
                    eviction_group=tenant,
                    lora=lora,
                    lora_name=lora_request.lora_name if lora else None,
                )
            )
        if grammar is not None:
            for s in samples:
                s.matcher = self.sampler.grammar_masks.matcher(grammar)
        metrics = RequestMetrics(arrival_time if arrival_time is not None else time.monotonic())
        prompt_hashes = samples[0].block_hashes[: len(ids) // hasher.block_size]
        if self.kv_tier is not None:  # a retention past the tenant's budget: ValueError, nothing queued yet
            self.kv_tier.admit(params.kv_retention or self.args.kv_retention, tenant or "", hasher.namespace_id,
                               prompt_hashes)
        search = BeamSearch(params, len(ids), self.eos_token_ids, max_tokens) if beam else None
        user_request = _UserRequest(request_id, samples, metrics, search)
        self._requests[request_id] = user_request
        for s in samples:
            self._user_request_of[s.request_id] = user_request
            self.scheduler.add(s)
        self._counters["prompt_tokens"] += len(ids)
        output_params = [params.output_params()] * params.beam_width if beam else [s.params for s in samples]
        return OutputState(request_id, text, ids, output_params, self.tokenizer, prompt_hashes,
                           hasher.namespace_id, metrics.arrival_time)

    def _template_hasher(self, chat_template_hash: str | None) -> BlockHasher:
        """The hasher of prompts rendered with the chat template of that fingerprint (None: the engine's)."""
        if chat_template_hash is None or chat_template_hash == self.identity.context.chat_template:
            return self.hasher
        hasher = self._template_hashers.get(chat_template_hash)
        if hasher is None:
            context = dataclasses.replace(self.identity.context, chat_template=chat_template_hash)
            hasher = self._template_hashers[chat_template_hash] = dataclasses.replace(
                self.identity, context=context).hasher()
        return hasher

    def _lora(self, lora_request: LoRARequest | None) -> LoraAdapter | None:
        if lora_request is None:
            return None
        if self.loras is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is off (enable_lora=True "
                             "turns it on)")
        if lora_request.lora_path:
            return self.loras.resolve(lora_request)
        return self.loras.get(lora_request.lora_name)

    def _grammar(self, params: SamplingParams) -> str | None:
        """The compiled grammar of a structured request (ValueError if it does not compile), loading llguidance
        and the vocabulary's view of it at the first such request."""
        if params.structured_outputs is None:
            return None
        from kvprefix.engine.structured import GrammarMasks, grammar_for

        grammar = grammar_for(params.structured_outputs)
        if self.sampler.grammar_masks is None:
            self.sampler.grammar_masks = GrammarMasks(self.tokenizer, self.model_config.vocab_size)
        return grammar

    def _check_prompt(self, request_id: str, ids: list[int]) -> None:
        if not ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"request {request_id!r}: token id {bad} is outside the vocabulary [0, {vocab})")
        limit = self.max_sequence_tokens
        if len(ids) >= limit:
            what = "max_model_len" if limit == self.max_model_len else "the KV cache capacity in tokens"
            raise ValueError(
                f"request {request_id!r}: a prompt of {len(ids)} tokens leaves no room to generate; {what} is {limit}"
            )

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Stops a request and frees its blocks; returns its last delta (its unfinished samples end with
        finish_reason "abort"), or None if it is unknown or already finished."""
        user_request = self._requests.get(request_id)
        if user_request is None:
            return None
        # An abort before the prompt was computed sends the prompt logprobs so far (None where not scored yet).
        prompt_logprobs = user_request.first.take_prompt_logprobs()
        return user_request.delta(self._end(user_request, "requests_aborted"), prompt_logprobs)

    def _end(self, user_request: _UserRequest, counter: str) -> list[SampleDelta]:
        """Stops every unfinished sample (finish_reason "abort"), frees its blocks and forgets the request; returns
        the aborted samples' deltas."""
        del self._requests[user_request.request_id]
        aborted = []
        for s in user_request.samples:
            if not s.finished:
                s.abort()
                self.scheduler.finish(s)  # a parked beam is in no queue and holds nothing: a no-op
                aborted.append(SampleDelta(s.index, [], finish_reason="abort"))
        if user_request.search is not None:  # every result of the search ends
            aborted = [SampleDelta(i, [], finish_reason="abort") for i in range(user_request.search.params.beam_width)]
            user_request.search.live = []
        user_request.metrics.finished_time = time.monotonic()
        user_request.metrics.num_preemptions = user_request.num_preemptions()
        self._forget(user_request)
        self._counters[counter] += 1
        return aborted

    def abort_all(self) -> list[RequestDelta]:
        return [out for request_id in list(self._requests) if (out := self.abort_request(request_id)) is not None]

    def _forget(self, user_request: _UserRequest) -> None:
        for s in user_request.samples:
            self._user_request_of.pop(s.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- stepping

    def step(self) -> list[RequestDelta]:
        """Runs one batch; returns the deltas of requests that produced a token or finished in it."""
        if self._requests and not self.scheduler.has_unfinished():
            # Unfinished requests that the scheduler lost can never progress: callers would loop forever.
            raise RuntimeError(
                f"engine state is inconsistent: requests {sorted(self._requests)} are unfinished but none is scheduled"
            )
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.kv_tier is not None and self.kv_tier.loads.has_pending():
                self.kv_tier.loads.wait(timeout=0.05)  # everyone waits on a load: sleep until it moves
            return []
        sample_rows = [
            i
            for i, s in enumerate(sched.scheduled)
            if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens
        ]
        self._count_step(sched, sample_rows)
        score_rows = [i for i, s in enumerate(sched.scheduled) if s.request.prompt_logprobs is not None]
        start = time.perf_counter()
        logits, scored = self.runner.execute(sched, sample_rows, score_rows)
        self._count_prefill_time(sched, time.perf_counter() - start)
        for i, hidden in scored.items():  # before update_after_step: num_computed_tokens is the chunk's start
            self._score_prompt(sched.scheduled[i].request, hidden)
        self.scheduler.update_after_step(sched)
        if not sample_rows:
            return []
        requests = [sched.scheduled[i].request for i in sample_rows]
        return self._outputs(*self._append_samples(requests, self._sample(logits, requests)))

    def _count_prefill_time(self, sched, seconds: float) -> None:
        """The step's time, shared out by the tokens computed: the prompt tokens' share is prefill time (what a
        block loaded from a tier is weighed against: ``engine.metrics.prefill_seconds_per_block``)."""
        prompt = sum(max(0, min(s.request.num_computed_tokens + s.num_new_tokens, s.request.num_prompt_tokens)
                         - s.request.num_computed_tokens) for s in sched.scheduled)
        if prompt and sched.num_tokens:
            self._prefill_seconds += seconds * prompt / sched.num_tokens

    def kv_media(self) -> list[Medium]:
        """Where this engine holds blocks, as a KV event stream's hello announces them: the pool, then each tier
        with its capacity and measured load cost (``cache.media``)."""
        pool = [Medium(POOL, self.manager.pool.num_blocks)]
        if self.kv_tier is None:
            return pool
        return pool + self.kv_tier.media(self.prefill_seconds_per_block())

    def prefill_seconds_per_block(self) -> float | None:
        """This engine's mean model time to prefill one block (``engine.metrics.prefill_seconds_per_block``)."""
        return prefill_seconds_per_block(self._prefill_seconds, self.scheduler.num_prompt_tokens_computed,
                                         self.manager.block_size)

    def _count_step(self, sched, sample_rows: list[int]) -> None:
        """The step's tokens into the histogram, as vLLM counts them (the tokens computed, plus the token sampled at
        the end of a prefill: a decode's one computed token already stands for the one it samples); the first
        scheduling time of requests scheduled for the first time."""
        requests = [sched.scheduled[i].request for i in sample_rows]
        prefill_samples = sum(1 for r in requests if r.num_computed_tokens < r.num_prompt_tokens)
        tokens = sched.num_tokens + prefill_samples
        self._iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
        self._iteration_tokens_sum += tokens
        now = time.monotonic()
        for s in sched.scheduled:
            metrics = self._user_request_of[s.request.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now

    def _append_samples(self, requests: list[Request], samples: list[tuple]):
        """Appends each sampled token to its request (a request whose token fails fails alone); returns the
        changed user requests with their sample deltas, and the prompt logprobs completed in this step."""
        changed: dict[str, tuple[_UserRequest, list[SampleDelta]]] = {}
        prompt_logprobs: dict[str, list] = {}  # per user request, in the step its prompt was computed
        searches: dict[str, _UserRequest] = {}  # beam searches with beams computed in this step
        for req, (token, lp) in zip(requests, samples, strict=True):
            user_request = self._user_request_of.get(req.request_id)
            if user_request is None:  # failed in this step with a sibling sample
                continue
            try:
                if isinstance(token, BaseException):
                    raise token
                if user_request.search is None:
                    req.append_output(token)
            except Exception as exc:  # this request's fault (its params or text): it alone fails
                self._fail(user_request, exc)
                changed.pop(user_request.request_id, None)
                searches.pop(user_request.request_id, None)
                continue
            self._counters["generation_tokens"] += 1
            if user_request.search is not None:  # a beam: its candidates wait for its siblings'
                user_request.candidates[req.request_id] = lp
                searches[user_request.request_id] = user_request
                continue
            if req.finished:
                self.scheduler.finish(req)
                if req.text is not None:
                    req.text.finish()
            if req.prompt_logprobs is not None:  # a sampled token: the prompt is computed, its logprobs complete
                prompt_logprobs[user_request.request_id] = req.take_prompt_logprobs()
            delta = SampleDelta(req.index, [token], None if lp is None else [lp],
                                None if req.text is None else req.text.text, req.finish_reason, req.stop_reason,
                                req.ended_by_token)
            changed.setdefault(user_request.request_id, (user_request, []))[1].append(delta)
        for user_request in searches.values():
            results = self._advance_search(user_request)
            if results is not None:
                changed[user_request.request_id] = (user_request, results)
        return changed, prompt_logprobs

    def _advance_search(self, user_request: _UserRequest) -> list[SampleDelta] | None:
        """A step computed some of a beam search's beams. Until every live beam has its candidates, those that have
        them wait parked (holding no seat and no block). Then the search takes its step: a beam with no child ends
        (its blocks freed), a beam with k children goes on as the first and forks the others, which share its full
        blocks and get a copy of its partial last block (``Scheduler.fork``; queued to recompute from the cache when
        it has no blocks, or no seat or block is free). Returns the results once the search is done."""
        beams, candidates, scheduler = user_request.samples, user_request.candidates, self.scheduler
        if any(b.request_id not in candidates for b in beams):
            for b in beams:
                if b.request_id in candidates and b.status is RequestStatus.RUNNING:
                    scheduler.park(b)
            return None
        search = user_request.search
        chosen = search.step([candidates.pop(b.request_id) for b in beams])
        if user_request.metrics.first_token_time is None:
            user_request.metrics.first_token_time = time.monotonic()
        if search.done:
            for b in beams:
                scheduler.finish(b)
            return [SampleDelta(k, f.beam.token_ids(), f.beam.logprobs(), None, f.finish_reason, f.stop_reason,
                                ended_by_token=f.stop_reason is not None)
                    for k, f in enumerate(search.results())]
        tokens_of: dict[int, list[tuple[int, int]]] = {}  # beam index -> (rank, token) of its children
        for rank, (i, token) in enumerate(chosen):
            tokens_of.setdefault(i, []).append((rank, token))
        for i, beam in enumerate(beams):
            if i not in tokens_of:  # first, so that its seat and blocks are free for the forks
                scheduler.finish(beam)
                self._user_request_of.pop(beam.request_id)
                user_request.num_preemptions_gone += beam.num_preemptions
        live: list[Request] = [beams[0]] * len(chosen)
        queued: list[Request] = []  # beams without blocks: they go to the front of the queue, best first
        copies: list[tuple[int, int]] = []
        for i, kids in tokens_of.items():
            beam = beams[i]
            for rank, token in kids[1:]:
                child = beam.fork(self._fork_id(user_request))
                forked = scheduler.fork(beam, child)
                if forked is None:
                    queued.append(child)
                else:
                    copies += forked
                child.append_token_ids([token])
                self._user_request_of[child.request_id] = user_request
                live[rank] = child
            rank, token = kids[0]
            if beam.status is not RequestStatus.RUNNING:  # parked: it gave its blocks back
                queued.append(beam)
            beam.append_token_ids([token])
            live[rank] = beam
        self.runner.copy_blocks(copies)
        for beam in sorted(queued, key=live.index, reverse=True):
            scheduler.resume(beam)
        user_request.samples = live
        return None

    def _fork_id(self, user_request: _UserRequest) -> str:
        """A new beam's id, unique among the engine's requests (a request id refuses to be one in use)."""
        while True:
            user_request.num_forks += 1
            beam_id = f"{user_request.request_id}-beam{user_request.num_forks}"
            if beam_id not in self._user_request_of:
                return beam_id

    def _outputs(self, changed: dict, prompt_logprobs: dict[str, list]) -> list[RequestDelta]:
        """One delta per changed user request; finished ones are forgotten and counted."""
        now = time.monotonic()
        outputs = []
        for user_request, deltas in changed.values():
            metrics = user_request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if user_request.finished:
                metrics.finished_time = now
                metrics.num_preemptions = user_request.num_preemptions()
                del self._requests[user_request.request_id]
                self._forget(user_request)
                self._counters["requests_finished"] += 1
            outputs.append(user_request.delta(deltas, prompt_logprobs.get(user_request.request_id)))
        return outputs

    def _score_prompt(self, req: Request, hidden) -> None:
        """Prompt logprobs of the tokens after the chunk's positions, in slices (a slice's logits are
        [slice, vocab] floats)."""
        start = req.num_computed_tokens
        for a in range(0, len(hidden), _SCORE_SLICE):
            part = hidden[a : a + _SCORE_SLICE]
            targets = req.token_ids[start + a + 1 : start + a + 1 + len(part)]
            entries = self.sampler.prompt_logprobs(self.runner.logits(part), targets, req.params.prompt_logprobs)
            req.set_prompt_logprobs(start + a + 1, entries)

    def _sample(self, logits, requests: list[Request]) -> list[tuple]:
        """(token, logprobs) per request. If the batch fails, each request is sampled alone: one that cannot be
        sampled gets its exception in place of a token and the rest goes on."""
        try:
            tokens, logprobs = self.sampler(logits, requests)
            return list(zip(tokens, logprobs, strict=True))
        except Exception:
            out: list[tuple] = []
            for i, req in enumerate(requests):
                try:
                    (token,), (lp,) = self.sampler(logits[i : i + 1], [req])
                    out.append((token, lp))
                except Exception as exc:
                    out.append((exc, None))
            return out

    def _fail(self, user_request: _UserRequest, exc: Exception) -> None:
        """Ends a request that failed on its own (every sample, blocks freed); ``take_failures`` reports it."""
        self._end(user_request, "requests_failed")
        self._failures.append((user_request.request_id, RequestFailedError(
            f"request {user_request.request_id!r} failed in the engine: {type(exc).__name__}: {exc}")))

    def take_failures(self) -> list[tuple[str, RequestFailedError]]:
        """Requests that failed during the last steps (their own fault; the engine goes on), and why."""
        failures, self._failures = self._failures, []
        return failures

    # ---- cache and metrics

    def lora_activity(self) -> LoraActivity | None:
        """The adapters of the running and the waiting requests (None when LoRA is off)."""
        if self.loras is None:
            return None
        sched = self.scheduler

        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))

        return LoraActivity(self.loras.max_loras, names(sched.running), names(sched.waiting))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; refused (False) while any request holds blocks."""
        return self.manager.reset_prefix_cache()

    def get_metrics(self) -> dict[str, int | float]:
        """Counters, gauges and the tokens-per-step histogram (``engine.metrics.engine_metrics``)."""
        return engine_metrics(self.manager, self.scheduler, self._counters, self._iteration_tokens,
                              self._iteration_tokens_sum, self._prefill_seconds, self.kv_tier)

    def close(self) -> None:
        """Finishes the tier's queued writes and stops its writer (nothing else holds outside resources)."""
        if self.kv_tier is not None:
            self.kv_tier.close()
