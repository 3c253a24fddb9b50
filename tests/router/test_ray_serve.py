"""A real local Ray cluster with two engine replicas behind the Ray Serve app: it answers through the custom request
router, which makes the same choices as the standalone policy object replayed offline on the same sequence."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from router_helpers import REPLICA_BLOCKS, shared_prefix_traffic
from server_helpers import free_port

ray = pytest.importorskip("ray")
MODEL = "default-model-v1"


@pytest.mark.slow
def test_ray_serve_routes_like_the_standalone_policy(default_model_dir: str):
    from ray import serve

    from kvprefix.cache import BlockHasher
    from kvprefix.router.hashing import RequestHasher, RouteRequest
    from kvprefix.router.policies import make_policy
    from kvprefix.router.ray_serve import REPLICA_HEADER, _SlotView, build_app

    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        from kvprefix.server.app import ServerConfig

        engine_args = {"model": default_model_dir, "dtype": "float32", "device": "cpu", "num_gpu_blocks": REPLICA_BLOCKS,
                       "max_num_seqs": 16}
        serve.run(build_app(engine_args, 2, "prefix", num_cpus=0.5, config=ServerConfig(served_model_name=MODEL)),
                  name="kvprefix", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200  # goes anywhere, moves no rotation
        traffic = shared_prefix_traffic(rounds=3)
        served, cached = [], []
        for messages in traffic:
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                                   max_tokens=2, temperature=0)
            served.append(raw.headers[REPLICA_HEADER])
            cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
            time.sleep(0.05)  # the router counts a request done a moment after its last byte: replay sees load 0
        chunks = list(client.chat.completions.create(model=MODEL, messages=traffic[0], max_tokens=3,
                                                     stream=True))

        tokenizer, block_size, algo, context = (
            serve.get_deployment_handle("Engine", "kvprefix").block_identity.remote().result())
        hasher = RequestHasher(tokenizer, BlockHasher(block_size, algo, context))
    finally:
        serve.shutdown()
        ray.shutdown()

    # Positions are replica ids in sorted order, as the router places a fresh deployment's replicas.
    position = {rid: i for i, rid in enumerate(sorted(set(served)))}
    policy, view = make_policy("prefix"), _SlotView(["a", "b"], {"a", "b"}, {})
    offline = [policy.choose(RouteRequest(hasher.block_hashes({"messages": m}, None), None), view) for m in traffic]
    assert [position[rid] for rid in served] == offline
    assert len(position) == 2
    first_round = len(traffic) // 3
    assert all(c > 0 for c in cached[first_round:]), cached  # every later question hits its system prompt
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
