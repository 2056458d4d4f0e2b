"""The error every layer raises for bad user input (a setting, a path, a combination).

It sits below every package so that parallel/, data/ and checkpoint/ can name a bad setting without
importing the config parser; `titanlite.config.run_cli` turns it into one line and exit code 2.
"""


class ConfigError(ValueError):
    """Bad configuration input. The message is one line and names the key or file."""
