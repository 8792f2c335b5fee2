"""A stand-in for a remote object store that checks fencing tokens."""

import fcntl
import json
import os


class StaleToken(Exception):
    """A write carried a fencing token older than one the store already accepted."""


class Store:
    def __init__(self, root):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.fences = os.path.join(root, ".fences.json")

    def write(self, key, size, token):
        """Accept the write unless a newer epoch was seen for the token's slot."""
        with open(self.fences + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            seen = {}
            if os.path.exists(self.fences):
                with open(self.fences) as f:
                    seen = json.load(f)
            if seen.get(str(token.slot), 0) > token.epoch:
                raise StaleToken(f"{key}: token {token} is older than {seen[str(token.slot)]}")
            seen[str(token.slot)] = token.epoch
            with open(self.fences, "w") as f:
                json.dump(seen, f)
        with open(os.path.join(self.root, key.replace("/", "_")), "w") as f:
            f.write(str(size))
