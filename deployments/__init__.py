"""coldstart's serving side: the Ray Serve deployment, its engine and model."""

import time as _time

IMPORTED_AT = _time.time()
"""When this process first imported the project (a Unix time): in a replica, when Ray
unpickled the deployment's class, or earlier, when Ray's worker called the setup hook
(``deployments.startup.early``). ``GET /stats`` reports it, so that a start's time
before the constructor splits into Ray's own part and the project's module imports."""
