"""Wrapping vLLM functions in place, once: the one mechanism every vLLM patch of this package uses.

vLLM loads the plugin in every process it starts, sometimes twice in one process; a patch
applied twice would wrap its own wrapper. Each wrapper is marked, and a marked function is
never wrapped again.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

#: Attribute marking a vLLM function already wrapped by this package.
_WRAPPED = "_oscar_wrapped"


def wrap_once(owner: Any, name: str, make_wrapper: Callable[[Callable], Callable],
              bind: Callable[[Callable], Any] = lambda f: f) -> None:
    """Replace ``owner.name`` (a plain function or method) by ``bind(make_wrapper(original))``, marked and with the
    original's name and docstring, unless it is wrapped already (so every registration step stays idempotent).
    bind: e.g. staticmethod for a static method of a class."""
    original = getattr(owner, name)
    if is_wrapped(original):
        return
    wrapper = mark_wrapped(functools.wraps(original)(make_wrapper(original)))
    setattr(owner, name, bind(wrapper))


def is_wrapped(function: Callable) -> bool:
    """True when ``function`` is a wrapper this package installed."""
    return getattr(function, _WRAPPED, False)


def mark_wrapped(function: Callable) -> Callable:
    """Mark ``function`` as a wrapper of this package (so it is never wrapped again); returns it."""
    setattr(function, _WRAPPED, True)
    return function
