"""Images of vision-language rows: where they come from, how many a row has, decoding.

A row holds its images under ``--image_key`` (OpenRLHF's layout): one reference or a list, each
a local path, a base64 string, a ``data:image/...;base64,`` URI, raw bytes, or an http(s) URL.
The chat prompt marks where each image goes with a ``{"type": "image"}`` content item, and the
two counts must agree (:func:`image_problem`, one line naming the row otherwise).

URLs are fetched only where the network answers: the first URL's host is resolved and
connected to once (a few seconds at most, :func:`network_reaches`), and without an answer the
run stops at once, naming the row, instead of failing on every image later.

Before anything loads, every image's header is read (:func:`header_problem`: a file's first
bytes, the first ``URL_HEAD_BYTES`` of a URL): a file PIL cannot identify (random bytes saved
as .png) or a URL that answers an error (404) is named with its row then, not when a step
draws it.

Everything here runs before the process group exists (``prepare``) or per step on one rank's
prompts; PIL is imported where used.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import socket
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

URL_PREFIXES = ("http://", "https://")
_BASE64 = re.compile(r"[A-Za-z0-9+/\r\n]+={0,2}")
# first bytes of PNG, JPEG, GIF, WebP (RIFF), BMP, TIFF files: how base64 text is told apart
# from a path (both can be made of the same characters)
_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")
NETWORK_TIMEOUT_S = 3.0
FETCH_TIMEOUT_S = 30.0
URL_HEAD_BYTES = 1 << 20  # read of a URL image in the row check: PIL identifies it from the head


class ImageError(ValueError):
    """An image reference that cannot be used; the message names what is wrong."""


def image_refs(value: Any) -> list[Any]:
    """The references of one row's image column: None -> [], one reference -> [it]."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return [v for v in value if v is not None]
    return [value]


def count_image_items(prompt: Any) -> int:
    """``{"type": "image"}`` items in a chat prompt (0 for plain text)."""
    if not isinstance(prompt, list):
        return 0
    n = 0
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            n += sum(1 for c in content if isinstance(c, dict) and c.get("type") == "image")
    return n


def _kind(ref: Any) -> str:
    if isinstance(ref, bytes | bytearray):
        return "bytes"
    if isinstance(ref, dict) and "bytes" in ref:  # a datasets Image feature
        return "bytes"
    if hasattr(ref, "convert") and hasattr(ref, "size"):
        return "pil"
    if not isinstance(ref, str):
        return "unknown"
    if ref.startswith(URL_PREFIXES):
        return "url"
    if ref.startswith("data:"):
        return "data_uri"
    if _looks_base64(ref):
        return "base64"
    return "path"


