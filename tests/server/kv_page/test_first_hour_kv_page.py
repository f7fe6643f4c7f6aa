"""Issue 66, item 6: ``/kv`` reads well before its stream and explains its terms.

Its first paint comes from one ``GET /kv/state`` (before it, the page shows one "reading" line,
no zeros and no sentence with holes such as "max_model_len ( tokens) holds ;"); the running
requests and the hit rate come above the block grid; each term has a line saying what it means.
Checked in headless Chromium (tests/server/cdp.py) on a tiny model in-process, with the event
stream blocked (so the text read is the first paint's), then with it.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.config.engine import EngineConfig
from engine.loading.tiny import make_tiny_model_dir
from server.app import build_app
from server.config_file import ServerSettings
from tests.server.cdp import Browser, find_chromium
from tests.server.helpers import ServerThread

KEY = "kv-key"
ORDER_JS = """[...document.querySelectorAll('main > section')].map(s => s.id)"""
TEXT_JS = "document.body.innerText"


@pytest.fixture(scope="module")
def kv_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kvpage-first-hour")
    model = make_tiny_model_dir(tmp / "tiny", max_position_embeddings=256)
    config = EngineConfig(model=str(model), served_model_name="tiny", dtype="float32",
                          block_size=4, kv_cache_memory="1MiB", enable_prefix_caching=True)
    engine = AsyncEngine(config)
    with ServerThread(build_app(engine, ServerSettings(api_key=KEY))) as srv:
        yield srv


def test_the_page_before_any_script_shows_no_numbers(kv_server):
    html = httpx.get(f"{kv_server.url}/kv?key={KEY}", timeout=30).text
    assert '<main id="main" hidden>' in html and "Reading the KV cache" in html
    assert "§" not in html


def test_first_paint_from_state_then_live(kv_server):
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    for _ in range(2):  # the second finds the first's prompt cached: a hit rate above 0
        r = httpx.post(f"{kv_server.url}/v1/completions", timeout=120,
                       headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny", "prompt": "hello hello hello hello hello",
                             "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    asyncio.run(_drive(binary, kv_server.url))


async def _drive(binary: str, url: str) -> None:
    state = httpx.get(f"{url}/kv/state", headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30).json()
    async with Browser(binary) as page:
        await page.send("Network.enable")
        await page.send("Network.setBlockedURLs", urls=["*kv/events*"])
        await page.goto(f"{url}/kv?key={KEY}")
        assert await page.wait_for("document.body.dataset.painted", 60) == "state"
        text = await page.eval(TEXT_JS)
        # No hole where a number goes, no unexplained reference.
        assert not re.search(r"\(\s*tokens\)|holds\s*;|\(\s*\)|§", text), text
        max_len = state["arithmetic"]["max_model_len"]
        assert f"a sequence at max_model_len ({max_len} tokens) holds " in text
        assert "Reading the KV cache" not in text
        assert f"live tokens {state['arithmetic']['live_tokens']} in" in text
        assert "(–)" not in text
        assert "No request is running." in text
        hits = state["prefix_cache"]["hits_tokens"]
        assert f"of {state['prefix_cache']['queries_tokens']} prompt tokens" in text
        assert hits > 0 and re.search(r"hit rate \d+\.\d%", text), text
        # Requests and the hit rate above the grid; every term explained.
        order = await page.eval(ORDER_JS)
        assert order.index("requests-section") < order.index("grid-section")
        assert order.index("prefix-section") < order.index("grid-section")
        for term in ("holding a hash:", "cached, evictable:", "free:", "in use:", "block:",
                     "evictions:", "the hit rate is", "tiers:"):
            assert term in text, term

        # The stream let through: the page goes live and keeps its numbers.
        await page.send("Network.setBlockedURLs", urls=[])
        await page.goto(f"{url}/kv?key={KEY}&interval=0.2")
        await page.wait_for("Number(document.body.dataset.seqNo) > 0", 60)
        await page.wait_for("document.getElementById('conn').textContent === 'live'", 30)
        text = await page.eval(TEXT_JS)
        assert f"a sequence at max_model_len ({max_len} tokens) holds " in text
