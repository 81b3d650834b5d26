"""The project's error types (a leaf module: anything may import it)."""


class ConfigError(ValueError):
    """An invalid configuration, reported as one line before anything compiles."""
