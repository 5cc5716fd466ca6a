"""The loaded models shared by every run and user of the server."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from ghosted_core.models import LoadedModel, load_model, peek_config
from studio.settings import CACHE_SIZE

log = logging.getLogger(__name__)


class ModelCache:
    """Loaded models shared by every run and user, keyed by model id; at most `capacity`, least recently used first out.

    One lock around lookups and loads: two users asking for the same model load it once, and
    two different loads never compete for memory.
    """

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> LoadedModel:
        with self._lock:
            if name in self._models:
                self._models.move_to_end(name)
                return self._models[name]
            loaded = load_model(name)
            self._models[name] = loaded
            while len(self._models) > self.capacity:
                evicted, _ = self._models.popitem(last=False)
                log.info("model cache full: dropped %s", evicted)
            return loaded

    def peek(self, name: str) -> LoadedModel | None:
        with self._lock:
            return self._models.get(name)

    def put(self, loaded: LoadedModel) -> None:
        """Hold an already loaded model (e.g. one a test session loaded) under its name."""
        with self._lock:
            self._models[loaded.name] = loaded
            self._models.move_to_end(loaded.name)
            while len(self._models) > self.capacity:
                self._models.popitem(last=False)


MODELS = ModelCache(CACHE_SIZE)


def num_blocks(name: str) -> int:
    """Decoder blocks of `name`, from the cache or its config (no weights loaded)."""
    cached = MODELS.peek(name)
    return cached.num_layers if cached else int(peek_config(name).num_hidden_layers)

