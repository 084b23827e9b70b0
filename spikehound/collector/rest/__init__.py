"""The collector's REST API: shared pieces, serializers and one module of routes per area.

``app.build_app`` builds the API port's application. Shared: ``common`` (errors, JSON answers, query parsers,
the application's keys, ``run_blocking``), ``auth`` (the bearer token), ``openapi`` (schema builders and the
merge of the routes' fragments), ``serialize`` (JSON forms of spans and spikes, without aiohttp). Routes:
``core``, ``analysis``, ``alerts``, ``jaeger``; the web pages' are ``spikehound.collector.web.routes``.
"""
