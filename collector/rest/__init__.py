"""The collector's REST API: shared pieces, serializers and one module of routes per area."""
