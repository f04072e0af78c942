"""The errors a user can fix, each named for what went wrong; the message of each says which value is wrong and what
to do. `diffpipe` prints them as one line without a traceback (cli.py catches `DiffpipeError`). Every module raises
these; none defines its own."""
from __future__ import annotations

__all__ = ["DiffpipeError", "CommandError", "ConfigError", "DataError", "SplitError", "CheckpointError", "ArchitectureError",
           "ExportError", "Infeasible", "RunFolderError", "TorchVersionError",
           "BadImage"]


class DiffpipeError(Exception):
    """Bad input or a state the user can change; the message says what to do."""


class CommandError(DiffpipeError):
    """A command asked for what cannot be done as given (an argument, a run folder to resume, free disk space)."""


class ConfigError(DiffpipeError, ValueError):
    """A configuration the user must fix; the message names the key and the fix."""


class DataError(DiffpipeError, ValueError):
    """Data that does not suit the model (image size, channels, frames); the message says which setting to change."""


class SplitError(DiffpipeError, ValueError):
    """An impossible split into stages; the message says what to change."""


class CheckpointError(DiffpipeError, ValueError):
    """Model files (a weights file, a pipeline folder, a component such as the VAE) that cannot be used for this
    model; the message says why and what to do."""


class ArchitectureError(DiffpipeError, ValueError):
    """An unknown model.architecture; the message lists what exists."""


class Infeasible(DiffpipeError, ValueError):
    """No partition of the model into stages fits the device's memory; the message names the stage, its need and
    what would help."""


class ExportError(DiffpipeError, ValueError):
    """A run that cannot be exported as asked; the message says why."""


class RunFolderError(DiffpipeError):
    """A run folder cannot be used as asked; the message says why and what to do."""


class BadImage(ValueError):
    """An image (or video) file that cannot be trained on; the message says why. Not a DiffpipeError: the data code
    catches it, skips the file and names it in one warning (data/folder.py's `Skipped`)."""


class TorchVersionError(DiffpipeError, RuntimeError):
    """The installed torch lacks something diffpipe needs."""
