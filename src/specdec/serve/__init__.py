"""The OpenAI-compatible server: app.py (routes), protocol.py (requests, responses, errors),
middleware.py (the API key, the body limit), async_engine.py (the engine stepped in a thread,
async streams per request), prom.py (Prometheus metrics), server.py (uvicorn's server, with a
shutdown that tells the requests it stops), commands.py (`specdec serve`)."""
