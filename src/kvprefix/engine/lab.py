"""`kvprefix lab`: the prefix cache on a real engine. Prompts sharing a long system prompt run one at a time with
caching on, then off; the table shows per request the cached tokens and TTFT, that one changed early token loses the
hit, and that outputs are identical either way. With a chat template the prompts are conversations."""

from __future__ import annotations

import argparse

QUESTIONS = (
    "What does a prefix cache store?",
    "Why must the last prompt token always be computed?",
    "Which block is evicted first when memory runs out?",
    "How does a changed early token affect reuse?",
    "What goes into the root of the hash chain?",
    "Why are blocks released tail first?",
)
SYSTEM_TEXT = (
    "You are a careful assistant for an inference team. Answer in short, precise sentences. The team runs a "
    "prefix-caching engine: the keys and values of a shared prompt prefix are computed once, kept in fixed-size "
    "blocks, and reused by every later request that starts with the same tokens under the same model, tokenizer, "
    "template and tenant. "
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint directory, .gguf file or hub id (default: built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=4, help="prompts sharing the system prompt (>= 3)")
    parser.add_argument("--system-tokens", type=int, default=1024, help="length of the shared system prompt")
    parser.add_argument("--max-tokens", type=int, default=32, help="most tokens generated per request (greedy)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def run(args: argparse.Namespace) -> int:
    from kvprefix.engine import LLM, SamplingParams

    if args.num_requests < 3:
        raise SystemExit(f"--num-requests must be >= 3, got {args.num_requests}")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    settings = dict(block_size=args.block_size, dtype=args.dtype, device=args.device)
    results = {}
    for caching in (True, False):
        try:  # a checkpoint that cannot be loaded is a one-line error
            llm = LLM(args.model, enable_prefix_caching=caching, **settings)
        except (ValueError, FileNotFoundError) as exc:
            raise SystemExit(f"kvprefix lab: {exc}") from None
        prompts = build_prompts(llm.get_tokenizer(), args.num_requests, args.system_tokens)
        llm.generate(QUESTIONS[0], params)  # warm-up, so request 1 is not charged for one-time setup
        # One at a time, so each TTFT is that request's own prefill, not time spent queued behind others.
        outputs = [llm.generate(p, params)[0] for p in prompts]
        changed = list(prompts[0])
        changed[1] = (changed[1] + 1) % llm.llm_engine.model_config.vocab_size
        changed_out = llm.generate(changed, params)[0]
        results[caching] = (outputs, changed_out)
        del llm
    print_report(results, args.system_tokens)
    same = [o.outputs[0].token_ids for o in results[True][0]] == [o.outputs[0].token_ids for o in results[False][0]]
    return 0 if same else 1


def build_prompts(tokenizer, num_requests: int, system_tokens: int) -> list[list[int]]:
    """Token ids: the same ``system_tokens``-token system prompt, then a different question each (chat-templated
    when the tokenizer has a template)."""
    if tokenizer.chat_template:
        # The template rendered around two markers: its text before the system message, between the system message
        # and the question, and after the question.
        marks = [{"role": "system", "content": "\x00SYSTEM\x00"}, {"role": "user", "content": "\x00USER\x00"}]
        rendered = tokenizer.apply_chat_template(marks, tokenize=False)
        before, rest = rendered.split("\x00SYSTEM\x00")
        between, after = rest.split("\x00USER\x00")
        head = tokenizer.encode(before, add_special_tokens=False)
    else:
        before, between, after, head = "", "\nQuestion: ", "\nAnswer:", tokenizer.encode("")
    text_ids = []
    while len(head) + len(text_ids) < system_tokens:
        text_ids += tokenizer.encode(SYSTEM_TEXT, add_special_tokens=False)
    system = (head + text_ids)[:system_tokens]
    return [
        system + tokenizer.encode(between + QUESTIONS[i % len(QUESTIONS)] + after, add_special_tokens=False)
        for i in range(num_requests)
    ]


def print_report(results: dict, system_tokens: int) -> None:
    on, on_changed = results[True]
    off, off_changed = results[False]
    print(f"{len(on)} requests share a {system_tokens}-token system prompt; each runs alone, greedy.\n")
    print(
        f"{'request':>8} {'prompt':>7} | {'cached (on)':>11} {'TTFT on ms':>10} | {'cached (off)':>12} {'TTFT off ms':>11}"
    )
    rows = [(str(i + 1), a, b) for i, (a, b) in enumerate(zip(on, off, strict=True))]
    rows.append(("changed", on_changed, off_changed))
    for name, a, b in rows:
        print(
            f"{name:>8} {len(a.prompt_token_ids):>7} | {a.num_cached_tokens:>11} {1000 * a.metrics.ttft:>10.1f} | "
            f"{b.num_cached_tokens:>12} {1000 * b.metrics.ttft:>11.1f}"
        )
    print("('changed' is request 1 with its second token changed: nothing after a changed token can hit.)\n")
    for label, outs in (("on ", on), ("off", off)):
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        cached = sum(o.num_cached_tokens for o in outs)
        ttft = sum(o.metrics.ttft for o in outs[1:]) / (len(outs) - 1)
        print(
            f"caching {label}: {prompt} prompt tokens, {cached} from the cache (hit rate {100 * cached / prompt:.1f}%), "
            f"{prompt - cached} computed; mean TTFT of requests 2..{len(outs)}: {1000 * ttft:.1f} ms"
        )
    same = [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    same_changed = on_changed.outputs[0].token_ids == off_changed.outputs[0].token_ids
    verdict = "identical" if same and same_changed else "DIFFERENT"
    print(f"outputs with caching on and off: {verdict} (greedy token ids of every request)\n")
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        question = QUESTIONS[i % len(QUESTIONS)]
        same_text = "same with caching off" if a.outputs[0].token_ids == b.outputs[0].token_ids else "OFF DIFFERS"
        print(f"{i + 1}. {question}\n   -> {a.outputs[0].text.strip()!r} ({same_text})")
