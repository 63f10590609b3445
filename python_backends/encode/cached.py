"""An encoder instance in front of the node's embedding store: media in, references out.

Who calls what: each ``encoder_<i>`` model (``model_repository/encoder_0/1/model.py``, via ``server.py``)
builds one :class:`CachedEncoder` with the node's :class:`EmbeddingStore`, the key config and
an ``encode`` coroutine that runs the ``encode`` ensemble (preprocess -> vit_encoder) by BLS.
``epd`` calls the encoder models for the images it did not find in the store; clients may
call them directly to pre-encode media (warm-up) and later send only the ``mm_hash``.

Per image: content key -> ``claim``: HIT (a reference at once), JOIN (another request, in
any process, is encoding it: wait) or PRODUCE (encode, then ``fulfil``; ``abandon`` on
failure so joined waiters get the error instead of a hang). The embeddings are written here,
on the encode side; only the reference (<= 1 KB) goes back through Triton. The images of one
request that it must encode itself (its PRODUCE claims) go to ``encode`` in one request when the
encoder has ``encode_many`` (the cpu target's ``encode`` takes a request's images at once):
fewer BLS hops; if that call refuses the input, each image is encoded alone so that the error
names the right ``image[i]``.

Leases are taken for ``lease_owner`` (the caller's pid: ``epd`` releases them when its
request ends, and the store reaps them if that process dies) or not at all (warm-up).

Cache scope (one setting, ``CachePolicy.scope`` in ``builders/repository.py``): ``node``
keys are shared by every encoder of the node (an image encoded by one is a hit for all);
``instance`` keys carry the encoder's name, so each encoder has its own cache (the
baseline the shared store is measured against). A request's tenant (request parameter
``tenant``) takes its keys into that tenant's space under the ``isolated`` tenant policy
(``python_backends/request/tenants.py``); the ``mm_hash`` answered is the unscoped key, which the
same tenant sends back to ``epd`` as ``mm_hash:<hex>``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import numpy as np
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from python_backends import contract
from python_backends.encode.vit_onnx import embedding_counts
from python_backends.errors import EpdError, ErrorCode, invalid_arg, item_renamed
from python_backends.request.audios import audio_bytes
from python_backends.request.images import image_bytes
from python_backends.request.tenants import key_space, tenant_secret
from python_backends.request.videos import VideoLimits, sized_video_bytes
from python_backends.store import (
    Claim,
    ClaimKind,
    EmbeddingStore,
    EntryMeta,
    KeyConfig,
    Reference,
    StoreFullError,
)


@dataclass(frozen=True)
class EncodedImage:
    """What the ``encode`` ensemble returns for one image."""

    embeds: np.ndarray | Any  # [tokens, hidden]; a CUDA tensor on the gpu target
    grid_thw: tuple[int, int, int] | None  # None: audio (no grid; its tokens are the rows)


T = TypeVar("T")


class Outcome(str, Enum):
    HIT = "hit"  # stored already
    JOIN = "join"  # another request was encoding it; this one waited
    MISS = "miss"  # encoded by this call


@dataclass(frozen=True)
class EncoderAnswer:
    reference: Reference
    outcome: Outcome
    mm_hash: str = ""  # what the client sends back as ``mm_hash:``; "" -> the reference's

    @property
    def client_mm_hash(self) -> str:
        return self.mm_hash or self.reference.mm_hash

    @property
    def cache_hit(self) -> bool:
        return self.outcome is not Outcome.MISS


EncodeFn = Callable[[bytes], Awaitable[EncodedImage]]
# Several images in one call (one ``encode`` request): their embeddings, in order.
EncodeManyFn = Callable[[Sequence[bytes]], Awaitable[list[EncodedImage]]]


def split_encoded(embeds: Any, grid_thw: Any, merge_size: int, images: int) -> list[EncodedImage]:
    """``encode``'s answer for several images (every image's embeddings concatenated,
    ``[1, tokens, hidden]``, and ``image_grid_thw`` ``[images, 3]``) split per image by its grid."""
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    if len(grid) != images:
        raise EpdError(f"encode answered {len(grid)} grids for {images} images", ErrorCode.INTERNAL)
    flat = embeds.reshape(-1, embeds.shape[-1])
    counts = embedding_counts(grid, merge_size) if images else []
    if sum(counts) != flat.shape[0]:
        raise EpdError(
            f"encode answered {flat.shape[0]} embedding rows, the grids {grid.tolist()} need {sum(counts)}",
            ErrorCode.INTERNAL,
        )
    bounds = np.cumsum([0, *counts]).tolist()
    return [
        EncodedImage(flat[bounds[i] : bounds[i + 1]], (int(t), int(h), int(w)))
        for i, (t, h, w) in enumerate(grid.tolist())
    ]


@dataclass(frozen=True)
class _Miss:
    """An image of a request that the request must encode itself (a PRODUCE claim)."""

    index: int  # in the request
    image: bytes
    claim: Claim
    public: str  # the client's mm_hash


def parse_encoder_videos(inputs: Mapping[str, np.ndarray], limits: VideoLimits | None) -> list[bytes] | None:
    """An encoder model's ``video`` input (BYTES, one or more encoded videos, raw or base64),
    or None when the request sends none. Checked here: count, bytes and size; the container
    checks (codec, frame size, duration, frames) are the video preprocessing's, on a miss only:
    a hit's bytes are the bytes of an entry that passed them (content keys)."""
    array = inputs.get(contract.VIDEO)
    if array is None:
        return None
    if limits is None:
        raise invalid_arg("this encoder takes no video (max_videos is 0)")
    if inputs.get(contract.IMAGE) is not None:
        raise invalid_arg("send images or videos to an encoder, not both in one request")
    if array.dtype != np.object_ or array.size == 0:
        raise invalid_arg("input 'video' needs at least one encoded video (BYTES)")
    if array.size > limits.max_videos:
        raise invalid_arg(f"request has {array.size} videos, above the limit of {limits.max_videos} (max_videos)")
    return [
        sized_video_bytes(bytes(item) if isinstance(item, (bytes, np.bytes_)) else b"", i, limits)
        for i, item in enumerate(array.reshape(-1))
    ]


