"""Admission control: a bounded number of pending engine requests (overload is a fast 503, never a hang), and
a gate that an admin reset closes to drain the engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from kvprefix.http.errors import APIError


class Ticket:
    """Held slots; ``release`` is idempotent, since a stream may end on several paths (done, cancelled, never
    started)."""

    def __init__(self, admission: Admission, k: int, tenant: str | None):
        self._admission: Admission | None = admission
        self._k = k
        self._tenant = tenant

    def release(self) -> None:
        if self._admission is not None:
            self._admission.running -= self._k
            self._admission._unreserve(self._k, self._tenant)
            self._admission = None


class Admission:
    def __init__(
        self,
        max_pending: int,
        max_pending_per_tenant: int | None = None,
        on_reject: Callable[[str], None] = lambda reason: None,
    ):
        for name, value in (("max_pending", max_pending), ("max_pending_per_tenant", max_pending_per_tenant)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.max_pending = max_pending
        self.max_pending_per_tenant = max_pending_per_tenant
        self.pending = 0  # engine requests admitted by the server: waiting at the gate or submitted
        self._tenant_pending: dict[str | None, int] = {}
        self.running = 0  # of those, submitted to the engine
        self.closing = False
        self._closers = 0
        self._open = asyncio.Event()
        self._open.set()
        self._on_reject = on_reject

    async def acquire(self, k: int, tenant: str | None = None) -> Ticket:
        """Claims ``k`` engine-request slots (one per prompt), waiting while an admin drain holds the gate. Raises at
        once: 400 for a batch that never fits, 429 when the tenant has its share pending, 503 when full or stopping."""
        limit, option = min((self.max_pending, "--max-pending"),
                            (self.max_pending_per_tenant or self.max_pending, "--max-pending-per-tenant"))
        if k > limit:
            # Retrying cannot help: say so, instead of a 503/429 with Retry-After forever.
            raise APIError(400, f"a batch of {k} prompts can never be admitted: this server admits at most {limit} "
                                f"prompts at once ({option}); send smaller batches", param="prompt",
                           code="batch_too_large")
        if self.closing:
            self._on_reject("shutting_down")
            raise APIError(503, "server is shutting down", type="server_error", code="shutting_down")
        if self.pending + k > self.max_pending:
            self._on_reject("overloaded")
            raise APIError(
                503,
                f"server overloaded: {self.pending} requests pending (limit {self.max_pending}); retry later",
                type="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        mine = self._tenant_pending.get(tenant, 0)
        if self.max_pending_per_tenant is not None and mine + k > self.max_pending_per_tenant:
            self._on_reject("tenant_limit")
            raise APIError(
                429,
                f"too many requests pending for your tenant: {mine} (limit {self.max_pending_per_tenant}); "
                "retry later",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        self.pending += k
        self._tenant_pending[tenant] = mine + k
        try:
            await self._open.wait()
        except BaseException:
            self._unreserve(k, tenant)
            raise
        self.running += k
        return Ticket(self, k, tenant)

    def _unreserve(self, k: int, tenant: str | None) -> None:
        self.pending -= k
        left = self._tenant_pending[tenant] - k
        if left:
            self._tenant_pending[tenant] = left
        else:
            del self._tenant_pending[tenant]

    @asynccontextmanager
    async def drained(self, timeout: float) -> AsyncIterator[bool]:
        """Holds new requests at the gate and waits up to ``timeout`` s for running ones to finish; yields whether
        the engine became idle. Requests held at the gate proceed when the block exits."""
        self._closers += 1
        self._open.clear()
        try:
            deadline = time.monotonic() + timeout
            while self.running and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            yield self.running == 0
        finally:
            self._closers -= 1
            if self._closers == 0:
                self._open.set()
