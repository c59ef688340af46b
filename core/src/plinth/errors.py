"""Exceptions the core raises on purpose; each carries a message for users."""


class PlinthError(Exception):
    """Base of plinth's own errors."""


class PluginError(PlinthError):
    """A plugin cannot be found, loaded, or used; the message says why."""


class ConfigError(PlinthError):
    """An option or model configuration is invalid."""


class RequestError(PlinthError):
    """A request is invalid; ``param`` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
