"""Steps 1-3 of every ``epd`` request, whichever path serves it: hash, lookup, encode (Triton-free).

1. **hash**: the content key of each image (media bytes + preprocessing config + encoder
   version). An image sent as ``mm_hash:<key>`` (pre-encoded, see ``encode/cached.py``) is
   its key already. With a tenant (Triton request parameter ``tenant``) under the ``isolated``
   policy, both are taken into that tenant's key space (``store.keys.tenant_key``), so no
   hit, join or ``mm_hash`` crosses tenants (``python_backends/request/tenants.py``).
2. **lookup** (node-wide cache only): a stored key is a hit at once, leased for this request,
   with no call to any encoder. A ``mm_hash`` that is not stored is NOT_FOUND, with a hint.
3. **encode** (when the chosen path needs references for the misses): every other image goes
   to one encoder model (``encoder_<i>``), all at once; the encoder claims the key in the store
   (single-flight across every process), encodes misses through the ``encode`` ensemble, writes
   the store and returns a reference leased for this process. Which encoder: the one a request
   pins (Triton request parameter ``encoder``), else the key's home among the encoder models by
   the one rule of every encoder, local or remote (``scaleout/routing.home``: rendezvous
   hashing; the same image always meets the same encoder, which matters for per-instance
   caches, and adding an encoder moves only its share of the keys). Stages that route images
   themselves (``routes_images``: remote encoder servers, ``scaleout/remote.py``) get no pick
   for an image, only the request's pin (``encoder`` None otherwise): the data flows one way,
   the pipeline never picks what the stage would then discard.

The hit check runs once per image: the lookup in step 2 (it counts the hit; a miss is counted
by the claim that follows, hence ``count_miss=False``). The encoder's ``claim`` in step 3 is the
single-flight point, not a second check: it finds the key stored only when another request
stored it in between (or for callers that skip step 2: clients pre-encoding media, and
per-instance caches). Every lease taken is recorded in :class:`LeasedReferences` as soon as it
is taken, and :meth:`ImageReferences.release` gives them all back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from python_backends.engines.generation import GenerationChunk, ms_since
from python_backends.errors import EpdError, ErrorCode, item_renamed, stage_error
from python_backends.request.generate import CachedImage
from python_backends.request.tenants import key_space, tenant_secret
from python_backends.scaleout.routing import home
from python_backends.store import EmbeddingStore, KeyConfig, Reference, tenant_key

log = logging.getLogger(__name__)

# encoder model (None: the stage routes the image), media, lease owner, tenant, modality
#   -> (wire reference, whether the store had it)
EncodeReference = Callable[[str | None, bytes, int, str | None, str], Awaitable[tuple[bytes, bool]]]


@dataclass
class LeasedReferences:
    """One request's images, videos and audio clips: keys (images first, then videos, then
    clips, each in request order), what the store held (``found``), what it lacks (``missing``:
    key -> media), each key's modality, the references in key order once complete, and the leases
    the request must give back."""

    keys: list[str] = field(default_factory=list)
    modalities: dict[str, str] = field(default_factory=dict)  # key -> "image" | "video" | "audio"
    num_images: int = 0
    num_videos: int = 0
    tenant: str | None = None  # the request's tenant, passed on to the encoders
    found: dict[str, Reference] = field(default_factory=dict)
    missing: dict[str, bytes] = field(default_factory=dict)
    references: list[Reference] = field(default_factory=list)
    leases: list[Reference] = field(default_factory=list)
    cache_hits: int = 0
    fast_hits: int = 0

    @property
    def complete(self) -> bool:
        return not self.missing

    def measured(self, chunk: GenerationChunk, timings: dict[str, float]) -> GenerationChunk:
        """``chunk`` as the request's last: with the timings and the cache counts."""
        chunk.timings_ms, chunk.cache_hits, chunk.fast_hits = dict(timings), self.cache_hits, self.fast_hits
        return chunk


