"""``fetch_image_bytes``: data: URLs (good, wrong media type, not base64, too large), file://
URLs (inside the allowed directory; outside it, through a symlink or ``..``, a directory, none
allowed), http(s) (refused by default and for another host; an allowed host served by a real
``http.server`` on 127.0.0.1 works, a body over the byte limit is a 413, a redirect to another
host is refused) and references of no known kind."""

from __future__ import annotations

import base64
import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from engine.vision.images import ImageLimits
from server.media.errors import MediaError
from server.media.limits import MediaSettings
from server.media.sources import fetch_image_bytes
from tests.server.media.pngs import data_url, png

PNG = png()


def _refused(ref: str, settings: MediaSettings, status: int = 400, contains: str = ""
             ) -> MediaError:
    with pytest.raises(MediaError) as info:
        fetch_image_bytes(ref, settings)
    assert info.value.status == status, info.value
    assert contains in info.value.message
    assert info.value.field is None  # the caller names the field
    return info.value


def test_a_data_url_gives_its_bytes():
    assert fetch_image_bytes(data_url(PNG), MediaSettings()) == PNG
    spaced = "data:image/png;base64," + " \n".join(base64.b64encode(PNG).decode())
    assert fetch_image_bytes(spaced, MediaSettings()) == PNG


@pytest.mark.parametrize("ref,contains", [
    ("data:text/plain;base64,aGVsbG8=", "image type"),
    ("data:;base64,aGVsbG8=", "image type"),
    ("data:image/png,rawbytes", "base64"),
    ("data:image/png;base64,@@@notbase64", "not valid base64"),
    ("data:image/png;base64,abc", "not valid base64"),  # bad padding
    ("data:image/png;base64,", "no data"),
    ("data:image/png;base64", "comma"),
])
def test_bad_data_urls_are_refused(ref, contains):
    _refused(ref, MediaSettings(), 400, contains)


def test_a_data_url_over_the_byte_limit_is_413():
    small = MediaSettings(image_limits=ImageLimits(max_bytes=100))
    _refused(data_url(b"x" * 1000), small, 413, "over the limit of 100")


@pytest.fixture
def media_dirs(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (allowed / "sub" / "a.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "dirlink").symlink_to(outside)
    return allowed, outside, MediaSettings(allowed_local_media_path=(str(allowed),))


def test_a_file_under_the_allowed_directory_is_read(media_dirs):
    allowed, _, settings = media_dirs
    assert fetch_image_bytes(f"file://{allowed}/sub/a.png", settings) == PNG
    assert fetch_image_bytes(f"file://localhost{allowed}/sub/../sub/a.png", settings) == PNG


def test_files_outside_the_allowed_directory_are_refused(media_dirs):
    allowed, outside, settings = media_dirs
    for ref in (f"file://{outside}/secret.png",  # outside
                f"file://{allowed}/link.png",  # a symlink out
                f"file://{allowed}/dirlink/secret.png",  # a directory symlink out
                f"file://{allowed}/../outside/secret.png",  # ..
                f"file://{allowed}/%2e%2e/outside/secret.png",  # .. percent-encoded
                f"file://{allowed}/sub",  # a directory
                f"file://{allowed}/missing.png",  # no such file: the same answer
                "file:///etc/passwd", "file://otherhost/etc/passwd", "file:relative.png"):
        _refused(ref, settings, 400, "--allowed-local-media-path")


def test_file_urls_are_refused_without_an_allowed_directory(media_dirs):
    allowed, _, _ = media_dirs
    _refused(f"file://{allowed}/sub/a.png", MediaSettings(), 400,
             "started without --allowed-local-media-path")


def test_a_file_over_the_byte_limit_is_413(media_dirs):
    allowed, _, _ = media_dirs
    small = MediaSettings(allowed_local_media_path=(str(allowed),),
                          image_limits=ImageLimits(max_bytes=10))
    _refused(f"file://{allowed}/sub/a.png", small, 413)


_CHUNK_SENT = 70 * 1024  # more than one read of the fetcher's, so every read returns at once


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/img.png":
            body = PNG
        elif self.path == "/big.png":
            body = b"x" * 5000
        elif self.path == "/away":
            self.send_response(302)
            self.send_header("Location", "http://localhost:1/img.png")
            self.end_headers()
            return
        elif self.path == "/drip.png":  # a byte every 50 ms, each read well within timeout
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x" * _CHUNK_SENT)
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:  # the client gave up: what the test wants
                pass
            return
        elif self.path == "/here":
            self.send_response(302)
            self.send_header("Location", "/img.png")
            self.end_headers()
            return
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path != "/big.png":  # the big one streams with no length: read until cut
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_urls_are_refused_by_default(image_server):
    _refused(f"{image_server}/img.png", MediaSettings(), 400, "no domain is allowed")
    _refused(f"{image_server}/img.png", MediaSettings(allowed_media_domains=("example.com",)),
             400, "'127.0.0.1' is not one of them")


def test_an_allowed_host_is_fetched(image_server):
    allowed = MediaSettings(allowed_media_domains=("127.0.0.1",), fetch_timeout=5)
    assert fetch_image_bytes(f"{image_server}/img.png", allowed) == PNG
    assert fetch_image_bytes(f"{image_server}/here", allowed) == PNG  # same-host redirect
    _refused(f"{image_server}/away", allowed, 400, "another host")
    _refused(f"{image_server}/nothing.png", allowed, 400, "HTTP 404")


def test_a_fetched_body_over_the_byte_limit_is_413(image_server):
    small = MediaSettings(allowed_media_domains=("127.0.0.1",),
                          image_limits=ImageLimits(max_bytes=1000), fetch_timeout=5)
    _refused(f"{image_server}/big.png", small, 413, "over the limit of 1000")
    _refused(f"{image_server}/img.png", MediaSettings(
        allowed_media_domains=("127.0.0.1",), image_limits=ImageLimits(max_bytes=10)), 413)


@pytest.mark.parametrize("ref", ["x", "ftp://h/a.png", "javascript:alert(1)", "", "/etc/x"])
def test_other_references_are_refused(ref):
    _refused(ref, MediaSettings(), 400)


def test_a_dripping_server_is_cut_off_by_the_whole_fetchs_deadline(image_server):
    """Each read returns within the timeout; the fetch as a whole may not outlast it."""
    settings = MediaSettings(allowed_media_domains=("127.0.0.1",), fetch_timeout=0.5,
                             image_limits=ImageLimits(max_bytes=20 * 1024 * 1024))
    start = time.monotonic()
    _refused(f"{image_server}/drip.png", settings, 400, "took over 0.5 s")
    assert time.monotonic() - start < 3
