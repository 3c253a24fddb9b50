"""One identity for every block: a torch-free process that renders a chat body with kvprefix.prompts and roots
its hashes with kvprefix.cache.identity computes exactly the hashes the server's engine keyed the prompt by."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.servers import TENANT_KEYS, Server

BODY = {
    "model": "default-model-v1",
    "max_tokens": 2,
    "messages": [
        {"role": "developer", "content": "You are a careful assistant. Follow the policy to the letter. " * 6},
        {"role": "user", "content": [{"type": "text", "text": "What is a "}, {"type": "text", "text": "prefix?"}]},
    ],
}

# Runs with torch made unimportable: a router has no model.
TORCH_FREE_HASHES = """
import json, sys
sys.modules["torch"] = None
from kvprefix.cache import BlockHasher, context_for_checkpoint
from kvprefix.prompts import render_body
from kvprefix.tokenizer import Tokenizer
path, body, tenant, salt = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] or None, sys.argv[4] or None
tokenizer = Tokenizer(path)
(prompt,) = render_body(tokenizer, body)
hasher = BlockHasher(16, "sha256", context_for_checkpoint(path, "float32", tokenizer.chat_template))
ns = hasher.for_namespace(tenant, salt)
print(json.dumps({"hashes": [h.hex() for h in ns.hash_blocks(prompt.token_ids)], "namespace": ns.namespace_id,
                  "torch": "torch" in sys.modules and sys.modules["torch"] is not None}))
"""


def torch_free_hashes(model_dir: str, body: dict, tenant: str | None = None, salt: str | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_HASHES, model_dir, json.dumps(body), tenant or "", salt or ""],
        capture_output=True, text=True, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["torch"] is False
    return result


def last_log_row(server: Server, request_id: str) -> dict:
    rows = [json.loads(line) for line in server.request_log.read_text().splitlines()]
    return next(r for r in reversed(rows) if r["request_id"].startswith(request_id))


@pytest.mark.slow
def test_torch_free_hashes_equal_the_engines(server: Server, default_model_dir: str, tmp_path) -> None:
    client = server.client()
    reply = client.chat.completions.create(**BODY)
    salted = client.chat.completions.create(**BODY, extra_body={"cache_salt": "team-a"})
    server.wait_idle()
    row, salted_row = last_log_row(server, reply.id), last_log_row(server, salted.id)
    assert len(row["block_hashes"]) == row["prompt_tokens"] // 16 >= 4
    # The checkpoint spelled another way (a symlink, a trailing slash) is the same checkpoint.
    link = tmp_path / "same-model"
    os.symlink(default_model_dir, link)
    mine = torch_free_hashes(str(link) + "/", BODY)
    assert mine["hashes"] == row["block_hashes"] and mine["namespace"] == row["namespace"]
    mine_salted = torch_free_hashes(default_model_dir, BODY, salt="team-a")
    assert mine_salted["hashes"] == salted_row["block_hashes"] != row["block_hashes"]
    assert mine_salted["namespace"] == salted_row["namespace"] != row["namespace"]


@pytest.mark.slow
def test_torch_free_hashes_equal_the_engines_under_tenancy(tenant_server: Server, default_model_dir: str) -> None:
    key = next(k for k, t in TENANT_KEYS.items() if t == "alice")
    reply = tenant_server.client(api_key=key).chat.completions.create(**BODY)
    row = last_log_row(tenant_server, reply.id)
    mine = torch_free_hashes(default_model_dir, BODY, tenant="alice")
    assert mine["hashes"] == row["block_hashes"] and mine["namespace"] == row["namespace"]
    assert torch_free_hashes(default_model_dir, BODY)["hashes"][0] != row["block_hashes"][0]
