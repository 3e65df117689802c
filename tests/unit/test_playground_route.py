"""The playground's files are served by the gateway itself, with no credential, and the page
may talk only to the gateway that served it."""

from __future__ import annotations

from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import gateway_app


async def test_the_page_and_its_script_are_served_without_a_key(aiohttp_client):
    adapter = ScriptedAdapter("scripted", text_script(["Hi"]))
    client = await aiohttp_client(gateway_app(adapters=[adapter]))
    page = await client.get("/playground")
    assert page.status == 200
    assert page.content_type == "text/html"
    assert page.headers["Content-Security-Policy"] == "default-src 'self'"
    html = await page.text()
    for asset in ("playground/playground.js", "playground/playground.css"):
        assert asset in html
        served = await client.get(f"/{asset}")
        assert served.status == 200, asset
    script = await (await client.get("/playground/playground.js")).text()
    assert "x-follow-token" in script and "sessionStorage" in script
    assert (await client.get("/playground/../app.py")).status == 404  # nothing outside it
