"""The package version, kept in one place (read by hatch and by --version)."""

__version__ = "0.1.0"