def parse_encoder_audios(inputs: Mapping[str, np.ndarray], max_audios: int) -> list[bytes]:
    """An audio checkpoint's encoder request: ``audio`` (BYTES, one or more encoded audio files,
    raw or base64), at most ``max_audios``. The decode checks are the encode's, on a miss only: a
    hit's bytes are the bytes of an entry that passed them (content keys). Keys are taken over the
    raw bytes, as ``epd`` takes them, so a clip sent either way is one entry."""
    array = inputs.get(contract.AUDIO)
    if array is None or array.size == 0 or array.dtype != np.object_:
        raise invalid_arg("input 'audio' needs at least one encoded audio file (BYTES)")
    if array.size > max_audios:
        raise invalid_arg(f"request has {array.size} audios, above the limit of {max_audios} (max_audios)")
    return [audio_bytes(bytes(item) if isinstance(item, (bytes, np.bytes_)) else b"") for item in array.reshape(-1)]


def parse_encoder_inputs(
    inputs: Mapping[str, np.ndarray], max_images: int, max_image_bytes: int
) -> tuple[list[bytes], int | None]:
    """An encoder model's request: ``image`` (BYTES, one or more encoded images, raw or
    base64) and optional ``lease_owner`` (INT64 pid). Content keys are taken over the decoded
    bytes, as ``epd`` takes them, so a warm-up's ``mm_hash`` matches a later request."""
    array = inputs.get(contract.IMAGE)
    if array is None or array.size == 0:
        raise invalid_arg("input 'image' needs at least one encoded image")
    if array.dtype != np.object_:
        raise invalid_arg("input 'image' must be BYTES (encoded images)")
    if array.size > max_images:
        raise invalid_arg(f"request has {array.size} images, above the limit of {max_images}")
    images = [
        image_bytes(bytes(item) if isinstance(item, (bytes, np.bytes_)) else b"", i)
        for i, item in enumerate(array.reshape(-1))
    ]
    for i, image in enumerate(images):
        if len(image) > max_image_bytes:
            raise invalid_arg(f"image[{i}] has {len(image)} bytes, above the limit of {max_image_bytes}")
    return images, parse_lease_owner(inputs)


