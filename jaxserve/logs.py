"""How jaxserve's processes log: jaxserve's own records at the level asked for, other libraries' at WARNING and
above (jax's INFO line about a missing libtpu on every start, for one, reads as a fault and is not one)."""

from __future__ import annotations

import logging

FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
OWN_LOGGERS = ("jaxserve", "uvicorn")  # the loggers that keep the asked-for level


def configure_logging(level: int | str) -> None:
    """Log to stderr: jaxserve's and uvicorn's records from `level` on (a name like "info", or a number), everything
    else from WARNING on (or from `level`, when that is higher)."""
    number = level if isinstance(level, int) else logging.getLevelName(level.upper())
    logging.basicConfig(level=max(number, logging.WARNING), format=FORMAT)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(number)