class ImageReferences:
    def __init__(
        self,
        store: EmbeddingStore,
        keys: KeyConfig,
        encoders: Sequence[str],
        encode_reference: EncodeReference,
        *,
        node_cache: bool = True,
        tenant_policy: str = "isolated",
        routes_images: bool = False,
    ) -> None:
        """``routes_images``: ``encode_reference`` picks each image's encoder itself (remote
        encoder servers); it is then named only a request's pin, and videos' encoders."""
        if not encoders:
            raise ValueError("epd needs at least one encoder model")
        self.store = store
        self.keys = keys
        self.encoders = list(encoders)
        self.encode_reference = encode_reference
        self.routes_images = routes_images
        # Per-instance caches (``node_cache=False``) hold keys only their encoder can compute:
        # every image then goes to its encoder, which is what that setting is for.
        self.node_cache = node_cache
        key_space(None, tenant_policy)  # an unknown policy fails here, at load
        tenant_secret()  # so does a tenant secret file it cannot use (read once per process)
        self.tenant_policy = tenant_policy

    def encoder_for(self, key: str, pinned: str | None = None) -> str:
        """The encoder model an image goes to: the pinned one, else the key's home among them."""
        return home(self.encoders, key) if pinned is None else self.checked_pin(pinned)

    def checked_pin(self, pinned: str) -> str:
        """A request's pinned encoder model; INVALID_ARG if this epd serves no such one."""
        if pinned in self.encoders:
            return pinned
        raise EpdError(f"unknown encoder {pinned!r}; this epd serves {', '.join(self.encoders)}", ErrorCode.INVALID_ARG)

    def pick(self, key: str, pinned: str | None, modality: str) -> str | None:
        """What step 3 names to ``encode_reference``: the encoder model, or None for an image
        that the stage routes itself (unpinned, ``routes_images``)."""
        if pinned is None and self.routes_images and modality == "image":
            return None
        return self.encoder_for(key, pinned)

    def lookup(
        self,
        images: Sequence[bytes | CachedImage],
        leased: LeasedReferences,
        timings: dict[str, float],
        tenant: str | None = None,
        videos: Sequence[bytes] = (),
        audios: Sequence[bytes] = (),
    ) -> None:
        """Steps 1 and 2: keys (in ``tenant``'s key space under the ``isolated`` policy), and a
        leased reference for every image, video and audio clip the store holds. A video's key
        covers its bytes, the video processor's config, the frame sampling and the encoder version
        (``KeyConfig``), a clip's the feature extractor's config and the encoder version: a stored
        one skips decode and encode entirely."""
        start = time.perf_counter()
        space = key_space(tenant, self.tenant_policy)
        leased.tenant = tenant
        leased.num_images, leased.num_videos = len(images), len(videos)
        leased.keys = [
            tenant_key(im.mm_hash if isinstance(im, CachedImage) else self.keys.key(im), space) for im in images
        ]
        leased.modalities = dict.fromkeys(leased.keys, "image")
        for modality, media in (("video", videos), ("audio", audios)):
            keys = [tenant_key(self.keys.key(item, modality=modality), space) for item in media]
            leased.modalities.update(dict.fromkeys(keys, modality))
            leased.keys += keys
        timings["hash"] = ms_since(start)
        start = time.perf_counter()
        items: list[bytes | CachedImage] = [*images, *videos, *audios]
        try:
            for index, (key, image) in enumerate(zip(leased.keys, items, strict=True)):
                if key in leased.found or key in leased.missing:
                    continue
                if isinstance(image, CachedImage):
                    ref = self._cached(key, index)
                elif self.node_cache and (found := self.store.lookup(key, count_miss=False)) is not None:
                    ref = found
                else:
                    leased.missing[key] = image
                    continue
                leased.found[key] = ref
                leased.leases.append(ref)
                leased.cache_hits += 1
                leased.fast_hits += 1
        except EpdError as exc:
            raise stage_error("lookup", exc) from None
        timings["lookup"] = ms_since(start)
        if leased.complete:
            leased.references = [leased.found[key] for key in leased.keys]

    def _cached(self, key: str, index: int) -> Reference:
        """The entry an ``mm_hash:`` item names (``key``: already in the request's key space).
        The message names the item by index, never by hash or tenant, so that every miss reads
        the same: another tenant's image is indistinguishable from one no one sent."""
        ref = self.store.lookup(key)
        if ref is None:
            raise EpdError(
                f"image[{index}] names an mm_hash that is not in the embedding cache (never encoded, evicted or "
                "encoded by another encoder version); send the image bytes instead",
                ErrorCode.NOT_FOUND,
            )
        return ref

    async def encode_missing(self, leased: LeasedReferences, pinned: str | None, timings: dict[str, float]) -> None:
        """Step 3: all misses at once, each through its encoder; leases are recorded as soon as
        each answer arrives, so a failure or cancellation releases every one that was taken."""
        if not leased.missing:
            return
        start = time.perf_counter()
        owner = os.getpid()
        indices = {key: leased.keys.index(key) for key in leased.missing}

        async def one(key: str, image: bytes) -> None:
            modality = leased.modalities.get(key, "image")
            try:
                encoder = self.pick(key, pinned, modality)
                wire, cache_hit = await self.encode_reference(encoder, image, owner, leased.tenant, modality)
            except EpdError as exc:  # the encoder saw one item: name it as the client did
                first = {"video": leased.num_images, "audio": leased.num_images + leased.num_videos}
                index = indices[key] - first.get(modality, 0)
                raise item_renamed(exc, modality, index) from None
            ref = self.store.parse_reference(wire)
            leased.leases.append(ref)
            leased.found[key] = ref
            leased.cache_hits += int(cache_hit)

        tasks = [asyncio.ensure_future(one(key, image)) for key, image in leased.missing.items()]
        try:
            await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        except asyncio.CancelledError:
            # The BLS calls run on; their leases must be recorded before the request releases.
            await asyncio.wait(tasks)
            raise
        failures = [error for t in tasks if (error := t.exception()) is not None]
        if failures:
            raise stage_error("encode", failures[0])
        leased.missing.clear()
        leased.references = [leased.found[key] for key in leased.keys]
        timings["encode"] = ms_since(start)

    def release(self, leased: LeasedReferences) -> None:
        for ref in leased.leases:
            try:
                self.store.release(ref)
            except Exception:
                log.warning("could not release lease %s", ref.lease_id, exc_info=True)
        leased.leases.clear()
