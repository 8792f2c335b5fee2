"""kombu's filesystem transport, writing each message file atomically.

kombu (5.7) creates a message file, then writes it: a consumer polling at that instant moves
the still-empty file away, fails to decode it and its worker stops (JSONDecodeError in
``Channel._get``, celery/kombu#1551); the message is lost. This subclass writes the file
under a name consumers skip and renames it into place.
"""

import os
import uuid
from time import monotonic

from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        path = os.path.join(self.data_folder_out, name)
        with open(path + ".part", "wb") as f:  # not "<queue>.msg": no consumer takes it
            f.write(str_to_bytes(dumps(payload)))
        os.replace(path + ".part", path)


class Transport(filesystem.Transport):
    Channel = Channel
