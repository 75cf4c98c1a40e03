"""Device backends of normkit, installed as ``normkit.backends``.

Each subpackage implements the backend contract (see ``docs/design.md``) for one device type and is
imported lazily by :mod:`normkit.dispatch` on the first call that needs it.
"""
