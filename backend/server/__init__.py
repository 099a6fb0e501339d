"""The HTTP server: OpenAI and Anthropic APIs over the engine (see README.md in this folder).

    from backend.server import serve, create_app
"""

from backend.server.app import create_app, serve

__all__ = ["create_app", "serve"]
