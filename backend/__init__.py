"""The inference backend: an OpenAI- and Anthropic-compatible server over a batch-1 speculative decoding engine.

Imports nothing on purpose (no torch here), so `import backend.<module>` costs only what that module needs. See
README.md in this folder; the entry point is `backend.server.app.serve`.
"""
