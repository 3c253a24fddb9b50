"""The causes the doctor names (the ``kind`` values of its report), what each means and what fixes it."""

from __future__ import annotations

KINDS: dict[str, tuple[str, str]] = {
    # kind: (what it means, the fix)
    "volatile-prefix": ("content that changes per request (a timestamp, date, uuid, request id, counter, name) "
                        "sits before content other requests share",
                        "move the volatile span after the stable content (the end of the prompt)"),
    "reordered": ("the same items in another order: tools, the JSON keys of a tool schema or a message, few-shot "
                  "examples, retrieved documents",
                  "send tools, JSON keys, few-shot examples and documents in one fixed order"),
    "template-drift": ("the same messages rendered differently: whitespace normalised, a reasoning block dropped "
                       "from the history, the template's default system prompt in some requests and not others",
                       "send the history exactly as it was first sent, and one system prompt per conversation "
                       "(pin one rendering)"),
    "short-prefix": ("the shared part is shorter than one block, and only full blocks are cached",
                     "a smaller --block-size, or a longer shared prefix"),
    "eviction": ("cached, then evicted before it was used again", "more KV capacity"),
    "routing": ("the prefix was cached on another replica", "route by prefix (kvprefix route --policy prefix)"),
    "concurrency": ("the same prefix arrived while its first copy was still being computed",
                    "send one request first and the rest after its first token, or let the server wait for "
                    "the shared prefix"),
    "namespace": ("the same tokens under another tenant, cache salt or adapter: namespaces never share blocks",
                  "share a namespace where tenants may share (no per-user cache_salt on public prompts)"),
    "no-sharing": ("genuinely unique tokens: nothing earlier in the log has them (the honest boundary, not a fix)",
                   "none"),
}
FIXABLE = tuple(k for k in KINDS if k != "no-sharing")
