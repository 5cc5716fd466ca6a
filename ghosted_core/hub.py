"""Whether the Hugging Face Hub can be reached, decided quickly and once per process."""

from __future__ import annotations

import functools
import logging
import os
import socket

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
    try:
        with socket.create_connection((HUB_HOST, 443), timeout=timeout):
            return True
    except OSError as err:
        log.info("the Hugging Face Hub is not reachable (%s)", err)
        return False
