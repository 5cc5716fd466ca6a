"""The loaded models shared by every run and user of the server."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict

from ghosted_core.model.embedded import EMBEDDED, convert_embedded, needs_conversion
from ghosted_core.model.loading import LoadedModel, LoadOptions, load_model, peek_config
from studio import guard
from studio.presets_view import find_preset
from studio.settings import CACHE_SIZE, hub_cache_bytes

log = logging.getLogger(__name__)


class ModelCache:
    """Loaded models shared by every run and user, keyed by model id; least recently used out first.

    The lock guards only the bookkeeping, never a load: a user whose model is cached is not
    held up while another user's model loads or converts. Two users asking for the same model
    wait for one load. Models held plus loads in flight never exceed `capacity`: a load first
    drops the least recently used model, and waits while every slot is loading. (A run that
    still uses a dropped model keeps it alive until it ends.)
    """

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._models: OrderedDict[str, LoadedModel] = OrderedDict()
        self._loading: set[str] = set()
        self._converting: set[str] = set()
        self._changed = threading.Condition()

    def get(self, name: str, token: str | bool | None = False) -> LoadedModel:
        """The model `name`, loading it (outside the lock) with Hub access `token` if it is not held.

        A model loaded with a visitor's own token is held for that token only (`cache_key`); a model anyone
        may load is shared, and a signed-in visitor is served it too."""
        key = cache_key(name, token)
        with self._changed:
            while True:
                for held in dict.fromkeys((name, key)):
                    if held in self._models:
                        self._models.move_to_end(held)
                        return self._models[held]
                if key not in self._loading and len(self._loading) < self.capacity:
                    break
                self._changed.wait()  # someone else loads this model, or every slot is loading
            self._loading.add(key)
            self._evict(keep=len(self._loading))
        try:
            loaded = load_model(name, LoadOptions(local_folders=guard.model_name(name)[1], hub_token=token,
                                                  hub_cache_bytes=hub_cache_bytes()))
        except BaseException:
            with self._changed:
                self._loading.discard(key)
                self._changed.notify_all()
            raise
        with self._changed:  # one step from "loading" to "held": a waiter never loads it twice
            self._loading.discard(key)
            self._models[key] = loaded
            self._evict(keep=len(self._loading))
            self._changed.notify_all()
            return loaded

    def convert(self, name: str) -> bool:
        """Convert the embedded model `name` from GGUF once (outside the lock); False if nothing was to do."""
        with self._changed:
            while name in self._converting:
                self._changed.wait()
            if not needs_conversion(name):
                return False
            self._converting.add(name)
        try:
            convert_embedded(name)
        finally:
            with self._changed:
                self._converting.discard(name)
                self._changed.notify_all()
        return True

    def peek(self, name: str, token: str | bool | None = False) -> LoadedModel | None:
        with self._changed:
            return self._models.get(name) or self._models.get(cache_key(name, token))

    def put(self, loaded: LoadedModel) -> None:
        """Hold an already loaded model (e.g. one a test session loaded) under its name."""
        with self._changed:
            self._models[loaded.name] = loaded
            self._models.move_to_end(loaded.name)
            self._evict(keep=len(self._loading))

    def held(self) -> int:
        """Models held plus loads in flight: at most `capacity`."""
        with self._changed:
            return len(self._models) + len(self._loading)

    def _evict(self, keep: int) -> None:
        """Drop least recently used models until they fit beside `keep` slots (call with the lock held)."""
        while self._models and len(self._models) + keep > self.capacity:
            evicted, _ = self._models.popitem(last=False)
            log.info("model cache full: dropped %s", evicted)


def cache_key(name: str, token: str | bool | None) -> str:
    """The cache's key for `name` loaded with Hub access `token`: the name itself for what anyone may load
    (anonymous, or the server's token for a model its operator lends it for), the name and a digest of the
    visitor's own token otherwise, so that no other visitor is served what only that token can read."""
    if isinstance(token, str):
        return f"{name} @{hashlib.sha256(token.encode()).hexdigest()[:16]}"
    return name


MODELS = ModelCache(CACHE_SIZE)


def model_shape(name: str, token: str | bool | None = False) -> tuple[int, int]:
    """(decoder blocks, hidden width) of `name`: from the cache, the embedded models' table, a preset or its config.

    Never loads weights or converts a GGUF, so the page can call it on every model change; never
    looks at a folder this server does not open to its users (`studio.guard`).
    """
    name, local = guard.model_name(name)
    cached = MODELS.peek(name, token)
    if cached:
        return cached.num_layers, cached.hidden_size
    if name in EMBEDDED:
        return EMBEDDED[name].num_layers, EMBEDDED[name].hidden_size
    preset = find_preset(name)
    if preset is not None:  # written-down numbers: no Hub request
        return preset.num_layers, preset.hidden_size
    config = peek_config(name, local, token)
    return int(config.num_hidden_layers), int(config.hidden_size)


def num_blocks(name: str, token: str | bool | None = False) -> int:
    """Decoder blocks of `name` (see `model_shape`)."""
    return model_shape(name, token)[0]
