"""The KV event wire codec and the event-fed index, on events from a real KVCacheManager."""

import json

import pytest

from kvprefix.cache import (
    AllBlocksCleared,
    BlockHasher,
    BlockIdentity,
    BlockRemoved,
    BlockStored,
    CacheRequest,
    ExecutionContext,
    KVCacheManager,
)
from kvprefix.cache.event_index import BlockIndex, MediaIndex, StreamError, StreamMirror
from kvprefix.cache.event_wire import (
    WIRE_VERSION,
    BlockRun,
    Event,
    Goodbye,
    Heartbeat,
    Hello,
    LoadCosts,
    SnapshotBlocks,
    SnapshotEnd,
    SnapshotStart,
    decode,
    dumps,
    loads,
)
from kvprefix.cache.media import DISK, POOL, SHARED, Medium

BS = 4


def run_requests(manager: KVCacheManager, prompts: list[tuple[str, list[int]]]) -> None:
    """Each prompt admitted, computed, registered and freed in turn (a small pool evicts)."""
    for i, (salt, tokens) in enumerate(prompts):
        req = CacheRequest(f"r{i}", tokens, BlockHasher(BS).with_salt(salt))
        hits, n = manager.get_computed_blocks(req)
        assert manager.allocate_slots(req, req.num_tokens - n, hits) is not None
        req.num_computed_tokens = req.num_tokens
        manager.cache_blocks(req, req.num_computed_tokens)
        manager.free(req)


PROMPTS = [("", list(range(18))), ("", list(range(12)) + [99] * 6), ("t2", list(range(18))),
           ("", list(range(40, 70))), ("", list(range(18)))]


def recorded_events(num_blocks: int = 10) -> tuple[KVCacheManager, list]:
    manager = KVCacheManager(num_blocks, BS)
    events: list = []
    manager.events.subscribe(events.append)
    run_requests(manager, PROMPTS)
    return manager, events


def test_events_round_trip_without_token_ids():
    _, events = recorded_events()
    assert {type(e) for e in events} == {BlockStored, BlockRemoved}
    for seq, event in enumerate([*events, AllBlocksCleared()], start=1):
        line = dumps(Event(seq, "replica-a", event))
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        wire = json.loads(line)
        assert wire["seq"] == seq and wire["replica_id"] == "replica-a"
        assert "token_ids" not in wire and "extra_keys" not in wire  # the prompt never leaves the replica
        back = loads(line)
        if isinstance(event, BlockStored):
            assert wire["type"] == "stored" and wire["block_size"] == BS
            assert wire["hashes"] == [h.hex() for h in event.block_hashes]
            assert wire["namespace"] == event.namespace
            assert back == Event(seq, "replica-a", BlockStored(event.block_hashes, event.parent_block_hash, None,
                                                                BS, None, event.namespace))
        else:
            assert back == Event(seq, "replica-a", event)


def test_first_blocks_have_the_root_as_parent_and_a_public_namespace():
    _, events = recorded_events()
    first = [loads(dumps(Event(1, "r", e))).event for e in events if isinstance(e, BlockStored)]
    salted = BlockHasher(BS).with_salt("t2")
    assert first[0].parent_block_hash == BlockHasher(BS).root
    assert first[0].block_hashes == BlockHasher(BS).hash_blocks(PROMPTS[0][1])
    t2 = [e for e in first if e.namespace == salted.namespace_id]
    assert t2 and t2[0].parent_block_hash == salted.root and "t2" not in t2[0].namespace


@pytest.mark.parametrize("msg", [
    Hello("replica-a", "0123abcd", 16, "sha256", b"\x01" * 32, 7, True),
    Hello("replica-a", "0123abcd", 16, "sha256", b"\x01" * 32, 7, True, identity=BlockIdentity(
        16, "sha256", ExecutionContext("m", "", "t", "c", "float32"), "/models/m"), max_model_len=4096),
    SnapshotStart(7, 3),
    SnapshotBlocks([BlockRun("ns1", b"\x01" * 32, [b"\x02" * 32, b"\x03" * 32]), BlockRun("ns2", None, [b"\x04"])]),
    SnapshotEnd(7),
    Heartbeat(9),
    Goodbye(9, "overflow", "too slow"),
])
def test_stream_messages_round_trip(msg):
    assert loads(dumps(msg)) == msg


