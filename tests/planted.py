"""Planted errors kept as tests: a diffpipe module loaded again from its own source with one piece of code changed,
so that a test can show its check failing on the error it exists to catch, on every run, not once by hand.

    flipped = planted("diffpipe.diffusion.objectives", "noise - x0)", "x0 - noise)")
    flipped.make_targets(...)  # the planted copy; diffpipe's own module is untouched

The change must match the source exactly once: a plant that no longer matches the code fails, saying so, rather
than passing by planting nothing.
"""
from __future__ import annotations

import importlib
import inspect
import types

__all__ = ["planted"]


def planted(module_name: str, code: str, error: str) -> types.ModuleType:
    """A copy of `module_name` with `code` replaced by `error`, its own imports resolved as the module's."""
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    found = source.count(code)
    assert found == 1, f"{code!r} is in {module_name} {found} times, not once: the plant no longer matches the code"
    copy = types.ModuleType(module_name, module.__doc__)
    copy.__dict__.update(__file__=module.__file__, __package__=module.__package__)
    exec(compile(source.replace(code, error), f"{module.__file__} (planted)", "exec"), copy.__dict__)
    return copy
