"""lorax's version, in a module of its own: `lorax/__init__.py` exports it, and the
modules that write it into files (`_adapter`) read it here, not from the package they
are part of."""

__version__ = "0.4.0"
