"""The OpenAI-compatible HTTP server: `kvprefix serve`. See docs/server.md."""