def _looks_base64(text: str) -> bool:
    """Base64 whose decoded head is an image file's."""
    head = text[:64]
    if len(text) < 16 or not _BASE64.fullmatch(head):
        return False
    try:
        raw = base64.b64decode(head[: len(head) // 4 * 4], validate=False)
    except (binascii.Error, ValueError):
        return False
    return raw.startswith(_MAGIC)


@cache
def network_reaches(host: str, port: int) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``NETWORK_TIMEOUT_S`` (name
    resolution included). Asked once per host and process."""
    try:
        with socket.create_connection((host, port), timeout=NETWORK_TIMEOUT_S):
            return True
    except OSError:
        return False


def ref_problem(ref: Any) -> str | None:
    """Why one image reference cannot be read (its header is read; the pixels are not)."""
    kind = _kind(ref)
    if kind == "unknown":
        return (
            "an image reference must be a path, base64 string, data URI, bytes or URL, got "
            + type(ref).__name__
        )
    if kind == "path" and not Path(ref).is_file():
        return f"image {ref!r}: no such file"
    if kind == "url":
        parsed = urlparse(ref)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        if not parsed.hostname or not network_reaches(parsed.hostname, port):
            return (
                f"image URL {ref}: {parsed.hostname} cannot be reached from here (no network: "
                "a connection to it failed within "
                f"{NETWORK_TIMEOUT_S:g} s); download the images and give local paths"
            )
    if kind == "data_uri" and ";base64," not in ref[:100]:
        return "a data URI image must be base64 encoded (data:image/...;base64,...)"
    return header_problem(ref)


def header_problem(ref: Any) -> str | None:
    """Why PIL cannot identify an image from its header (the pixels are not decoded), or
    None. A URL's first ``URL_HEAD_BYTES`` are fetched; an HTTP error is named with its code."""
    from urllib.error import HTTPError, URLError

    from PIL import Image, UnidentifiedImageError

    kind = _kind(ref)
    try:
        if kind == "pil":
            return None
        if kind == "path":
            source = ref
        elif kind == "url":
            source = io.BytesIO(_fetch(ref, URL_HEAD_BYTES, NETWORK_TIMEOUT_S * 10))
        elif kind == "bytes":
            source = io.BytesIO(ref["bytes"] if isinstance(ref, dict) else bytes(ref))
        else:
            payload = ref.split(",", 1)[1] if kind == "data_uri" else ref
            source = io.BytesIO(base64.b64decode(payload, validate=False))
        with Image.open(source) as im:
            im.size  # noqa: B018 - the header is parsed on open; size proves it was read
    except HTTPError as e:
        return f"image URL {ref}: the server answered {e.code} {e.reason}"
    except (URLError, TimeoutError) as e:
        return f"image URL {ref}: cannot be fetched ({getattr(e, 'reason', e)})"
    except (UnidentifiedImageError, OSError, binascii.Error, ValueError) as e:
        what = "image file" if kind == "path" else "image"
        return f"{what} {_short(ref)} is not an image PIL can read ({e})"
    return None


def image_problem(
    prompt: Any, images: Any, image_key: str, max_images: int, *, text_only: bool = False
) -> str | None:
    """Why a row's images do not fit its prompt, or None.

    Args:
        prompt: the row's prompt (chat messages with ``{"type": "image"}`` items, or text).
        images: the row's ``image_key`` value.
        max_images: most images a row may have (0: no limit).
        text_only: the model takes no images: any image is a problem.
    """
    refs = image_refs(images)
    placeholders = count_image_items(prompt)
    if text_only and (refs or placeholders):
        return (
            f"the row has images ({placeholders} {{'type': 'image'}} items, {len(refs)} under "
            f"--image_key {image_key!r}) but the model is text-only (no vision_config)"
        )
    if placeholders != len(refs):
        return (
            f"the prompt has {placeholders} image placeholder(s) ({{'type': 'image'}} items) "
            f"but --image_key {image_key!r} holds {len(refs)} image(s)"
        )
    if max_images and len(refs) > max_images:
        return f"{len(refs)} images, more than --max_images_per_prompt {max_images}"
    for ref in refs:
        problem = ref_problem(ref)
        if problem:
            return problem
    return None


def load_image(ref: Any):
    """One reference -> an RGB PIL image (raises :class:`ImageError` naming the problem)."""
    from PIL import Image, UnidentifiedImageError

    kind = _kind(ref)
    try:
        if kind == "pil":
            image = ref
        elif kind == "bytes":
            raw = ref["bytes"] if isinstance(ref, dict) else bytes(ref)
            image = Image.open(io.BytesIO(raw))
        elif kind in ("base64", "data_uri"):
            payload = ref.split(",", 1)[1] if kind == "data_uri" else ref
            image = Image.open(io.BytesIO(base64.b64decode(payload, validate=False)))
        elif kind == "url":
            image = Image.open(io.BytesIO(_fetch(ref)))
        elif kind == "path":
            image = Image.open(ref)
        else:
            raise ImageError(f"unsupported image reference of type {type(ref).__name__}")
        return image.convert("RGB")
    except (OSError, UnidentifiedImageError, binascii.Error) as e:
        raise ImageError(f"image {_short(ref)}: cannot be decoded ({e})") from e


def ref_string(ref: Any) -> str:
    """A reference as a string (what a tokenized dataset column holds): paths, base64 and
    URIs as they are; bytes and PIL images as PNG data URIs."""
    if isinstance(ref, str):
        return ref
    image = load_image(ref)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def load_images(refs: Sequence[Any]) -> list:
    return [load_image(r) for r in refs]


def image_size(ref: Any) -> tuple[int, int]:
    """(height, width) of an image, reading only what its header needs where possible."""
    from PIL import Image, UnidentifiedImageError

    if _kind(ref) == "path":
        try:
            with Image.open(ref) as im:
                return im.height, im.width
        except (UnidentifiedImageError, OSError) as e:
            raise ImageError(f"image {_short(ref)}: cannot be read ({e})") from e
    im = load_image(ref)
    return im.height, im.width


def _fetch(url: str, limit: int = -1, timeout: float = FETCH_TIMEOUT_S) -> bytes:
    """The body of ``url`` (its first ``limit`` bytes, asked for with a Range header)."""
    from urllib.request import Request, urlopen

    headers = {"Range": f"bytes=0-{limit - 1}"} if limit > 0 else {}
    with urlopen(Request(url, headers=headers), timeout=timeout) as response:  # noqa: S310
        return response.read(limit)


def _short(ref: Any) -> str:
    """How a message names an image: a path in full (the user must find the file), inline
    bytes by type, a long URL or base64 payload cut."""
    if isinstance(ref, str) and _kind(ref) == "path":
        return repr(ref)
    text = ref if isinstance(ref, str) else type(ref).__name__
    return repr(text if len(text) <= 80 else text[:60] + "...")
