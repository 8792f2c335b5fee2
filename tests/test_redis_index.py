"""The Redis backend's index of holders (``slots`` and ``htask``, scripts/prelude.lua): an
acquire and a release cost the same commands however many hold, and the slots and twins they
find are what reading every holder would give, through expiries, releases, pushed grants and an
index that is missing, half missing or stale."""

import random

import pytest

from celery_semaphore.backends import get_backend
from tests.test_redis_upstream import counted

#: Commands whose cost grows with the hash or set they read whole.
WHOLE_READS = {"hgetall", "hvals", "hkeys", "hscan", "zrange", "smembers"}


def _pair(backend, name, holder, limit):
    def cycle():
        assert backend.acquire(name, holder, limit=limit, ttl=60, meta={"task_id": "x"},
                               wait=True).grant is not None
        assert backend.release(name, holder)
    return cycle


def test_a_pair_beside_three_hundred_holders_costs_what_it_costs_beside_one(private_redis):
    """The commands of an acquire and release beside 1, 40 and 300 other holders are the same,
    and none of them reads every holder (before the index, each acquire read the whole
    ``hinfo`` with ``HGETALL``)."""
    url, client = private_redis
    backend = get_backend(url, key_prefix="ix:")
    costs = []
    for others in (1, 40, 300):
        name = f"wide{others}"
        for i in range(others):
            assert backend.acquire(name, f"o{i}:1", limit=1000, ttl=60, meta={},
                                   wait=True).grant is not None
        _pair(backend, name, "t:1", 1000)()  # the first one beside others builds the index
        costs.append(counted(client, _pair(backend, name, "t:2", 1000)))
    assert costs[0] == costs[1] == costs[2], costs
    assert not WHOLE_READS & set(costs[0]), costs[0]


def test_a_handoff_at_a_full_semaphore_reads_no_holder_but_its_own(private_redis):
    """A release that pushes its slot to the head of the queue, beside 299 other holders, reads
    neither the holders nor the queue whole (a twin check of the head and the lowest free slot
    come from the index)."""
    url, client = private_redis
    backend = get_backend(url, key_prefix="ix:")
    for i in range(300):
        assert backend.acquire("full", f"o{i}:1", limit=300, ttl=60, meta={},
                               wait=True).grant is not None
    assert backend.acquire("full", "w:1", limit=300, ttl=60, meta={}, wait=True,
                           push=True).position == 0
    handoff = counted(client, lambda: backend.release("full", "o7:1"))
    assert handoff.get("publish") == 1, handoff  # the grant went out to the waiter
    # (the queue's head is read as a range of one: ZRANGE queue 0 0)
    assert not (WHOLE_READS - {"zrange"}) & set(handoff), handoff
    holders = {h.holder: h.slot for h in backend.status("full").holders}
    assert holders["w:1"] == 7 and len(set(holders.values())) == 300


