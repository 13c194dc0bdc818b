"""UOMP gateway appliance: remote mTLS gateway, Auth Service, Memory Guard and Memory Store."""

from gateway import native

__version__ = "0.1.0"

native.install()  # the compiled request path, when built from exactly these sources
