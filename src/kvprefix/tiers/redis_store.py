"""A shared tier on Redis: one verified object per block under one key, so a prefix one replica computed loads on
every replica of the fleet.

Each key (``<prefix><namespace id>:<block hash hex>``) holds the whole object of ``tiers.objects`` (header,
payload and checksum together), written once with ``SET NX`` (and ``EX`` when a TTL is given): a reader sees a
whole object or none, and two writers of one block leave the first. A lookup of a run is one pipelined round
trip of ``EXISTS``; a load is one ``GET``, fully verified before a byte reaches the caller. Redis owns capacity
and expiry (``maxmemory``, its eviction policy, TTLs); at start the store reads them and warns when nothing
bounds it.

Blocks being computed are claimed (``claim``): a key beside the object's (``<object key>:claim``) set if absent,
holding this store's random token, expiring on its own; the write of the object deletes it in the same round trip.
A replica that finds a run claimed by another waits for it instead of computing it too (``engine.tier_loads``).

Failures are misses, never errors: every call has a socket timeout, a failure (refused, timed out, reset) is
counted in ``stats.failures`` and starts a backoff during which calls return a miss (or drop the write, or claim
nothing) at once; the next call after it reconnects. No exception reaches the caller, and no socket operation waits
past the timeout.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from kvprefix.cache.media import SHARED
from kvprefix.tiers.objects import BlockObject, Expected, KVSpec, ObjectError, decode, decode_prefix, encode, verify
from kvprefix.tiers.store import TierStats

log = logging.getLogger(__name__)
DEFAULT_KEY_PREFIX = "kvprefix:"
DEFAULT_TIMEOUT = 0.25  # seconds per call: far above a loopback or LAN round trip, short enough not to be felt
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
INSTALL_HINT = "pip install 'kvprefix[redis]'"


def redis_module():
    """The ``redis`` client package, or ValueError in one line saying how to install it."""
    try:
        import redis
    except ImportError:
        raise ValueError(f"--kv-shared needs the redis client package: {INSTALL_HINT}") from None
    return redis


@dataclass(frozen=True)
class SharedURL:
    """A parsed ``redis://[:password@]host:port/db`` (``rediss://`` for TLS)."""

    url: str
    host: str
    port: int
    db: int
    has_password: bool
    tls: bool

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")

    @property
    def redacted(self) -> str:
        """The URL without its password, for logs and errors."""
        return f"{'rediss' if self.tls else 'redis'}://{'***@' if self.has_password else ''}{self.host}:{self.port}/{self.db}"


def parse_url(url: str) -> SharedURL:
    """Checks a ``--kv-shared`` URL; ValueError in one line (never echoing a password) for one that is not."""
    try:
        parts = urlsplit(url)
        port = parts.port or 6379
    except ValueError as exc:
        raise ValueError(f"--kv-shared: not a redis:// URL ({exc})") from None
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError("--kv-shared must be redis://[:password@]HOST:PORT/DB or rediss://... (TLS)")
    path = parts.path.lstrip("/") or "0"
    if not path.isdigit():
        raise ValueError(f"--kv-shared: the database must be a number, got {unquote(path)!r}")
    return SharedURL(url, parts.hostname, port, int(path), bool(parts.password), parts.scheme == "rediss")


