"""The replicas' LoRA adapters as the router needs them: each adapter's name (what a request puts in ``"model"``)
and its content fingerprint, which with the tenant and salt names the adapter's cache namespace
(``cache.identity.namespace_salt``). Read from the replicas' ``/v1/models`` (their adapter cards' ``kvprefix
.lora_fingerprint``), again at every health check, since adapters load and unload at run time."""

from __future__ import annotations

import httpx


class AdapterFingerprints(dict[str, str]):
    """Adapter name -> fingerprint, over every replica that answered (a name loaded on any replica counts)."""

    async def refresh(self, client: httpx.AsyncClient, replicas: list[str], headers: dict[str, str],
                      timeout: float) -> None:
        """Replaces the map with what the replicas list now; a replica that does not answer keeps its names out."""
        found: dict[str, str] = {}
        for url in replicas:
            try:
                answer = await client.get(url + "/v1/models", headers=headers, timeout=timeout)
                cards = answer.json().get("data", []) if answer.status_code == 200 else []
            except (httpx.HTTPError, ValueError, AttributeError):
                continue
            for card in cards:
                fingerprint = (card.get("kvprefix") or {}).get("lora_fingerprint") if isinstance(card, dict) else None
                if isinstance(fingerprint, str) and isinstance(card.get("id"), str):
                    found[card["id"]] = fingerprint
        if found != self:
            self.clear()
            self.update(found)