def test_decode_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match="unknown KV event message type 'block'"):
        decode({"type": "block"})
    with pytest.raises(ValueError, match="lacks the field 'hashes'"):
        decode({"type": "removed", "seq": 1, "replica_id": "r"})
    hello = json.loads(dumps(Hello("r", "e", 16, "sha256", b"\x00", 0, False)))
    with pytest.raises(ValueError, match="version 3; this reader knows 1, 2"):
        decode({**hello, "version": WIRE_VERSION + 1})


def test_index_mirrors_the_pool_and_its_runs_rebuild_it():
    manager, events = recorded_events()
    index = BlockIndex()
    for e in events:
        index.apply(e)
    assert set(index.blocks()) == set(manager.pool.cached_blocks)
    assert any(isinstance(e, BlockRemoved) for e in events)  # the small pool evicted: removals were applied
    runs = index.runs(max_run=2)
    assert all(1 <= len(r.hashes) <= 2 for r in runs)
    rebuilt = BlockIndex()
    for run in loads(dumps(SnapshotBlocks(runs))).runs:
        rebuilt.add_run(run)
    assert rebuilt.blocks() == index.blocks()
    chain = BlockHasher(BS).hash_blocks(PROMPTS[-1][1])
    assert index.cached_prefix_blocks(chain) == len(chain)  # the last prompt's blocks are all cached
    index.apply(AllBlocksCleared())
    assert len(index) == 0


def _snapshot_stream(mirror: StreamMirror, seq: int, runs: list[BlockRun]) -> None:
    for msg in (Hello("r", "epoch-1", BS, "sha256", b"\x00", seq, False), SnapshotStart(seq, 1),
                SnapshotBlocks(runs), SnapshotEnd(seq)):
        mirror.apply(msg)


def test_mirror_refuses_gaps_repeats_and_foreign_resumes():
    removed = Event(6, "r", BlockRemoved([b"\x02"]))
    mirror = StreamMirror()
    with pytest.raises(StreamError):
        mirror.apply(removed)  # no state yet: an event cannot be applied to nothing
    _snapshot_stream(mirror, 5, [BlockRun("ns", b"\x00", [b"\x02"])])
    assert mirror.ready and mirror.since == 5 and b"\x02" in mirror.index
    mirror.apply(removed)
    assert b"\x02" not in mirror.index and mirror.since == 6
    with pytest.raises(StreamError):
        mirror.apply(removed)  # a repeat
    with pytest.raises(StreamError):
        mirror.apply(Event(8, "r", AllBlocksCleared()))  # a gap
    with pytest.raises(StreamError):
        mirror.apply(Heartbeat(7))  # the stream claims an event this mirror never got
    mirror.apply(Goodbye(6, "overflow"))
    assert not mirror.ready
    with pytest.raises(StreamError):
        mirror.apply(Hello("r", "epoch-2", BS, "sha256", b"\x00", 9, True))
    mirror.apply(Hello("r", "epoch-1", BS, "sha256", b"\x00", 9, True))
    assert mirror.ready
    mirror.apply(Event(7, "r", AllBlocksCleared()))
    assert len(mirror.index) == 0


# ---- where a block is held (the medium) and what loading from there costs: wire version 2


@pytest.mark.parametrize("msg", [
    Event(3, "r", BlockStored([b"\x05" * 32, b"\x06" * 32], b"\x04" * 32, None, 16, None, "ns", DISK)),
    Event(4, "r", BlockRemoved([b"\x05" * 32], SHARED)),
    Hello("r", "e", 16, "sha256", b"\x01" * 32, 0, False, media=(
        Medium(POOL, 364), Medium(DISK, 28_000, 0.07), Medium(SHARED, None, 0.1, "0123456789abcdef"))),
    SnapshotBlocks([BlockRun("ns", None, [b"\x07"], DISK), BlockRun("ns", b"\x01", [b"\x08"], SHARED)]),
    LoadCosts({DISK: 0.05, SHARED: 0.125}),
])
def test_media_and_load_costs_round_trip(msg):
    assert loads(dumps(msg)) == msg


