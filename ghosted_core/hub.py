"""Whether the Hugging Face Hub can be reached, decided quickly and once per process."""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import urllib.parse

log = logging.getLogger(__name__)

HUB_HOST = "huggingface.co"
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@functools.lru_cache(maxsize=1)
def hub_reachable(timeout: float = 3.0) -> bool:
    """True when the Hub answers a TCP connect; False at once when an offline variable is set.

    Callers use this to fail with a clear message instead of hanging on retries.
    """
    if any(os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"} for name in _OFFLINE_ENV):
        return False
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", f"https://{HUB_HOST}")).hostname or HUB_HOST
    answered: list[bool] = []

    def connect() -> None:  # in a thread: a hanging DNS lookup is not bounded by the socket timeout
        try:
            with socket.create_connection((host, 443), timeout=timeout):
                answered.append(True)
        except OSError as err:
            log.debug("the Hugging Face Hub (%s) is not reachable: %s", host, err)

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout + 0.5)
    return bool(answered)
