"""Errors that end a command with a readable line and exit code 2."""


class ConfigError(Exception):
    """Bad input from a user: a flag, a config file, an address.

    The message is one line that names the problem (the file, the key, the
    value), printed as ``colossalai-exporter: error: <message>`` with exit code 2.
    """
