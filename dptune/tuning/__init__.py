"""Orchestration of a search (the only Ray importers). See ARCHITECTURE.md."""

import os as _os

# Ray token authentication, on before Ray is first imported (Ray reads the mode into its cached config at
# import; Ray 2.60 would otherwise turn it on for a local ray.init with a raw warning, and a joined
# cluster needs it). An explicit RAY_AUTH_MODE of the curator's is respected.
_os.environ.setdefault("RAY_AUTH_MODE", "token")
