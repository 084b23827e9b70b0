"""The collector's REST API: shared pieces and one module of routes per area.

``app.build_app`` builds the API port's application. Shared: ``common`` (errors, JSON answers, query parsers,
the application's keys, ``run_blocking``), ``auth`` (the bearer token), ``openapi`` (schema builders and the
merge of the routes' fragments). Routes: ``core``, ``analysis``, ``alerts``, ``jaeger``, ``profiles``; the web
pages' are ``spikehound.collector.web.routes``; the JSON of spans and spikes is ``spikehound.model_json``.
"""

# What the rest of the collector uses: the daemon serves ``app``; the receivers and the web pages share
# ``auth`` (the token check) and ``common``.
__all__ = ["app", "auth", "common"]
