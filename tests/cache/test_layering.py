"""The cache core, the renderer, the request log, the planner and the routing policies import no torch: routers
and planning need no model."""

import subprocess
import sys


def test_cache_prompts_logs_sim_and_router_import_without_torch():
    code = (
        "import sys, kvprefix, kvprefix.cache, kvprefix.cache.event_wire, kvprefix.cache.event_index, "
        "kvprefix.prompts, kvprefix.logs, kvprefix.sim.replay, kvprefix.sim.request_log, kvprefix.sim.openai_bodies, "
        "kvprefix.router.policies, kvprefix.router.pending, kvprefix.router.fleet, kvprefix.router.hashing, "
        "kvprefix.router.events, kvprefix.router.metrics, kvprefix.router.app, kvprefix.router.cli, kvprefix.cli; "
        "print(sorted(m for m in ('torch', 'transformers', 'kvprefix.engine') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
