"""``fetch_image_bytes(ref, settings)``: the encoded bytes an image reference points at.

Three kinds of reference, anything else refused:

* ``data:<image/...>;base64,<data>``: the media type must be an ``image/`` type and the data
  well-formed base64 (whitespace ignored); more than ``image_limits.max_bytes`` once decoded is
  refused (413) before decoding.
* ``file:///path``: read only when the path, with symlinks and ``..`` resolved, is a regular
  file under one of ``allowed_local_media_path``; a file outside, a missing one and a
  directory get the same answer, so a client learns nothing about the rest of the disk. No
  directory allowed: every ``file://`` URL is refused.
* ``http://`` and ``https://``: fetched only when the host is one of
  ``allowed_media_domains`` (none by default: every such URL refused), directly (no proxy
  from the environment), within ``fetch_timeout`` seconds in all (a server that drips its
  answer is cut off too), reading at most
  ``image_limits.max_bytes`` (more: 413); a redirect is followed only to the same host,
  at most ``MAX_REDIRECTS`` times; any answer but 200 is refused.

Every refusal is a ``MediaError`` (400, or 413 over a size limit) whose message says what is
wrong; the caller adds the field. The bytes are not checked to be an image here
(``engine.vision.images.decode_image`` does that).
"""

from __future__ import annotations

import base64
import binascii
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from server.media.errors import MediaError
from server.media.limits import MediaSettings

MAX_REDIRECTS = 3
_CHUNK = 64 * 1024
_SHOWN = 80  # characters of a reference quoted in a message
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),", re.DOTALL)
_KINDS = ("a data: URL (data:image/png;base64,...), a file:// URL or an http(s):// URL")


def fetch_image_bytes(ref: str, settings: MediaSettings) -> bytes:
    """The bytes ``ref`` points at (see the module's docstring), or ``MediaError``."""
    if not isinstance(ref, str) or not ref:
        raise MediaError(400, f"an image reference must be a non-empty string: {_KINDS}")
    scheme = ref.split(":", 1)[0].lower() if ":" in ref else ""
    if scheme == "data":
        return _data_url(ref, settings.image_limits.max_bytes)
    if scheme == "file":
        return _local_file(ref, settings)
    if scheme in ("http", "https"):
        return _http(ref, settings)
    raise MediaError(400, f"{_shown(ref)} is not {_KINDS}")


def _shown(ref: str) -> str:
    return repr(ref if len(ref) <= _SHOWN else ref[:_SHOWN] + "...")


def _data_url(ref: str, max_bytes: int) -> bytes:
    m = _DATA_URL.match(ref)
    if m is None:
        raise MediaError(400, "a data: URL needs a comma before its data "
                              "(data:image/png;base64,...)")
    media_type = m.group("type").strip().lower()
    if not media_type.startswith("image/"):
        raise MediaError(400, f"a data: URL's media type must be an image type (image/png, "
                              f"image/jpeg, ...); got {media_type or 'none'!r}")
    params = [p.strip().lower() for p in m.group("params").split(";") if p.strip()]
    if "base64" not in params:
        raise MediaError(400, "a data: URL must be base64-encoded "
                              "(data:image/png;base64,...)")
    payload = re.sub(r"\s+", "", ref[m.end():])
    if not payload:
        raise MediaError(400, "the data: URL holds no data")
    if len(payload) // 4 * 3 > max_bytes + 2:  # the decoded size, known before decoding
        raise MediaError(413, f"the data: URL holds about {len(payload) // 4 * 3} bytes, over "
                              f"the limit of {max_bytes}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(400, f"the data: URL's data is not valid base64 ({exc})") from None
    if len(data) > max_bytes:
        raise MediaError(413, f"the image is {len(data)} bytes, over the limit of {max_bytes}")
    return data


def _local_file(ref: str, settings: MediaSettings) -> bytes:
    allowed = settings.allowed_local_media_path
    if not allowed:
        raise MediaError(400, "file:// URLs are refused: the server was started without "
                              "--allowed-local-media-path")
    parsed = urllib.parse.urlsplit(ref)
    refused = MediaError(400, f"{_shown(ref)} is not a readable file under the directories "
                              f"of --allowed-local-media-path")
    if parsed.netloc not in ("", "localhost") or parsed.query or parsed.fragment:
        raise refused
    raw = urllib.parse.unquote(parsed.path)
    if not raw.startswith("/") or "\0" in raw:
        raise refused
    try:
        path = Path(raw).resolve(strict=True)  # symlinks and ".." resolved
    except (OSError, RuntimeError):
        raise refused from None
    if not any(path.is_relative_to(d) for d in allowed) or not path.is_file():
        raise refused
    max_bytes = settings.image_limits.max_bytes
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError:
        raise refused from None
    if len(data) > max_bytes:
        raise MediaError(413, f"the file is over the limit of {max_bytes} bytes")
    return data


class _SameHostRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to the host it started from, at most MAX_REDIRECTS times."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, host: str) -> None:
        self.host = host

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        target = urllib.parse.urlsplit(newurl)
        if target.scheme not in ("http", "https") or (target.hostname or "").lower() != \
                self.host:
            raise MediaError(400, f"the image URL redirects to another host "
                                  f"({_shown(newurl)}); redirects are followed only to the "
                                  f"same host")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _http(ref: str, settings: MediaSettings) -> bytes:
    try:
        parsed = urllib.parse.urlsplit(ref)
        host = (parsed.hostname or "").lower().rstrip(".")
        parsed.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise MediaError(400, f"{_shown(ref)} is not a well-formed URL") from None
    if not host:
        raise MediaError(400, f"{_shown(ref)} names no host")
    if host not in settings.allowed_media_domains:
        why = ("no domain is allowed" if not settings.allowed_media_domains else
               f"{host!r} is not one of them")
        raise MediaError(400, f"http(s) image URLs are fetched only from the hosts of "
                              f"--allowed-media-domains ({why}); send the image as a data: "
                              f"URL instead")
    max_bytes = settings.image_limits.max_bytes
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         _SameHostRedirects(host))
    request = urllib.request.Request(ref, headers={"User-Agent": "kvserve",
                                                   "Accept": "image/*"})
    try:
        with opener.open(request, timeout=settings.fetch_timeout) as response:
            if response.status != 200:
                raise MediaError(400, f"fetching the image answered HTTP {response.status}")
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise MediaError(413, f"the image is {int(length)} bytes, over the limit of "
                                      f"{max_bytes}")
            chunks, size = [], 0
            deadline = time.monotonic() + settings.fetch_timeout  # in all, not per read
            while chunk := response.read(_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise MediaError(413, f"the image is over the limit of {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise MediaError(400, f"fetching the image took over "
                                          f"{settings.fetch_timeout:g} s")
                chunks.append(chunk)
    except MediaError:
        raise
    except urllib.error.HTTPError as exc:
        raise MediaError(400, f"fetching the image answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise MediaError(400, f"the image could not be fetched from {host!r}: {reason}") \
            from None
    return b"".join(chunks)
