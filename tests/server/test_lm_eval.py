"""lm-evaluation-harness, the evaluation tool people point at a vLLM server, against a real `kvprefix serve`: its
`local-completions` model (log-likelihood through echo + logprobs, and generation) and `local-chat-completions`
model (generation through the chat template) give the scores `--model hf` gives on the same checkpoint, down to each
document's log-likelihoods and generated text, and the tasks' shared few-shot prefix is served from the prefix cache.

The tasks and their data are in benchmarks/lmeval (nothing is fetched from a hub); the tool lives in its own
environment (`bash benchmarks/client_envs.sh lm_eval`): without it the test skips, except in CI, where it fails.
The command lines are in docs/server.md.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.client_tools import HITS, ROOT, ServerWindow, run_tool, tool
from support.servers import Server

pytestmark = pytest.mark.slow

MODEL = "default-model-v1"  # the served name of the tests' model
TASKS = ROOT / "benchmarks" / "lmeval"
MC, GEN = "kvprefix_arith_mc", "kvprefix_arith_gen"
DOCS = 40  # the test split of benchmarks/lmeval/arithmetic_test.jsonl
CHAT = ("--apply_chat_template", "--fewshot_as_multiturn")


class Run:
    """One lm_eval run: its scores and each document's responses, per task."""

    def __init__(self, lm_eval: Path, cwd: Path, name: str, model: str, model_args: str, tasks: tuple[str, ...],
                 *flags: str):
        out = cwd / name
        run_tool([lm_eval, "--model", model, "--model_args", model_args, "--tasks", ",".join(tasks),
                  "--include_path", TASKS, "--output_path", out, "--log_samples", *flags], cwd, timeout=600,
                 HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        (results,) = out.glob("*/results_*.json")
        self.scores = json.loads(results.read_text())["results"]
        self.responses = {}
        for task in tasks:
            (samples,) = out.glob(f"*/samples_{task}_*.jsonl")
            rows = [json.loads(line) for line in samples.read_text().splitlines()]
            self.responses[task] = {r["doc_id"]: r["resps"] for r in rows}
            assert len(self.responses[task]) == DOCS


def _same_scores(served: Run, reference: Run, task: str, metrics: tuple[str, ...]) -> None:
    for metric in metrics:
        assert abs(served.scores[task][f"{metric},none"] - reference.scores[task][f"{metric},none"]) <= 0.005, metric


def _shared_prefix_tokens(records: list) -> int:
    """Tokens of the longest run of full blocks every request of the run starts with (the few-shot prefix)."""
    common = os.path.commonprefix([r.block_hashes for r in records])  # element-wise, lists too
    return len(common) * records[0].block_size


def test_lm_eval_scores_as_hf_and_reuses_the_few_shot_prefix(server_process: Server, default_model_dir: str,
                                                              tmp_path: Path) -> None:
    lm_eval = tool("lm_eval")
    server = server_process  # lm_eval reaches a `kvprefix serve` process by its URL
    hf_args = f"pretrained={default_model_dir},dtype=float32"
    served_args = f"model={MODEL},num_concurrent=1,max_retries=1"
    # The references run beside the served runs (they do not touch the server).
    with ThreadPoolExecutor(2) as pool:
        hf = pool.submit(Run, lm_eval, tmp_path, "hf", "hf", hf_args, (MC, GEN),
                         "--device", "cpu", "--batch_size", "8")
        hf_chat = pool.submit(Run, lm_eval, tmp_path, "hf-chat", "hf", hf_args, (GEN,), *CHAT,
                              "--device", "cpu", "--batch_size", "8")
        window = ServerWindow(server)
        completions = Run(lm_eval, tmp_path, "completions", "local-completions",
                          f"{served_args},base_url={server.url}/v1/completions,tokenizer={default_model_dir}",
                          (MC, GEN))
        completion_delta, completion_records = window.close()
        window = ServerWindow(server)
        chat = Run(lm_eval, tmp_path, "chat", "local-chat-completions",
                   f"{served_args},base_url={server.url}/v1/chat/completions", (GEN,), *CHAT)
        chat_delta, chat_records = window.close()
        hf, hf_chat = hf.result(), hf_chat.result()

    # The same scores (within half a point; here they are equal), because each document's results are the same:
    # every choice's log-likelihood to float32 rounding and the same is_greedy, every generated text exactly.
    _same_scores(completions, hf, MC, ("acc", "acc_norm"))
    _same_scores(completions, hf, GEN, ("exact_match",))
    _same_scores(chat, hf_chat, GEN, ("exact_match",))
    for doc, choices in hf.responses[MC].items():
        served = completions.responses[MC][doc]
        assert len(served) == len(choices) == 4
        for (ref,), (got,) in zip(choices, served, strict=True):
            assert abs(float(ref[0]) - float(got[0])) < 1e-3 and ref[1] == got[1], (doc, ref, got)
    assert completions.responses[GEN] == hf.responses[GEN]
    assert chat.responses[GEN] == hf_chat.responses[GEN]

    # Every request succeeded: 4 choices per document scored, then one generation per document.
    assert len(completion_records) == 5 * DOCS and len(chat_records) == DOCS
    assert all(r.status == "ok" for r in completion_records + chat_records)
    # The few-shot prefix (description and five examples, the same before every question) is most of each prompt,
    # and after the first request it comes from the prefix cache. Scoring requests (echo + logprobs) need the
    # prompt's logits and read nothing from the cache, as in vLLM; the generations read it.
    for records in (completion_records, chat_records):
        prefix = _shared_prefix_tokens(records)
        assert prefix >= 0.6 * max(r.prompt_tokens for r in records), prefix
    prefix = _shared_prefix_tokens(chat_records)
    assert all(r.cached_tokens >= prefix for r in chat_records[1:])
    assert chat_delta[HITS] == sum(r.cached_tokens for r in chat_records) >= (DOCS - 1) * prefix
    prefix = _shared_prefix_tokens(completion_records)
    assert completion_delta[HITS] == sum(r.cached_tokens for r in completion_records) >= (DOCS - 1) * prefix
