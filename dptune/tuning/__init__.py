"""Orchestration of a search (the only Ray importers). See ARCHITECTURE.md."""

import os as _os

# Ray token authentication, on before Ray is first imported (Ray reads the mode into its cached config at
# import; Ray 2.60 would otherwise turn it on for a local ray.init with a raw warning, and a joined
# cluster needs it). An explicit RAY_AUTH_MODE of the curator's is respected.
_os.environ.setdefault("RAY_AUTH_MODE", "token")

import logging as _logging

# In a Jupyter kernel Ray logs, as it is imported, "Missing packages: ['ipywidgets'] ... for rich notebook output"
# (for its widgets' HTML): a search displays no Ray widget (its tables would name trials), so the line tells
# the user nothing. That message only, on that logger; installed before Ray is first imported.
_logging.getLogger("ray.widgets.util").addFilter(
    lambda record: not record.getMessage().startswith("Missing packages: ['ipywidgets']"))
