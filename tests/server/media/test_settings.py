"""The image options: ``MediaSettings`` validation, and ``--allowed-local-media-path``,
``--allowed-media-domains`` and ``--limit-mm-per-prompt`` from flags and config files to the
settings the app holds (``ServerSettings.media_settings()``)."""

from __future__ import annotations

import pytest

from server.config_file import as_yaml_dict, resolve
from server.media.limits import DEFAULT_MAX_IMAGES, MediaSettings, parse_limit_mm


def test_defaults_allow_no_file_and_no_host():
    s = MediaSettings()
    assert s.allowed_local_media_path == () and s.allowed_media_domains == ()
    assert s.max_images_per_request == DEFAULT_MAX_IMAGES


def test_values_are_normalised(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    s = MediaSettings(allowed_local_media_path=(str(tmp_path / "link"),),
                      allowed_media_domains=("Images.Example.COM.",))
    assert s.allowed_local_media_path == (str((tmp_path / "real").resolve()),)
    assert s.allowed_media_domains == ("images.example.com",)


@pytest.mark.parametrize("kwargs,contains", [
    ({"allowed_local_media_path": ("relative/dir",)}, "absolute"),
    ({"allowed_local_media_path": ("/no/such/dir/here",)}, "not an existing directory"),
    ({"allowed_media_domains": ("https://example.com",)}, "host names"),
    ({"allowed_media_domains": ("example.com/x",)}, "host names"),
    ({"max_images_per_request": -1}, ">= 0"),
    ({"max_images_per_request": True}, ">= 0"),
    ({"fetch_timeout": 0}, "positive"),
])
def test_bad_settings_are_refused(kwargs, contains):
    with pytest.raises(ValueError, match=contains):
        MediaSettings(**kwargs)


@pytest.mark.parametrize("value,expected", [
    (None, DEFAULT_MAX_IMAGES), ('{"image": 2}', 2), ({"image": 0}, 0), ("{}", 4)])
def test_limit_mm_per_prompt(value, expected):
    assert parse_limit_mm(value) == expected


@pytest.mark.parametrize("value,contains", [
    ("{image: 2", "not valid JSON"), ("[2]", "JSON object"), ('{"video": 1}', "video"),
    ('{"image": -2}', ">= 0"), ('{"image": "4"}', ">= 0")])
def test_bad_limit_mm_per_prompt(value, contains):
    with pytest.raises(ValueError, match=contains):
        parse_limit_mm(value)


def test_the_options_reach_the_media_settings(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"allowed-local-media-path: {tmp_path}\nallowed-media-domains: [a.org]\n"
                   "limit-mm-per-prompt: {image: 3}\n")
    _, server = resolve({"allowed_media_domains": ["b.org", "c.org"]}, cfg)
    media = server.media_settings()
    assert media.allowed_local_media_path == (str(tmp_path.resolve()),)
    assert media.allowed_media_domains == ("b.org", "c.org")  # the flag over the file
    assert media.max_images_per_request == 3
    dumped = as_yaml_dict(*resolve({}, cfg))
    assert dumped["limit-mm-per-prompt"] == {"image": 3}
    assert dumped["allowed-media-domains"] == ["a.org"]
    with pytest.raises(ValueError, match="limit-mm-per-prompt"):
        resolve({"limit_mm_per_prompt": '{"audio": 1}'})
    with pytest.raises(ValueError, match="allowed-local-media-path"):
        resolve({"allowed_local_media_path": ["/no/such/dir/here"]})
