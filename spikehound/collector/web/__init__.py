"""The web pages an SRE opens from an alert, served by the collector on its API port under ``/ui/``.

``routes.add_routes`` wires them into the API's aiohttp application; ``links``
builds their URLs (the CLI and alerts link to them). Pages are rendered on the
server with Jinja2 (every value escaped); ``static/`` holds the small script
that draws the charts with the vendored uPlot, and the style sheet.
"""

__all__ = ["links", "routes"]