def test_the_medium_is_on_the_wire_as_vllm_names_it():
    stored = json.loads(dumps(Event(1, "r", BlockStored([b"\x05"], None, None, 16, None, "ns", DISK))))
    removed = json.loads(dumps(Event(2, "r", BlockRemoved([b"\x05"]))))
    assert (stored["medium"], removed["medium"]) == ("Disk", "GPU")  # vLLM's "Disk" and MEDIUM_GPU (the pool)
    assert json.loads(dumps(Hello("r", "e", 16, "sha256", b"\x00", 0, False)))["version"] == 2


def test_a_version_1_stream_is_read_as_the_pool():
    """A replica from before tier events: no medium anywhere, no media in its hello; every block is its pool's."""
    hello = json.loads(dumps(Hello("r", "e", 16, "sha256", b"\x00", 0, False)))
    old = decode({**hello, "version": 1})
    assert old.version == 1 and old.media == ()
    stored = decode({"type": "stored", "seq": 1, "replica_id": "r", "namespace": "ns", "parent": None,
                     "hashes": ["05"], "block_size": 16})
    assert stored.event.medium == POOL
    runs = decode({"type": "snapshot_blocks", "runs": [{"namespace": "ns", "parent": None, "hashes": ["05"]}]})
    assert runs.runs[0].medium == POOL
    mirror = StreamMirror()
    mirror.apply(old)
    assert mirror.media == {POOL: Medium(POOL)}


def test_the_mirror_keeps_each_medium_apart():
    """Stored and removed apply to their medium only; a reset clears the pool, not the tiers; the snapshot's runs
    rebuild every medium; load costs replace the hello's."""
    mirror = StreamMirror()
    media = (Medium(POOL, 8), Medium(DISK, 100, 0.1), Medium(SHARED, None, 0.1, "s"))
    for msg in (Hello("r", "e", BS, "sha256", b"\x00", 2, False, media=media), SnapshotStart(2, 3),
                SnapshotBlocks([BlockRun("ns", b"\x00", [b"a", b"b"]), BlockRun("ns", None, [b"a"], DISK)]),
                SnapshotEnd(2)):
        mirror.apply(msg)
    assert set(mirror.index.blocks()) == {b"a", b"b"} and set(mirror.blocks.of(DISK).blocks()) == {b"a"}
    for seq, event in enumerate([BlockStored([b"c"], b"b", None, BS, None, "ns", SHARED),
                                 BlockRemoved([b"a"], DISK), BlockStored([b"d"], None, None, BS, None, "", DISK),
                                 AllBlocksCleared()], start=3):
        mirror.apply(Event(seq, "r", event))
    assert len(mirror.index) == 0  # the reset emptied the pool
    assert set(mirror.blocks.of(DISK).blocks()) == {b"d"} and b"c" in mirror.blocks.of(SHARED)
    mirror.apply(LoadCosts({DISK: 0.03}))
    assert mirror.media[DISK].load_cost == 0.03 and mirror.media[SHARED].load_cost == 0.1
    # What a publisher snapshots: every medium's runs, the pool's first, each with its medium.
    index = MediaIndex()
    index.add([(b"p", b"\x00", "ns", POOL), (b"d1", None, "", DISK), (b"d2", None, "", DISK),
               (b"s1", b"p", "ns", SHARED), (b"s2", b"s1", "ns", SHARED)])
    runs = index.runs()
    # d1 and d2 were found by a scan (parent unknown): never chained into one run
    assert [(r.medium, r.hashes) for r in runs] == [(POOL, [b"p"]), (DISK, [b"d1"]), (DISK, [b"d2"]),
                                                    (SHARED, [b"s1", b"s2"])]
    assert len(index) == 5
