"""A stand-in for a slow remote object store that checks fencing tokens."""

import fcntl
import json
import os
import time


class StaleToken(Exception):
    """A write carried a fencing token older than one the store already accepted."""


class Store:
    """Objects are files under ``root``; ``.fences.json`` holds the newest epoch per slot."""

    latency = 0.5  # seconds per upload: the store is slow, hence the "uploads" semaphore

    def __init__(self, root):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.fences = os.path.join(root, ".fences.json")

    def put(self, key, data, token):
        """Store ``data`` unless a newer epoch was already seen for the token's slot."""
        time.sleep(self.latency)
        with open(self.fences + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            seen = self.fenced()
            newest = seen.get(str(token.slot), 0)
            if token.epoch < newest:
                raise StaleToken(f"{key}: token {token} is older than {token.slot}:{newest}")
            seen[str(token.slot)] = token.epoch
            with open(self.fences, "w") as f:
                json.dump(seen, f)
            with open(os.path.join(self.root, key.replace("/", "_")), "wb") as f:
                f.write(data)

    def fenced(self):
        """{slot: newest epoch accepted}."""
        if not os.path.exists(self.fences):
            return {}
        with open(self.fences) as f:
            return json.load(f)