class RedisStore:
    """``RedisStore(url, spec)``: the shared tier at ``url`` for blocks computed under ``spec``; ``timeout``
    seconds per call, keys under ``key_prefix``, objects expiring after ``ttl`` seconds (None: never; Redis's
    eviction policy decides). ``max_bytes`` is the server's ``maxmemory`` (0 when unknown or unbounded)."""

    name = "shared"
    medium = SHARED
    sees_evictions = False  # Redis tells no client what it evicts or expires (``watch``)
    local_lookup = False  # a lookup is a round trip: the engine asks on its loader thread

    def __init__(self, url: str, spec: KVSpec, *, timeout: float = DEFAULT_TIMEOUT,
                 key_prefix: str = DEFAULT_KEY_PREFIX, ttl: int | None = None, backoff: float = 0.5,
                 max_backoff: float = 30.0):
        if timeout <= 0:
            raise ValueError(f"--kv-shared-timeout must be positive, got {timeout}")
        redis = redis_module()
        self.url = parse_url(url)
        self.spec, self.key_prefix, self.ttl = spec, key_prefix, ttl
        self.stats = TierStats()
        self.max_bytes = 0
        self.token = secrets.token_hex(8).encode()  # this store's claims (one per replica): random, names nothing
        self._errors = (redis.RedisError, OSError)
        self._backoff, self._max_backoff = backoff, max_backoff
        self._down_until = 0.0  # monotonic time before which calls are misses without trying
        self._next_backoff = backoff
        self._state = threading.Lock()  # the backoff state: engine thread and writer thread
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No client-side retries: one try per call, bounded by the timeout; the backoff here decides when to retry.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                           retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self.settings = self._read_settings()

    @property
    def store_id(self) -> str:
        """Names this store (host, port, database, key prefix; no password) in 16 hex digits: replicas announcing
        the same id read and write the same blocks (docs/kv-events.md)."""
        where = f"{self.url.host}:{self.url.port}/{self.url.db}/{self.key_prefix}"
        return hashlib.sha256(where.encode()).hexdigest()[:16]

    # ---- keys, failures and backoff

    def key(self, namespace: str, block_hash: bytes) -> str:
        """The object's key: the namespace id (public: a hash of the root, never the salt) and the block hash."""
        return f"{self.key_prefix}{namespace}:{block_hash.hex()}"

    def claim_key(self, namespace: str, block_hash: bytes) -> str:
        """The key of the block's claim: beside its object's key (never one: block hashes hold no colon)."""
        return f"{self.key(namespace, block_hash)}:claim"

    def _available(self) -> bool:
        """False while backing off after a failure (a call then is a miss at once)."""
        return time.monotonic() >= self._down_until

    def _reason(self, exc: BaseException) -> str:
        redis = redis_module()
        if isinstance(exc, (redis.TimeoutError, TimeoutError)):
            return "timeout"
        return "unavailable" if isinstance(exc, (redis.ConnectionError, OSError)) else "error"

    def _failed(self, exc: BaseException) -> str:
        """Counts a failed call by reason (returned) and backs off, doubling up to ``max_backoff``."""
        reason = self._reason(exc)
        with self._state:
            first = self._down_until <= time.monotonic()
            delay = self._next_backoff
            self._down_until = time.monotonic() + delay
            self._next_backoff = min(2 * delay, self._max_backoff)
        with self.stats.lock:
            self.stats.failures[reason] += 1
        if first:
            log.warning("kv shared tier %s: %s (%s); misses for %.1f s, then retrying", self.url.redacted, reason,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__, delay)
        return reason

    def _succeeded(self) -> None:
        if self._next_backoff != self._backoff:
            with self._state:
                self._next_backoff = self._backoff
            log.info("kv shared tier %s: reachable again", self.url.redacted)

    def _read_settings(self) -> dict[str, str]:
        """The server's ``maxmemory`` and eviction policy, with a warning when nothing bounds the tier (Redis's
        defaults grow until the machine runs out) or when writes will be refused instead of evicting. A server
        that is down or forbids CONFIG is told of in the log; the store starts all the same."""
        try:
            got = self.client.config_get("maxmemory*")
        except self._errors as exc:
            if isinstance(exc, redis_module().ResponseError):  # CONFIG renamed or not allowed to this user
                log.info("kv shared tier %s: cannot read its settings (%s); set maxmemory and allkeys-lru there "
                         "(docs/tiers.md)", self.url.redacted, exc)
                return {}
            self._failed(exc)
            return {}
        settings = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                    for k, v in got.items()}
        self.max_bytes = int(settings.get("maxmemory", "0") or 0)
        policy = settings.get("maxmemory-policy", "")
        if not self.max_bytes:
            log.warning("kv shared tier %s: no maxmemory: Redis keeps every block until the machine runs out of "
                        "memory; set maxmemory and maxmemory-policy allkeys-lru (docs/tiers.md)", self.url.redacted)
        elif policy == "noeviction":
            log.warning("kv shared tier %s: maxmemory-policy noeviction: once %d bytes are used every write is "
                        "refused (counted); set allkeys-lru (docs/tiers.md)", self.url.redacted, self.max_bytes)
        elif policy.startswith("volatile") and self.ttl is None:
            log.warning("kv shared tier %s: maxmemory-policy %s evicts only keys with a TTL, and blocks are written "
                        "without one: set allkeys-lru (docs/tiers.md)", self.url.redacted, policy)
        return settings

    # ---- the BlockStore interface

    def _present(self, block_hashes: Sequence[bytes], namespace: str) -> list:
        """Whether each block's key exists: one pipelined round trip of EXISTS (all False when the store fails)."""
        if not block_hashes or not self._available():
            return [False] * len(block_hashes)
        try:
            pipe = self.client.pipeline(transaction=False)
            for h in block_hashes:
                pipe.exists(self.key(namespace, h))
            found = pipe.execute()
        except self._errors as exc:
            self._failed(exc)
            return [False] * len(block_hashes)
        self._succeeded()
        return found

    def lookup(self, block_hashes: Sequence[bytes], namespace: str = "") -> int:
        """How many leading blocks of the run the store holds, in one round trip."""
        with self.stats.lock:
            self.stats.lookups += 1
            self.stats.lookup_blocks += len(block_hashes)
        found = self._present(block_hashes, namespace)
        return next((i for i, present in enumerate(found) if not present), len(found))

    def contains(self, block_hash: bytes, namespace: str = "") -> bool:
        return bool(self._present([block_hash], namespace)[0])

    def claim(self, block_hashes: Sequence[bytes], namespace: str, seconds: float) -> int:
        """Claims the blocks of a run this replica is about to compute, for ``seconds``, in one round trip and one
        transaction (per block ``SET <claim key> <token> NX PX``, ``GET`` to see whose claim stands, ``EXISTS`` of
        the object; ``MULTI``/``EXEC``, so two replicas claiming one run at once do not split it between them);
        returns how many leading blocks another replica claimed first or wrote since the lookup (the caller waits
        for those and computes the rest). A claim already this store's counts as won; a value that is not a
        string (another client's) as free. The store down, slow, failing or refusing (out of memory under
        ``noeviction``): nothing is claimed and 0 returned."""
        if not block_hashes or not self._available():
            return 0
        ms = max(1, round(seconds * 1000))
        try:
            pipe = self.client.pipeline(transaction=True)
            for h in block_hashes:
                key = self.claim_key(namespace, h)
                pipe.set(key, self.token, nx=True, px=ms)
                pipe.get(key)
                pipe.exists(self.key(namespace, h))
            replies = pipe.execute(raise_on_error=False)
        except redis_module().ResponseError as exc:  # the transaction refused (OOM under noeviction): no claims
            log.debug("kv shared tier claims refused: %s", exc)
            return 0
        except self._errors as exc:
            self._failed(exc)
            return 0
        self._succeeded()
        won, holders, written = replies[0::3], replies[1::3], replies[2::3]
        self._unclaim([h for h, w, exists in zip(block_hashes, won, written, strict=True) if w is True and exists == 1],
                      namespace)
        with self.stats.lock:
            self.stats.claims += sum(1 for w, exists in zip(won, written, strict=True) if w is True and exists != 1)
        others = [exists == 1 or (isinstance(holder, bytes) and holder != self.token)
                  for holder, exists in zip(holders, written, strict=True)]
        return next((i for i, other in enumerate(others) if not other), len(others))

    def _unclaim(self, block_hashes: Sequence[bytes], namespace: str) -> None:
        """Deletes the claims just won on blocks written since the lookup (their write deleted the claim before
        this replica set its own): a claim on a written block would only outlive the work it stood for."""
        if not block_hashes:
            return
        try:
            self.client.delete(*(self.claim_key(namespace, h) for h in block_hashes))
        except self._errors as exc:
            self._failed(exc)

    def _get(self, expected: Expected) -> bytes | None:
        """The value at the block's key (None: absent, not a string, or the store failed: counted)."""
        if not self._available():
            return None
        try:
            data = self.client.get(self.key(expected.namespace, expected.block_hash))
        except redis_module().ResponseError as exc:  # WRONGTYPE: another client put a list, a hash... there
            self._rejected(expected, ObjectError("type", str(exc)))
            return None
        except self._errors as exc:
            self._failed(exc)
            return None
        self._succeeded()
        return data

    def _rejected(self, expected: Expected, exc: ObjectError) -> None:
        """A value that does not verify serves nobody: counted and deleted, so the block is written again."""
        with self.stats.lock:
            self.stats.verify_failures[exc.reason] += 1
        try:
            self.client.delete(self.key(expected.namespace, expected.block_hash))
        except self._errors as err:
            self._failed(err)

    def _verified(self, expected: Expected) -> BlockObject | None:
        """The object at the block's key, fully verified (size, checksum, header against ``expected`` and the
        spec; its payload a view of the value), or None: absent, failed, or not verifying (counted, deleted)."""
        data = self._get(expected)
        if data is None:
            return None
        try:
            decode_prefix(data, self.spec)  # this engine's payload size, before anything else is read
            obj = decode(data)
            verify(obj, self.spec, expected)
        except ObjectError as exc:
            self._rejected(expected, exc)
            return None
        with self.stats.lock:
            self.stats.hit_blocks += 1
            self.stats.bytes_read += len(data)
        return obj

    def load(self, expected: Expected) -> BlockObject | None:
        """The whole verified object (tests and tools; the engine loads with ``load_into``)."""
        return self._verified(expected)

    def load_into(self, expected: Expected, spans: Sequence[memoryview]) -> bool:
        """Gets and verifies the object, then copies its payload into ``spans`` (the caller's memory, in payload
        order). On False the spans were not written."""
        obj = self._verified(expected)
        if obj is None:
            return False
        if sum(len(s) for s in spans) != len(obj.payload):
            raise ValueError(f"spans of {sum(len(s) for s in spans)} bytes for a {len(obj.payload)}-byte payload")
        pos = 0
        for span in spans:
            span[:] = obj.payload[pos : pos + len(span)]
            pos += len(span)
        return True

    def store(self, obj: BlockObject, retain_until: float | None = None, tenant: str = "") -> bool:
        """Writes the block once (SET NX; EX: the seconds to ``retain_until`` when a retention gives one, else the
        store's ``ttl``) and deletes its claim in the same round trip; False when dropped: the store is down or
        slow (``unavailable``, ``timeout``), refused it (``rejected``: out of memory under noeviction, or another
        error reply). A block already there is left as it is (True)."""
        if not self._available():
            return self._drop("unavailable")
        data = encode(obj)
        ttl = self.ttl if retain_until is None else max(1, math.ceil(retain_until - time.time()))
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(self.key(obj.namespace, obj.block_hash), data, nx=True, ex=ttl)
            pipe.delete(self.claim_key(obj.namespace, obj.block_hash))  # whoever waits for it finds the object
            written = pipe.execute()[0]
        except redis_module().ResponseError as exc:  # OOM under noeviction, a read-only replica, ...
            log.debug("kv shared tier write refused: %s", exc)
            return self._drop("rejected")
        except self._errors as exc:
            return self._drop(self._failed(exc))
        self._succeeded()
        if not written:  # another writer's object is there: whole, and the same block
            return True
        with self.stats.lock:
            self.stats.stores += 1
            self.stats.bytes_written += len(data)
        return True

    def _drop(self, reason: str) -> bool:
        with self.stats.lock:
            self.stats.dropped_writes[reason] += 1
        return False

    def retain(self, block_hash: bytes, until: float, tenant: str) -> bool:
        """Capacity and expiry are the store's (a retention sets the TTL a block is written with): False."""
        return False

    def retained_bytes(self, tenant: str, besides: Sequence[bytes] = ()) -> int:
        """Nothing counts against a tenant's retention budget here: the budget is the disk tier's."""
        return 0

    def watch(self, presence) -> None:
        """Redis tells no client what it evicts or expires: a block it dropped is known gone when a lookup here
        misses it (``engine.tier_loads``)."""

    def evict(self, num_bytes: int) -> int:
        """Redis evicts by its own policy (``maxmemory-policy``): nothing to do here."""
        return 0
