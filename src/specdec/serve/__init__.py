"""The OpenAI-compatible server: app.py (routes), protocol.py (requests, responses, errors),
async_engine.py (the engine stepped in a thread, async streams per request), prom.py (Prometheus
metrics), commands.py (`specdec serve`)."""
