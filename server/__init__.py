"""kvserve HTTP server: OpenAI-compatible API, metrics, CLI (see server/app.py, server/cli.py)."""
