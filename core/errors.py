"""Errors a user can cause. Each message is one line that names the thing at fault."""


class SpecdeployError(Exception):
    """Base class: the CLI prints these as one line, never a traceback."""


class BundleError(SpecdeployError):
    """A bundle is missing, altered, or of a format this version cannot read."""


class InputError(SpecdeployError):
    """A prompt, token id or setting outside what the bundle allows."""


class ExportError(SpecdeployError):
    """A source model or draft the export stage cannot turn into a bundle."""
