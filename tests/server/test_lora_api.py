"""LoRA adapters through the OpenAI API (in-process app, official openai client): "model" picks an adapter, outputs
equal transformers + peft, each adapter's prefix cache is its own, adapters load and unload at run time under
traffic (admin only), bad adapters are refused, and the metrics count per adapter."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import openai
import pytest
from support.app_server import AppServer
from support.lora_adapters import peft_greedy
from support.servers import ADMIN, ADMIN_KEY, TENANT_KEYS

from kvprefix.model import write_random_lora_adapter

MODEL = "default-model-v1"


@pytest.fixture(scope="module")
def adapters(default_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server-adapters")
    return {
        "r8": write_random_lora_adapter(default_model_dir, str(root / "r8"), rank=8, seed=1, scale=0.1),
        "r16": write_random_lora_adapter(default_model_dir, str(root / "r16"), rank=16, seed=2, scale=0.1,
                                  targets=("q_proj", "v_proj", "o_proj", "up_proj")),
        "r32": write_random_lora_adapter(default_model_dir, str(root / "r32"), rank=32, seed=3, targets=("q_proj",)),
    }


@pytest.fixture(scope="module")
def lora_server(app_registry, adapters) -> AppServer:
    """Adapters r8 (also as r8-twin) and r16 loaded at start, two per step, ranks up to 16; an admin key and tenants."""
    return app_registry.get(("--num-gpu-blocks", "512", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                             "--admin-key", ADMIN_KEY, "--lora-modules", f"r8={adapters['r8']}",
                             f"r8-twin={adapters['r8']}", f"r16={adapters['r16']}"), api_keys=TENANT_KEYS)


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]


def _complete(server: AppServer, model: str, prompt: list[int], max_tokens: int = 6):
    return server.client("key-alice").completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                         temperature=0, extra_body={"ignore_eos": True})


def test_models_lists_adapters_with_their_parent(lora_server: AppServer) -> None:
    cards = {c.id: c for c in lora_server.client("key-alice").models.list().data}
    assert set(cards) == {MODEL, "r8", "r8-twin", "r16"}
    assert cards["r8"].model_extra["parent"] == MODEL and cards[MODEL].model_extra["parent"] is None
    assert cards["r8"].model_extra["kvprefix"]["lora_fingerprint"] == \
        cards["r8-twin"].model_extra["kvprefix"]["lora_fingerprint"]
    assert lora_server.get("/v1/models/r16", headers={"authorization": "Bearer key-bob"}).json()["parent"] == MODEL


def test_outputs_equal_transformers_peft(lora_server: AppServer, default_model_dir: str, adapters) -> None:
    prompt = _ids(1, 40)
    for model, adapter in ((MODEL, None), ("r8", adapters["r8"]), ("r16", adapters["r16"])):
        out = _complete(lora_server, model, prompt, max_tokens=6)
        assert out.model == model
        theirs = peft_greedy(default_model_dir, adapter, [prompt], 6)[0]
        assert lora_server.client("key-alice").completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
        ).choices[0].logprobs.tokens == [f"token_id:{t}" for t in theirs]


def test_base_and_adapter_never_share_blocks(lora_server: AppServer) -> None:
    prompt = _ids(2, 200)  # 12 full blocks
    cached = [_complete(lora_server, m, prompt, 1).usage.prompt_tokens_details.cached_tokens
              for m in (MODEL, "r16", "r8", "r8-twin", MODEL, "r16")]
    # The base first, then each adapter finds nothing; r8-twin is r8's bytes: its blocks. Then each hits its own.
    assert cached == [0, 0, 0, 192, 192, 192]


def test_cache_detail_and_request_per_adapter(lora_server: AppServer) -> None:
    prompt = _ids(3, 100)
    _complete(lora_server, "r8", prompt, 1)
    r = lora_server.client("key-alice").completions.create(model="r8", prompt=prompt, max_tokens=1,
                                                           extra_body={"cache_detail": True})
    (detail,) = r.usage.model_extra["cache_detail"]
    assert detail["reason"] == "full_hit" and detail["cached_tokens"] == 96


def test_metrics_per_adapter_and_lora_requests_info(lora_server: AppServer) -> None:
    _complete(lora_server, "r16", _ids(4, 50), 1)
    text = lora_server.get("/metrics", headers=ADMIN).text
    assert 'max_lora="2"' in text and "kvprefix:lora_requests_info" in text
    assert 'kvprefix:lora_prompt_tokens_total{engine="0",lora_name="r16",model_name="default-model-v1"}' in text
    assert 'kvprefix:lora_prefix_cache_hits_total{engine="0",lora_name="r16"' in text


def test_unknown_adapter_is_a_404(lora_server: AppServer) -> None:
    with pytest.raises(openai.NotFoundError, match="the model 'nope' does not exist"):
        _complete(lora_server, "nope", _ids(5, 10))


def test_load_and_unload_are_admin_only(lora_server: AppServer, adapters) -> None:
    r = lora_server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["r8"]},
                         headers={"authorization": "Bearer key-alice"})
    assert r.status_code == 401
    r = lora_server.post("/v1/unload_lora_adapter", {"lora_name": "r8"}, headers={"authorization": "Bearer key-bob"})
    assert r.status_code == 401


@pytest.mark.parametrize("body, status, message", [
    ({"lora_name": "big", "lora_path": "{r32}"}, 400, "has rank 32, over the limit max_lora_rank=16"),
    ({"lora_name": "gone", "lora_path": "/nonexistent/adapter"}, 400, "missing adapter_config.json"),
    ({"lora_name": "r8", "lora_path": "{r8}"}, 400, "The lora adapter 'r8' has already been loaded."),
    ({"lora_name": MODEL, "lora_path": "{r8}"}, 400, "is the base model's name"),
    ({"lora_name": "x"}, 400, "lora_path"),
])
def test_bad_adapters_are_refused(lora_server: AppServer, adapters, body, status, message) -> None:
    body = {k: v.format(**adapters) for k, v in body.items()}
    r = lora_server.post("/v1/load_lora_adapter", body, headers=ADMIN)
    assert r.status_code == status and message in r.json()["error"]["message"]
    assert "\n" not in r.json()["error"]["message"]
    listed = {c.id for c in lora_server.client("key-alice").models.list().data}
    assert listed == {MODEL, "r8", "r8-twin", "r16"}


def test_unloading_an_unknown_adapter_is_vllms_404(lora_server: AppServer) -> None:
    r = lora_server.post("/v1/unload_lora_adapter", {"lora_name": "never"}, headers=ADMIN)
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'never' cannot be found."


def test_load_and_unload_under_traffic(lora_server: AppServer, adapters, default_model_dir: str,
                                      tmp_path: Path) -> None:
    """Streams run on a run-time adapter while it is unloaded: each finishes with all its tokens; the next request
    for it is a 404; loaded again (retrained, under the same name) it is a new cache namespace."""
    r = lora_server.post("/v1/load_lora_adapter", {"lora_name": "live", "lora_path": adapters["r16"]}, headers=ADMIN)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'live' added successfully."
    prompt = _ids(6, 64)
    client = lora_server.async_client("key-alice")
    unloaded = asyncio.Event()

    async def stream(i: int) -> tuple[int, str | None]:
        s = await client.completions.create(model="live", prompt=prompt + [i + 3], max_tokens=40, stream=True,
                                            temperature=0, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        tokens, reason = 0, None
        async for chunk in s:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if i == 0 and not unloaded.is_set():  # mid-stream, with every stream admitted
                ok = await asyncio.to_thread(lora_server.post, "/v1/unload_lora_adapter", {"lora_name": "live"},
                                             headers=ADMIN)
                assert ok.status_code == 200 and ok.text == "Success: LoRA adapter 'live' removed successfully."
                unloaded.set()
        return tokens, reason

    async def traffic() -> list:
        return await asyncio.gather(*(stream(i) for i in range(4)))

    assert asyncio.run(traffic()) == [(40, "length")] * 4
    with pytest.raises(openai.NotFoundError, match="the model 'live' does not exist"):
        _complete(lora_server, "live", prompt)
    retrained = write_random_lora_adapter(default_model_dir, str(tmp_path / "retrained"), rank=16, seed=7, scale=0.1)
    assert lora_server.post("/v1/load_lora_adapter", {"lora_name": "live", "lora_path": retrained},
                            headers=ADMIN).status_code == 200
    assert _complete(lora_server, "live", prompt + [3], 1).usage.prompt_tokens_details.cached_tokens == 0
    assert lora_server.post("/v1/unload_lora_adapter", {"lora_name": "live"}, headers=ADMIN).status_code == 200
    lora_server.wait_idle(ADMIN)


def test_load_inplace_replaces_an_adapter_under_its_name(lora_server: AppServer, adapters) -> None:
    """vLLM's ``load_inplace``: the name stays, its weights change, and so does its cache namespace."""
    def fingerprint() -> str:
        card = lora_server.get("/v1/models/swap", headers={"authorization": "Bearer key-bob"}).json()
        return card["kvprefix"]["lora_fingerprint"]

    assert lora_server.post("/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": adapters["r8"]},
                            headers=ADMIN).status_code == 200
    before, prompt = fingerprint(), _ids(9, 48)
    _complete(lora_server, "swap", prompt)
    again = lora_server.post("/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": adapters["r16"]},
                             headers=ADMIN)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert lora_server.post("/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": adapters["r16"],
                                                      "load_inplace": True}, headers=ADMIN).status_code == 200
    assert fingerprint() != before
    assert _complete(lora_server, "swap", prompt).usage.prompt_tokens_details.cached_tokens == 0
    assert lora_server.post("/v1/unload_lora_adapter", {"lora_name": "swap"}, headers=ADMIN).status_code == 200
    lora_server.wait_idle(ADMIN)


@pytest.mark.parametrize("spec, error", [
    ('{"name": "sql", "path": "/a"}', None),
    ('{"name": "sql", "path": "/a", "base_model_name": "SmolLM2-135M-Instruct"}', None),
    ('{"name": "sql", "path": "/a", "base_model_name": "other"}', "names base_model_name 'other'"),
    ('{"name": "sql"}', "base_model_name optional"),
    ('{"name": "sql", "path": "/a", "rank": 8}', "base_model_name optional"),
    ('{"name": "sql", ', "not valid JSON"),
])
def test_lora_modules_take_vllms_json_form(spec: str, error: str | None, capsys) -> None:
    from kvprefix.cli import build_parser
    from kvprefix.server.cli import prepare

    def parse():
        return prepare(build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/b", spec]))

    if error is None:
        assert parse()[0].lora_modules == {"a": "/b", "sql": "/a"}
        return
    with pytest.raises(SystemExit) as exc:
        parse()
    said = str(exc.value) if exc.value.code != 2 else capsys.readouterr().err.strip().splitlines()[-1]
    assert error in said
