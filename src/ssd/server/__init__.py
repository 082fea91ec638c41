"""OpenAI-compatible HTTP server: `ssd serve` (see the README section "Serving: OpenAI-compatible HTTP server").

    from ssd.server import build_app, BackgroundServer
"""
__all__ = ["AsyncEngine", "BackgroundServer", "build_app"]


def __getattr__(name):  # fastapi/uvicorn load only when the server is used
    if name in ("build_app", "BackgroundServer"):
        from ssd.server import app
        return getattr(app, name)
    if name == "AsyncEngine":
        from ssd.server.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
