"""UOMP gateway appliance: remote mTLS gateway, Auth Service, Memory Guard and Memory Store."""

__version__ = "0.1.0"
