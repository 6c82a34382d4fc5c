"""The one exception family of trainmem.

Everything the user can get wrong (an unknown model, a malformed config, a negative batch, an unknown
recipe) raises a subclass of :class:`TrainmemError` with a one-line message that says what is wrong and
what is accepted. The CLI turns it into that line on stderr and exit code 2; the library lets it propagate.
"""

from __future__ import annotations

from typing import Iterable


class TrainmemError(Exception):
    """Base class of every error trainmem raises on purpose."""


class ModelError(TrainmemError):
    """The model could not be resolved or its config is unusable."""


class ConfigError(TrainmemError):
    """A training setting (recipe, optimizer, batch, ...) is invalid."""


def unknown_choice(what: str, name: str, accepted: Iterable[str]) -> ConfigError:
    """``unknown recipe 'bf16' (did you mean 'amp-bf16'?); accepted: ...``, for the caller to raise."""
    import difflib

    choices = list(accepted)
    close = difflib.get_close_matches(name, choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown {what} {name!r}{hint}; accepted: {', '.join(choices)}")