class Reference:
    """What reading every holder decides: the lowest free slot below the limit, one holder per
    task (a holder id names its task before its last ':'), a holder's own grant again."""

    def __init__(self, limit):
        self.limit = limit
        self.holders = {}

    @staticmethod
    def task(holder):
        return holder.rpartition(":")[0] if ":" in holder else None

    def acquire(self, holder):
        if holder in self.holders:
            return self.holders[holder]
        task = self.task(holder)
        if task is not None and any(self.task(h) == task for h in self.holders):
            return None
        if len(self.holders) >= self.limit:
            return None
        slot = min(set(range(self.limit + 1)) - set(self.holders.values()))
        self.holders[holder] = slot
        return slot


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_traffic_gets_the_slots_and_twins_of_reading_every_holder(private_redis, seed):
    """Acquires (twins among them), releases, expired leases and an index that goes missing,
    goes missing in part or keeps a stale entry: every answer is the reference's, an index
    with one set bit per stored holder names exactly their slots and tasks (what the scripts
    trust), and every key has a TTL."""
    url, client = private_redis
    backend = get_backend(url, key_prefix="ix:")
    rng = random.Random(seed)
    keys = backend.key_names("r")
    limit = 9
    ref = Reference(limit)
    counter = 0
    corrupted = 0
    for step in range(700):
        roll = rng.random()
        if roll < 0.5 or not ref.holders:
            counter += 1
            task = rng.choice([f"T{rng.randrange(12)}", None])
            holder = (rng.choice(list(ref.holders)) if ref.holders and rng.random() < 0.1
                      else f"{task}:{counter}" if task else f"plain{counter}")
            want = ref.acquire(holder)
            got = backend.acquire("r", holder, limit=limit, ttl=60, meta={}, wait=False)
            assert (got.grant.slot if got.grant else None) == want, (step, holder)
        elif roll < 0.8:
            holder = rng.choice(sorted(ref.holders))
            del ref.holders[holder]
            assert backend.release("r", holder), (step, holder)
        elif roll < 0.9:  # a lease that expired: the next call prunes it
            holder = rng.choice(sorted(ref.holders))
            del ref.holders[holder]
            client.zadd(keys["holders"], {holder: 1})
        else:
            corrupted += 1
            kind = rng.randrange(3)
            if kind == 0:  # expired, or written before the index existed
                client.delete(keys["slots"], keys["htask"])
            elif kind == 1:  # the slots alone (their count no longer matches)
                client.delete(keys["slots"])
            elif client.exists(keys["htask"]):  # an entry of a task nobody holds
                held_tasks = {Reference.task(h) for h in ref.holders}
                task = rng.choice([f"T{k}" for k in range(12) if f"T{k}" not in held_tasks])
                client.hset(keys["htask"], f"o:{task}", f"{task}:ghost")
        status = backend.status("r")
        held = {h.holder: h.slot for h in status.holders} if status else {}
        assert held == ref.holders, step
        # What the scripts trust (check_index): as many slot bits as stored holders (an
        # expired lease stays until the next call) means the index is theirs exactly.
        bits = client.get(keys["slots"]) or b""
        set_bits = {i for i in range(len(bits) * 8) if bits[i // 8] >> (7 - i % 8) & 1}
        stored = {h.decode(): int(v.split(b"\n")[0])
                  for h, v in client.hgetall(keys["hinfo"]).items()}
        if len(set_bits) == len(stored):
            assert set_bits == set(stored.values()), step
            index = {k.decode(): v.decode() for k, v in client.hgetall(keys["htask"]).items()}
            for holder in stored:
                task = Reference.task(holder)
                assert index[f"o:{task}" if task else f"h:{holder}"] == holder, (step, holder)
        for key in keys.values():
            if client.exists(key):
                assert client.pttl(key) > 0, (step, key)
    assert corrupted > 20


def test_a_twin_is_refused_when_the_index_must_be_built_first(private_redis):
    """A task's second delivery waits for its twin when the index is absent (state written
    before it, or expired): the acquire builds it from the holders and sees the twin."""
    url, client = private_redis
    backend = get_backend(url, key_prefix="ix:")
    keys = backend.key_names("tw")
    for holder in ("job-1:a", "job-2:a", "job-3:a"):
        assert backend.acquire("tw", holder, limit=5, ttl=60, meta={}, wait=True).grant
    client.delete(keys["slots"], keys["htask"])
    twin = backend.acquire("tw", "job-2:b", limit=5, ttl=60, meta={}, wait=False)
    assert twin.grant is None
    other = backend.acquire("tw", "job-4:a", limit=5, ttl=60, meta={}, wait=False)
    assert other.grant.slot == 3
    assert backend.release("tw", "job-2:a")
    again = backend.acquire("tw", "job-2:b", limit=5, ttl=60, meta={}, wait=False)
    assert again.grant.slot == 1


def test_grants_pushed_in_one_call_after_every_lease_expired_take_different_slots(
        private_redis):
    """Two holders' leases expire while their tasks' second deliveries wait for pushed grants
    (twins wait in place, beside free slots); the next call checks the index (a waiter may
    start: is its twin held?), prunes both holders (the index left with no bit set), then
    pushes both grants: the first, to an empty semaphore, starts no index; the second builds
    it again and takes the next slot."""
    url, client = private_redis
    backend = get_backend(url, key_prefix="ix:")
    keys = backend.key_names("px")
    for holder in ("a:1", "b:1"):
        assert backend.acquire("px", holder, limit=4, ttl=60, meta={}, wait=True).grant
    for twin in ("a:2", "b:2"):
        assert backend.acquire("px", twin, limit=4, ttl=60, meta={}, wait=True,
                               push=True).position is not None
    client.zadd(keys["holders"], {"a:1": 1, "b:1": 1})
    backend.cancel("px", "nobody")  # any call: it prunes, then pushes what is admissible
    holders = {h.holder: h.slot for h in backend.status("px").holders}
    assert holders == {"a:2": 0, "b:2": 1}, holders


def _config(client, backend, name):
    return client.hgetall(backend._keys(name)[0])


def test_config_keeps_one_epoch_however_many_slots_are_used(private_redis):
    """300 holders at once leave config as small as one does: it keeps the last epoch the
    semaphore issued, not one per slot (a hash of up to 512 fields is a list to Redis, and every
    acquire read it: 11 us per read beside 100 holders, 119 us beside 400). Epochs still grow
    on every slot, pushed grants' included."""
    url, client = private_redis
    backend = get_backend(url, key_prefix="ix:")
    assert backend.acquire("few", "a:1", limit=500, ttl=60, meta={}, wait=True).grant
    few = len(_config(client, backend, "few"))
    epochs = {}
    for i in range(300):
        grant = backend.acquire("many", f"o{i}:1", limit=300, ttl=60, meta={}, wait=True).grant
        epochs[grant.slot] = [grant.epoch]
    config = _config(client, backend, "many")
    assert len(config) <= few + 1, sorted(config)
    assert not [f for f in config if f.startswith(b"e:")], sorted(config)
    assert backend.acquire("many", "w:1", limit=300, ttl=60, meta={}, wait=True,
                           push=True).position == 0
    assert backend.release("many", "o7:1")  # pushes slot 7 to w:1
    assert backend.release("many", "o9:1")
    again = backend.acquire("many", "n:1", limit=300, ttl=60, meta={}, wait=True).grant
    pushed = {h.holder: h for h in backend.status("many").holders}["w:1"]
    assert (pushed.slot, again.slot) == (7, 9)
    assert pushed.epoch > max(e for e, in epochs.values()) and again.epoch > pushed.epoch


def _held(url, client, name, holders, limit=None):
    """A backend, semaphore `name` with `holders` holders (o0:1, o1:1, ...), its config key,
    and an epoch 10 s ahead of the server's clock (as if the clock had stepped back)."""
    backend = get_backend(url, key_prefix="ix:")
    for i in range(holders):
        assert backend.acquire(name, f"o{i}:1", limit=limit or holders, ttl=60, meta={},
                               wait=True).grant
    return backend, backend._keys(name)[0], int(client.time()[0] + 10) * 1_000_000


@pytest.mark.parametrize("way", ["acquire", "pushed", "acquire_all"])
def test_epochs_kept_per_slot_by_an_older_version_are_taken_over_and_dropped(private_redis,
                                                                           way):
    """A config written before the one 'e' field kept 'e:<slot>' fields: the first grant issues
    an epoch above every one of them (here 10 s ahead of the server's clock, as if the clock
    had stepped back), whichever way it grants, and deletes them."""
    url, client = private_redis
    backend, config, ahead = _held(url, client, "old", 3)
    client.hdel(config, "e")
    client.hset(config, mapping={"e:0": ahead - 5, "e:1": ahead, "e:2": ahead - 9})
    if way == "acquire":
        assert backend.release("old", "o1:1")
        epoch = backend.acquire("old", "n:1", limit=3, ttl=60, meta={}, wait=True).grant.epoch
    elif way == "pushed":
        assert backend.acquire("old", "w:1", limit=3, ttl=60, meta={}, wait=True,
                               push=True).position == 0
        assert backend.release("old", "o1:1")
        epoch = {h.holder: h.epoch for h in backend.status("old").holders}["w:1"]
    else:
        assert backend.release("old", "o1:1")
        grants = backend.acquire_all([("old", 3), ("other", 2)], "n:1", ttl=60, meta={},
                                     wait=True).grants
        epoch = grants["old"].epoch
    assert epoch > ahead
    fields = client.hgetall(config)
    assert not [f for f in fields if f.startswith(b"e:")] and int(fields[b"e"]) == epoch


def test_epochs_an_older_version_writes_after_the_takeover_go_at_the_next_refresh(private_redis):
    """In a rolling upgrade an older version goes on writing 'e:<slot>' after the first grant
    took the others over: the call that refreshes the keys' TTLs (every idle_ttl / 16) deletes
    them, and the next epoch is above every one of them."""
    url, client = private_redis
    backend, config, ahead = _held(url, client, "mixed", 2, limit=4)
    client.hset(config, mapping={"e:2": ahead, "e:3": 5})  # an older worker's grants
    assert backend.acquire("mixed", "n:1", limit=4, ttl=60, meta={}, wait=True).grant
    assert client.hexists(config, "e:2")  # (no refresh due yet: they stay)
    client.hset(config, "touched", 1)  # the last refresh long ago
    assert backend.release("mixed", "n:1")
    assert backend.acquire("mixed", "p:1", limit=4, ttl=60, meta={}, wait=True).grant
    assert not [f for f in client.hkeys(config) if f.startswith(b"e:")]
    epoch = backend.acquire("mixed", "q:1", limit=4, ttl=60, meta={}, wait=True).grant.epoch
    assert epoch > ahead