def parse_lease_owner(inputs: Mapping[str, np.ndarray]) -> int | None:
    """The optional ``lease_owner`` (INT64 pid) of an encoder model's request."""
    owner = inputs.get(contract.LEASE_OWNER)
    if owner is None:
        return None
    if owner.size != 1 or owner.dtype != np.int64 or int(owner.reshape(-1)[0]) <= 0:
        raise invalid_arg("input 'lease_owner' must be one positive INT64 (a process id)")
    return int(owner.reshape(-1)[0])


def cache_namespace(scope: str, encoder_name: str) -> str:
    """The key namespace of an encoder: "" (node-wide) or its own name (per instance)."""
    if scope == "node":
        return ""
    if scope == "instance":
        return f"instance:{encoder_name}"
    raise ValueError(f"cache scope must be 'node' or 'instance', got {scope!r}")


class CachedEncoder:
    def __init__(
        self,
        store: EmbeddingStore,
        keys: KeyConfig,
        encode: EncodeFn,
        *,
        namespace: str = "",
        tenant_policy: str = "isolated",
        full_store_wait_s: float = 30.0,
        run_blocking: Callable[..., Awaitable[Any]] | None = None,
        encode_video: EncodeFn | None = None,
        encode_audio: EncodeFn | None = None,
        encode_many: EncodeManyFn | None = None,
    ) -> None:
        """``encode``: one image -> its embeddings; ``encode_video``: one video -> its
        embeddings (the same vision tower over its frames), None when this encoder takes none;
        ``encode_audio``: one audio file -> its embeddings (an audio checkpoint's encoder);
        ``encode_many``: several images -> their embeddings in one call, for the images of one
        request that it must encode (None: one ``encode`` call per image)."""
        self.store = store
        self.keys = keys
        self.namespace = namespace
        key_space(None, tenant_policy)  # an unknown policy fails at load
        tenant_secret()  # so does a tenant secret file it cannot use (read once per process)
        self.tenant_policy = tenant_policy
        self._encoders: dict[str, EncodeFn] = {"image": encode}
        if encode_video is not None:
            self._encoders["video"] = encode_video
        if encode_audio is not None:
            self._encoders["audio"] = encode_audio
        self._encode_many = encode_many
        self._full_store_wait_s = full_store_wait_s
        # Waiting for another process's encode polls LMDB: off the event loop.
        self._run_blocking = run_blocking or (lambda fn, *args, **kwargs: asyncio.to_thread(fn, *args, **kwargs))

    def key(self, image: bytes, tenant: str | None = None, modality: str = "image") -> str:
        """The store key of ``image`` (or video) for a request of ``tenant``."""
        return self.keys.scoped(image, key_space(tenant, self.tenant_policy), self.namespace, modality)[1]

    async def references(
        self, images: list[bytes], lease_owner: int | None = None, tenant: str | None = None, modality: str = "image"
    ) -> list[EncoderAnswer]:
        """Every item (images, or videos) at once. All or nothing: if one fails, the leases
        taken for the others are released (their owner never sees them) and the first error is
        raised; an error names its item by its index in ``images``. Images this request must
        encode go to ``encode_many`` together, when the encoder has it."""
        if modality == "image" and self._encode_many is not None and len(images) > 1:
            results = await self._coalesced(images, lease_owner, tenant)
        else:
            answers = (
                _named(self.reference(image, lease_owner, tenant, modality), modality, index)
                for index, image in enumerate(images)
            )
            results = await asyncio.gather(*answers, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if not failures:
            return [r for r in results if isinstance(r, EncoderAnswer)]
        for result in results:
            if isinstance(result, EncoderAnswer) and result.reference.lease_id:
                self.store.release(result.reference)
        raise failures[0]

    async def reference(
        self, image: bytes, lease_owner: int | None = None, tenant: str | None = None, modality: str = "image"
    ) -> EncoderAnswer:
        """The stored embedding of ``image`` (or video: ``modality``), encoding it only if no
        one has or is doing so (within ``tenant``'s key space under the ``isolated`` policy)."""
        encode = self._encoders.get(modality)
        if encode is None:
            raise invalid_arg(f"this encoder takes no {modality}")
        public, key = self.keys.scoped(image, key_space(tenant, self.tenant_policy), self.namespace, modality)
        lease = lease_owner is not None
        while True:
            claim = self.store.claim(key, lease=lease, owner_pid=lease_owner)
            if claim.kind is ClaimKind.HIT:
                assert claim.reference is not None  # a HIT always carries one
                return EncoderAnswer(claim.reference, Outcome.HIT, public)
            if claim.kind is ClaimKind.JOIN:
                found = await self._run_blocking(self.store.wait_for, claim, lease=lease, owner_pid=lease_owner)
                if found is not None:
                    return EncoderAnswer(found, Outcome.JOIN, public)
                continue  # the producer vanished or its entry went at once: claim again
            try:
                encoded = await encode(image)
            except BaseException as exc:  # the mark must go whatever happened, or waiters hang
                self.store.abandon(claim, exc)
                raise
            return await self._stored(claim, encoded, public, modality, lease_owner)

    async def _stored(
        self, claim: Claim, encoded: EncodedImage, public: str, modality: str, lease_owner: int | None
    ) -> EncoderAnswer:
        """The PRODUCE ``claim`` fulfilled with ``encoded`` (abandoned if that fails)."""
        try:
            meta = EntryMeta(modality=modality, grid_thw=encoded.grid_thw)  # mm_hash = the key
            reference = await self._fulfil(claim, encoded, meta, lease_owner)
        except BaseException as exc:  # the mark must go whatever happened, or waiters hang
            self.store.abandon(claim, exc)
            raise
        return EncoderAnswer(reference, Outcome.MISS, public)

    async def _coalesced(
        self, images: list[bytes], lease_owner: int | None, tenant: str | None
    ) -> list[EncoderAnswer | BaseException]:
        """Every image of one request claimed at once: HITs answer, JOINs wait (side by side with
        this request's own encode: the same image twice in a request joins itself), and the PRODUCE
        claims go to ``encode_many`` in one call. One result per image, in order."""
        space = key_space(tenant, self.tenant_policy)
        lease = lease_owner is not None
        results: list[EncoderAnswer | BaseException | None] = [None] * len(images)
        joins: list[tuple[int, Awaitable[EncoderAnswer]]] = []
        misses: list[_Miss] = []
        for index, image in enumerate(images):
            try:
                public, key = self.keys.scoped(image, space, self.namespace, "image")
                claim = self.store.claim(key, lease=lease, owner_pid=lease_owner)
            except Exception as exc:
                results[index] = exc
                continue
            if claim.kind is ClaimKind.HIT:
                assert claim.reference is not None  # a HIT always carries one
                results[index] = EncoderAnswer(claim.reference, Outcome.HIT, public)
            elif claim.kind is ClaimKind.JOIN:
                joins.append((index, _named(self._joined(image, claim, public, lease_owner, tenant), "image", index)))
            else:
                misses.append(_Miss(index, image, claim, public))

        async def produce() -> None:
            for miss, answer in zip(misses, await self._produce_many(misses, lease_owner), strict=True):
                results[miss.index] = answer

        joined = await asyncio.gather(produce(), *(wait for _, wait in joins), return_exceptions=True)
        if isinstance(joined[0], BaseException):  # the produce step itself failed (cancelled): every miss
            for miss in misses:
                results[miss.index] = joined[0]
        for (index, _), answer in zip(joins, joined[1:], strict=True):
            results[index] = answer
        missing = EpdError("an image was left without an answer", ErrorCode.INTERNAL)  # a bug here, not input
        return [missing if result is None else result for result in results]

    async def _joined(
        self, image: bytes, claim: Claim, public: str, lease_owner: int | None, tenant: str | None
    ) -> EncoderAnswer:
        """Wait for the production ``claim`` joined; if it vanished, claim the image again."""
        lease = lease_owner is not None
        found = await self._run_blocking(self.store.wait_for, claim, lease=lease, owner_pid=lease_owner)
        if found is not None:
            return EncoderAnswer(found, Outcome.JOIN, public)
        return await self.reference(image, lease_owner, tenant, "image")

    async def _produce_many(self, misses: list[_Miss], lease_owner: int | None) -> list[EncoderAnswer | BaseException]:
        """The PRODUCE claims encoded (together when there are several) and stored; each claim is
        fulfilled or abandoned whatever happens. One result per miss; an error names its image by
        its index in the request."""
        if not misses:
            return []
        settled: set[int] = set()  # misses whose claim is fulfilled or abandoned

        async def store(position: int, miss: _Miss, encoded: EncodedImage | BaseException) -> EncoderAnswer:
            settled.add(position)  # _stored fulfils or abandons from here on
            if isinstance(encoded, BaseException):
                self.store.abandon(miss.claim, encoded)
                raise encoded
            return await self._stored(miss.claim, encoded, miss.public, "image", lease_owner)

        try:
            encoded = await self._encode_together(misses)
            pairs = enumerate(zip(misses, encoded, strict=True))
            stores = (store(position, miss, item) for position, (miss, item) in pairs)
            return list(await asyncio.gather(*stores, return_exceptions=True))
        except BaseException as exc:  # the encode failed or this request was cancelled
            for position, miss in enumerate(misses):
                if position not in settled:
                    self.store.abandon(miss.claim, exc)
            if isinstance(exc, Exception):
                return [exc] * len(misses)
            raise

    async def _encode_together(self, misses: list[_Miss]) -> list[EncodedImage | BaseException]:
        """The misses' embeddings: one ``encode_many`` call, or (one miss, or that call refused
        the input) one ``encode`` call per image, whose errors name ``image[index]``."""
        if len(misses) > 1 and self._encode_many is not None:
            try:
                encoded = list(await self._encode_many([miss.image for miss in misses]))
            except EpdError as exc:
                if exc.code is not ErrorCode.INVALID_ARG:
                    raise
            else:
                if len(encoded) != len(misses):
                    raise EpdError(f"encode answered {len(encoded)} images for {len(misses)}", ErrorCode.INTERNAL)
                return list(encoded)
        alone = (_named(self._encoders["image"](miss.image), "image", miss.index) for miss in misses)
        return list(await asyncio.gather(*alone, return_exceptions=True))

    async def _fulfil(self, claim: Any, encoded: EncodedImage, meta: EntryMeta, lease_owner: int | None) -> Reference:
        """Store the embedding; when leases of running requests fill the store, wait (bounded)
        for them to end instead of failing this request at once."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(StoreFullError),
            wait=wait_exponential(multiplier=0.01, max=0.5),
            stop=stop_after_delay(self._full_store_wait_s),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return self.store.fulfil(
                    claim, encoded.embeds, meta, lease=lease_owner is not None, owner_pid=lease_owner
                )
        raise AssertionError("unreachable: tenacity re-raises the last error")


async def _named(answer: Awaitable[T], modality: str, index: int) -> T:
    """``answer``, with an error about item 0 (the video preprocessing sees one video at a
    time) renamed to the item's index in the request."""
    try:
        return await answer
    except EpdError as exc:
        raise item_renamed(exc, modality, index) from None
